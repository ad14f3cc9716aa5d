"""Reports show unfinished runs as such, refuse what they cannot answer, and draw readable figures."""

import json
import re
from pathlib import Path

import pytest

from kvbench import cli
from kvbench.errors import ConfigError
from kvbench.report import comparison_figure, pivot_table, runs_table
from kvbench.runner import run
from tests.conftest import niah_run_config
from tests.test_notebooks import execute

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "compare_methods.ipynb"


def unfinish(run_dir: Path, keep: int) -> None:
    """Make a finished run look interrupted after ``keep`` samples (as Ctrl-C before its end leaves it)."""
    samples = run_dir / "samples.jsonl"
    samples.write_text("".join(samples.read_text().splitlines(keepends=True)[:keep]))
    (run_dir / "metrics.json").unlink()
    status = json.loads((run_dir / "status.json").read_text())
    (run_dir / "status.json").write_text(json.dumps({**status, "state": "interrupted"}))


def table_rows(table: str) -> list[dict[str, str]]:
    lines = [line.strip("|").split(" | ") for line in table.splitlines()]
    header = [cell.strip() for cell in lines[0]]
    return [dict(zip(header, (cell.strip() for cell in row))) for row in lines[2:]]


def test_unfinished_runs_are_shown_with_their_progress(tmp_path, niah_config, capsys):
    full = run(niah_config()).run_dir
    oracle = run(niah_config(method="oracle", budget__token_ratio=0.1)).run_dir
    legacy = run(niah_config(method="streamingllm", budget__token_ratio=0.1)).run_dir
    unfinish(oracle, keep=3)
    unfinish(legacy, keep=1)
    (legacy / "status.json").unlink()  # a run from before status.json: its total is unknown
    rows = {row["method"]: row for row in table_rows(runs_table([tmp_path / "runs"]))}
    assert rows["full"]["status"] == "finished" and rows["full"]["n"] == "4"
    assert rows["oracle"]["status"] == "unfinished 3/4" and rows["oracle"]["score"] == "–"
    assert rows["streamingllm"]["status"] == "unfinished 1"
    failed = json.loads((oracle / "status.json").read_text())
    (oracle / "status.json").write_text(json.dumps({**failed, "state": "failed"}))
    rows = {row["method"]: row for row in table_rows(runs_table([tmp_path / "runs"]))}
    assert rows["oracle"]["status"] == "failed 3/4"
    # pivots and figures compare finished runs only, and say what they left out
    capsys.readouterr()
    grid = pivot_table([tmp_path / "runs"], ["method"], [], value="score")
    assert [row["method"] for row in table_rows(grid)] == ["full"]
    assert "left out 2 run(s) that are not finished" in capsys.readouterr().err
    assert full.exists()


def test_runs_table_tells_runs_of_one_method_apart_by_their_setting(tmp_path, niah_config):
    """Two runs of one method that differ only in a swept key (as a storage-tier sweep makes) get a
    "setting" column naming what sets each apart; runs without a label show "–"."""
    small = run(niah_config(method="oracle", budget__token_ratio=0.1)).run_dir
    large = run(niah_config(method="oracle", budget__token_ratio=0.5)).run_dir
    full = run(niah_config()).run_dir
    settings = {small.name: "budget.token_ratio=0.1", large.name: "budget.token_ratio=0.5"}
    rows = table_rows(runs_table([tmp_path / "runs"], settings=settings))
    assert list(rows[0])[:3] == ["model", "method", "setting"]
    assert {(r["method"], r["setting"]) for r in rows} == {
        ("full", "–"),
        ("oracle", "budget.token_ratio=0.1"),
        ("oracle", "budget.token_ratio=0.5"),
    }
    assert "setting" not in table_rows(runs_table([tmp_path / "runs"]))[0]  # only when asked for
    assert full.exists()


def test_report_refuses_a_missing_folder_and_unknown_columns(tmp_path, niah_config, capsys):
    assert cli.main(["report", str(tmp_path / "no-such-folder")]) == 2
    assert "no results folder" in capsys.readouterr().err
    run(niah_config())
    assert cli.main(["report", str(tmp_path / "runs"), "--where", "methd=full"]) == 2
    err = capsys.readouterr().err
    assert (
        "unknown --where column(s) methd" in err
        and "did you mean method" in err
        and "valid columns: model, method" in err
    )
    assert cli.main(["report", str(tmp_path / "runs"), "--where", "method=full"]) == 0
    assert "| full |" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="unknown --where column"):
        comparison_figure([tmp_path / "runs"], tmp_path / "f.png", where={"nope": "1"})


def test_a_shared_cell_names_the_options_that_separate_the_runs(tmp_path, niah_config):
    run(niah_config())
    run(niah_config(task__question_position="start"))
    with pytest.raises(ConfigError, match="several runs share the cell") as err:
        pivot_table([tmp_path / "runs"], ["method"], [], value="score")
    assert "differ in question" in err.value.message
    assert re.search("--where question=(end|start)", err.value.fix) and "--pivot method,question ''" in err.value.fix
    assert "--rows" not in err.value.fix and "--cols" not in err.value.fix


def capture_figures(monkeypatch):
    import kvbench.plots

    figures = []
    monkeypatch.setattr(kvbench.plots, "_save", lambda fig, path: figures.append(fig) or path)
    return figures


def test_a_one_cell_heatmap_keeps_its_title_inside(tmp_path, monkeypatch):
    from kvbench.plots import niah_heatmap

    figures = capture_figures(monkeypatch)
    niah_heatmap(
        [{"meta": {"length": 1024, "depth": 0.5}, "score": 80.0}],
        tmp_path / "h.png",
        title="smollm2_135m · streamingllm · ratio 0.1",
    )
    fig = figures[0]
    fig.canvas.draw()
    title = fig.axes[0].title.get_window_extent(fig.canvas.get_renderer())
    assert title.x0 >= 0 and title.x1 <= fig.bbox.width and title.y1 <= fig.bbox.height


def test_panels_with_different_depth_grids_keep_their_own_depth_labels(tmp_path, monkeypatch):
    from kvbench.plots import niah_panels

    def records(depths, score):
        return [{"meta": {"length": n, "depth": d}, "score": score} for n in (600, 700) for d in depths]

    figures = capture_figures(monkeypatch)
    niah_panels([("a", records([0.0, 1.0], 50.0)), ("b", records([0.0, 0.5, 1.0], 90.0))], tmp_path / "p.png")
    niah_panels([("a", records([0.0, 1.0], 50.0)), ("b", records([0.0, 1.0], 90.0))], tmp_path / "q.png")

    def labelled(ax):
        return [t.label1.get_text() for t in ax.yaxis.get_major_ticks() if t.label1.get_visible()]

    for fig in figures:
        fig.canvas.draw()
    different, same = figures
    assert labelled(different.axes[0]) == ["0%", "100%"] and labelled(different.axes[1]) == ["0%", "50%", "100%"]
    assert labelled(same.axes[0]) == ["0%", "100%"] and labelled(same.axes[1]) == []  # shared: first column only


def test_the_notebook_finds_the_repositorys_runs_from_notebooks(tmp_path, essays, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "notebooks").mkdir(parents=True)
    run(niah_run_config(repo / "results" / "runs", essays))
    monkeypatch.delenv("KVBENCH_RESULTS", raising=False)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(repo / "notebooks")
    namespace = execute(NOTEBOOK)
    assert Path(namespace["RESULTS"]) == (repo / "results" / "runs").resolve()
    assert len(namespace["runs"]) == 1 and namespace["table"] is not None


def test_the_notebook_says_no_runs_found(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KVBENCH_RESULTS", raising=False)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(tmp_path)
    namespace = execute(NOTEBOOK)
    assert "no runs found under" in capsys.readouterr().out and namespace["table"] is None


def test_paired_report_meets_each_run_with_the_baseline_of_its_data_set(tmp_path):
    """``kvbench report --paired method=full``: each run against the full run of its own data set, on the
    ids both have (an unfinished run counts what it has), with the answers' agreement."""
    import yaml

    from kvbench.compare import paired_report
    from kvbench.results import RunDir

    def write(name, method, dataset, answers, scores, state="finished"):
        run_dir = RunDir(tmp_path / name)
        config = {"model": {"name": "m"}, "method": {"name": method}, "task": {"name": "rag", "dataset": dataset}}
        run_dir.create(yaml.safe_dump(config), {}, total=4)
        for i, (answer, score) in enumerate(zip(answers, scores)):
            run_dir.append({"id": f"{dataset}-{i}", "prediction": answer, "reference": "x", "score": score})
        if state == "finished":
            run_dir.write_metrics({"n": len(scores), "score": sum(scores) / len(scores)})
        run_dir.set_status(state)

    write("a", "full", "musique", ["paris", "rome", "oslo", "bern"], [100, 0, 100, 0])
    write("b", "cacheblend", "musique", ["paris", "madrid", "oslo"], [100, 0, 0], state="running")  # 3 of 4
    write("c", "full", "wikimqa", ["yes", "no", "yes", "no"], [0, 0, 0, 0])
    write("d", "cacheblend", "wikimqa", ["yes", "no", "yes", "no"], [100, 100, 0, 0])
    report = paired_report([tmp_path], "method=full")
    paired, agreement = report.split("## agreement")
    rows = {row["config.task.dataset"]: row for row in table_rows(paired.split("\n\n")[1])}
    assert set(rows) == {"musique", "wikimqa"}  # full is the baseline, never a row
    assert rows["musique"]["n"] == "3" and rows["musique"]["Δ"] == "-33.33"  # (100+0+0 - 100+0+100) / 3
    assert rows["wikimqa"]["n"] == "4" and rows["wikimqa"]["Δ"] == "+50.00"
    agree = {row["config.task.dataset"]: row for row in table_rows(agreement.split("\n\n")[1])}
    assert agree["musique"]["exact %"].startswith("66.7") and agree["wikimqa"]["exact %"].startswith("100.0")
    # b's status says running, but no process holds its lock: an unfinished run, counted with what it has
    assert report.rstrip().endswith("Not finished (compared on the samples they have): b (unfinished, 3 of 4)")
    with pytest.raises(ConfigError, match="bad --paired 'method'"):
        paired_report([tmp_path], "method")


def test_runs_a_figure_would_label_alike_are_told_apart_by_their_differing_config():
    """Two runs of one method that differ in a config key (CacheBlend on a RAM and on a disk store) get
    distinct one-line labels naming that key (the request-stream figure); a run with a label of its own
    keeps it, and the output folder never counts."""
    from kvbench.report import distinct_labels

    configs = [
        {"method": {"name": "full"}, "store": {"tier": "ram"}, "output_dir": "a"},
        {"method": {"name": "cacheblend"}, "store": {"tier": "ram", "disk_gb": 0}, "output_dir": "a"},
        {"method": {"name": "cacheblend"}, "store": {"tier": "disk", "disk_gb": 8}, "output_dir": "b"},
    ]
    assert distinct_labels(["full", "cacheblend", "cacheblend"], configs) == [
        "full",
        "cacheblend · store.disk_gb=0 · store.tier=ram",
        "cacheblend · store.disk_gb=8 · store.tier=disk",
    ]
    # a key a run was recorded without reads as its legacy value; progress bars are not a difference
    craft = [
        {"method": {"name": "cachecraft", "eviction": "lru"}, "progress": False},  # recorded before stats existed
        {"method": {"name": "cachecraft", "eviction": "frequency", "stats": "recompute"}, "progress": True},
        {"method": {"name": "cachecraft", "eviction": "frequency", "stats": "attention"}, "progress": True},
    ]
    assert distinct_labels(["cachecraft"] * 3, craft) == [
        "cachecraft · method.eviction=lru · method.stats=recompute",
        "cachecraft · method.eviction=frequency · method.stats=recompute",
        "cachecraft · method.eviction=frequency · method.stats=attention",
    ]
