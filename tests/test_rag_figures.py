"""The rag task's CacheBlend figures from synthetic run records (no model): the series each figure
holds, what is drawn, and the `kvbench report --figure --figure-kind` dispatch."""

import numpy as np
import pytest
import yaml

from kvbench import cli
from kvbench.errors import ConfigError
from kvbench.figures import rag
from kvbench.figures.legend import paper_legend
from kvbench.figures.rag import FIGURE_KINDS
from kvbench.report import FigureRun, comparison_figure
from kvbench.results import RunDir

N_LAYERS = 4
LEGEND = paper_legend("cacheblend")  # the methods' names and styles: CacheBlend's, from its paper data


def figure(kind, runs):
    """The panels, title, caption and column count of figure ``kind`` of ``runs``."""
    return rag.BUILDERS[kind](rag.run_infos(runs, LEGEND), LEGEND)


def dev(scale, attention, spearman=(0.2, 0.9, 0.8), top15=0.4):
    """One sample's profile.deviation record: layer 0 does not deviate (as a real prefill's), layer l's
    quantile curve rises linearly to ``scale * l``."""
    return {
        "reused_kv_quantiles": [list(np.linspace(0, scale * layer, 101)) for layer in range(N_LAYERS)],
        "reused_kv_mean": [0.0] + [scale * layer / 2 for layer in range(1, N_LAYERS)],
        "reused_kv_top15_share": [0.0] + [top15] * (N_LAYERS - 1),
        "spearman": list(spearman),
        "attention": [0.0] + [attention] * (N_LAYERS - 1),
        "attention_mean": attention,
    }


def fake_run(method, scores, ttfts, *, model="smollm2_135m", dataset="musique", deviations=None, **params):
    """A finished rag run as report hands it to the task: (title, records) with its resolved config."""
    records = []
    for i, (score, ttft) in enumerate(zip(scores, ttfts)):
        telemetry = {"ttft_s": ttft}
        if deviations is not None:
            telemetry["prefill"] = {"deviation": deviations[i]}
        records.append(
            {"id": f"{dataset}-{i}", "score": score, "telemetry": telemetry, "protocol": {"dataset": dataset}}
        )
    if method == "cacheblend":
        params = {"recompute_ratio": 0.15, "selection": "hkvd", "check_layer": 1, **params}
    config = {
        "model": {"name": model},
        "method": {"name": method, **params},
        "task": {"name": "rag", "dataset": dataset, "data_dir": "../shared/data/cacheblend", "limit": len(scores)},
        "profile": {"deviation": deviations is not None},
    }
    return FigureRun(method, records, config)


def sweep():
    """full, full_reuse, prefix_cache and cacheblend at three ratios (listed out of order)."""
    return [
        fake_run("cacheblend", [40, 50, 60], [0.5, 0.6, 0.7], recompute_ratio=0.5),
        fake_run("full", [50, 60, 70], [2.0, 2.0, 2.0]),
        fake_run("cacheblend", [10, 20, 30], [0.2, 0.3, 0.4], recompute_ratio=0.05),
        fake_run("full_reuse", [0, 10, 20], [0.1, 0.1, 0.1]),
        fake_run("prefix_cache", [50, 60, 70], [1.5, 1.6, 1.7]),
        fake_run("cacheblend", [30, 40, 50], [0.3, 0.4, 0.5], recompute_ratio=0.15),
    ]


@pytest.fixture
def figures(monkeypatch):
    """The matplotlib figures drawn, instead of PNG files."""
    import kvbench.plots

    drawn = []
    monkeypatch.setattr(kvbench.plots, "_save", lambda fig, path: drawn.append(fig) or path)
    return drawn


def by_label(panel):
    return {series.label: series for series in panel.series}


def legend(ax):
    return [text.get_text() for text in ax.get_legend().get_texts()]


# ---------------------------------------------------------------------- Fig. 12
def test_quality_vs_ttft_has_one_point_per_run_and_cacheblend_in_ratio_order():
    (panel,), title, caption, _ = figure("quality_ttft", sweep())
    series = by_label(panel)
    assert list(series) == ["Full KV recompute", "Prefix caching", "Full KV reuse", "CacheBlend"]
    blend = series["CacheBlend"]
    assert blend.kind == "line" and blend.notes == ["r=0.05", "r=0.15", "r=0.5"]
    assert blend.x == pytest.approx([0.3, 0.4, 0.6]) and blend.y == pytest.approx([20, 40, 50])
    full = series["Full KV recompute"]
    assert full.kind == "points" and full.x == pytest.approx([2.0]) and full.y == pytest.approx([60])
    assert all(lo <= y <= hi and lo < hi for s in panel.series for lo, y, hi in zip(s.low, s.y, s.high))
    assert (
        "smollm2_135m" in title
        and "MuSiQue" in title
        and panel.xlabel == "mean TTFT (s)"
        and panel.ylabel == "F1 (0–100)"
    )
    assert "bootstrap" in caption and "precomputation is excluded" in caption and "n = 3" in caption


def test_quality_vs_ttft_draws_labelled_points_with_error_bars(figures, tmp_path):
    comparison_figure_of(sweep(), tmp_path / "q.png", None)
    (fig,) = figures
    ax = fig.axes[0]
    assert legend(ax) == ["Full KV recompute", "Prefix caching", "Full KV reuse", "CacheBlend"]
    assert sorted(t.get_text() for t in ax.texts) == ["r=0.05", "r=0.15", "r=0.5"]
    assert ax.get_xlim()[0] == 0 and "TTFT" in ax.get_xlabel() and "F1" in ax.get_ylabel()
    assert "smollm2_135m" in fig._suptitle.get_text()
    assert any("bootstrap" in t.get_text() for t in fig.texts)  # the caption


def test_settings_that_differ_within_a_method_split_its_series():
    runs = sweep() + [fake_run("cacheblend", [5, 5, 5], [0.3, 0.3, 0.3], recompute_ratio=0.15, selection="random")]
    (panel,), *_ = figure("quality_ttft", runs)
    series = by_label(panel)
    assert series["CacheBlend (selection=random)"].y == pytest.approx([5])
    assert series["CacheBlend (selection=hkvd)"].notes == ["r=0.05", "r=0.15", "r=0.5"]
    assert "Full KV recompute" in series  # the other methods keep their plain names


def test_each_model_and_dataset_gets_its_own_panel():
    runs = sweep() + [fake_run("full", [1, 2], [3.0, 3.0], model="qwen25_05b", dataset="wikimqa")]
    panels, title, *_ = figure("quality_ttft", runs)
    assert [p.title for p in panels] == ["qwen25_05b · 2WikiMQA", "smollm2_135m · MuSiQue"]
    assert "smollm2_135m" not in title  # named by the panels instead


def test_multi_news_is_scored_by_rouge_l():
    (panel,), _, caption, _ = figure("quality_ttft", [fake_run("full", [20, 30], [1, 1], dataset="multi_news")])
    assert panel.ylabel == "Rouge-L F (0–100)" and "Rouge-L" in caption


# ---------------------------------------------------------------------- Fig. 16
def test_ratio_figure_draws_cacheblend_as_curves_and_the_rest_as_reference_lines(figures, tmp_path):
    (quality, ttft), title, _, _ = figure("ratio", sweep())
    blend = by_label(quality)["CacheBlend"]
    assert blend.x == pytest.approx([0.05, 0.15, 0.5]) and blend.y == pytest.approx([20, 40, 50])
    assert by_label(ttft)["CacheBlend"].y == pytest.approx([0.3, 0.4, 0.6])
    full = by_label(quality)["Full KV recompute"]
    assert full.kind == "hline" and full.y == pytest.approx([60]) and full.low[0] < 60 < full.high[0]  # CI band
    assert by_label(quality)["Full KV reuse"].kind == "hline" and by_label(ttft)["Full KV reuse"].y == pytest.approx(
        [0.1]
    )
    assert quality.xpercent and "recompute ratio" in quality.xlabel and "TTFT (s)" in ttft.ylabel
    comparison_figure_of(sweep(), tmp_path / "r.png", "ratio")
    (fig,) = figures
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert list(lines["Full KV recompute"].get_ydata()) == [60, 60]  # a horizontal line at full's mean
    curves = {bars.get_label(): bars.lines[0] for bars in fig.axes[0].containers}  # errorbar containers
    assert list(curves["CacheBlend"].get_xdata()) == pytest.approx([0.05, 0.15, 0.5])
    assert fig.axes[1].get_ylim()[0] == 0


def test_ratio_figure_needs_cacheblend_runs():
    with pytest.raises(ConfigError, match="needs cacheblend runs"):
        figure("ratio", [fake_run("full", [1, 2], [1, 1])])


# ---------------------------------------------------------------------- Figs. 7-8
def profiled_sweep():
    same = [dev(10.0, 2.0), dev(30.0, 4.0)]
    return [
        fake_run("full_reuse", [0, 0], [0.1, 0.1], deviations=same),
        fake_run("cacheblend", [0, 0], [0.2, 0.2], deviations=[dev(10.0, 1.0), dev(30.0, 2.0)]),
        fake_run(
            "prefix_cache", [0, 0], [0.5, 0.5], deviations=[dev(2.0, 0.0, spearman=(None, 0.5, 0.4), top15=0.9)] * 2
        ),
        fake_run("full", [0, 0], [1.0, 1.0]),  # no deviation telemetry: left out
    ]


def test_deviation_figure_shows_the_middle_layer_ranked_and_spearman_by_layer():
    (spread, rho), title, caption, _ = figure("deviation", profiled_sweep())
    series = by_label(spread)
    # full_reuse and cacheblend reuse the same caches: identical records, one line
    assert list(series) == ["Prefix caching", "Full KV reuse, CacheBlend (r=0.15)"]
    curve = series["Full KV reuse, CacheBlend (r=0.15)"]
    layer = N_LAYERS // 2
    assert spread.title.startswith(f"KV deviation on layer {layer} (of {N_LAYERS})")
    assert curve.x[0] == 0 and curve.x[-1] == 1 and len(curve.x) == 101
    assert curve.y[0] == pytest.approx(20.0 * layer) and curve.y[-1] == 0  # mean of 10*l and 30*l, largest first
    assert spread.shade == (0.0, 0.15) and "top 15% of tokens: 90%, 40%" in spread.note
    merged = by_label(rho)["Full KV reuse, CacheBlend (r=0.15)"]
    assert merged.x == [1, 2] and merged.y == pytest.approx([0.9, 0.8])  # the pair with layer 0 has nothing to rank
    assert by_label(rho)["Prefix caching"].x == [1, 2] and rho.ylim[1] > 1 and rho.xinteger
    assert "layer 0" in caption and "squared L2" in caption


def test_deviation_figure_needs_profiled_runs():
    with pytest.raises(ConfigError, match=r"profile\.deviation=true"):
        figure("deviation", sweep())


# ---------------------------------------------------------------------- Fig. 6
def test_selection_figure_compares_hkvd_and_random_by_ratio(figures, tmp_path):
    runs = [
        fake_run("full_reuse", [0, 0], [0.1, 0.1], deviations=[dev(1.0, 8.0), dev(1.0, 10.0)]),
        fake_run("prefix_cache", [0, 0], [0.5, 0.5], deviations=[dev(1.0, 0.0)] * 2),
    ]  # exact: not in Fig. 6
    for r, hkvd, rand in [(0.3, (2.0, 4.0), (5.0, 7.0)), (0.05, (5.0, 6.0), (8.0, 9.0))]:
        runs.append(
            fake_run(
                "cacheblend",
                [0, 0],
                [0.2, 0.2],
                recompute_ratio=r,
                selection="hkvd",
                deviations=[dev(1.0, a) for a in hkvd],
            )
        )
        runs.append(
            fake_run(
                "cacheblend",
                [0, 0],
                [0.2, 0.2],
                recompute_ratio=r,
                selection="random",
                deviations=[dev(1.0, a) for a in rand],
            )
        )
    (panel,), title, caption, _ = figure("selection", runs)
    series = by_label(panel)
    assert list(series) == ["Full KV reuse", "CacheBlend, HKVD selection", "CacheBlend, random selection"]
    assert series["CacheBlend, HKVD selection"].x == pytest.approx([0.05, 0.3])
    assert series["CacheBlend, HKVD selection"].y == pytest.approx([5.5, 3.0])
    assert series["CacheBlend, random selection"].y == pytest.approx([8.5, 6.0])
    low, high = series["CacheBlend, random selection"].low, series["CacheBlend, random selection"].high
    assert high[0] - low[0] == pytest.approx(2 * 0.5)  # ±1 standard error of (8, 9)
    assert series["Full KV reuse"].kind == "hline" and series["Full KV reuse"].y == pytest.approx([9.0])
    assert "HKVD" in title and "attention" in panel.ylabel and "standard error" in caption
    comparison_figure_of(runs, tmp_path / "s.png", "selection")
    assert legend(figures[0].axes[0]) == list(series)


def test_selection_figure_needs_profiled_cacheblend_runs():
    with pytest.raises(ConfigError, match="cacheblend runs with profile.deviation=true"):
        figure("selection", sweep())


def test_unscored_runs_have_no_quality_figure():
    with pytest.raises(ConfigError, match="has a score"):
        figure("quality_ttft", [fake_run("full", [None, None], [1, 1], dataset="example")])


# ---------------------------------------------------------------------- kvbench report --figure
def comparison_figure_of(runs, path, kind):
    from kvbench.tasks.rag import Rag

    return Rag.comparison_figure(runs, path, kind=kind)


def write_runs(root, runs):
    """The synthetic runs as finished run directories."""
    for index, run in enumerate(runs):
        run_dir = RunDir(root / f"rag-{run.config['method']['name']}-{index}")
        records = run[1]
        run_dir.create(yaml.safe_dump(run.config), {}, total=len(records))
        for record in records:
            run_dir.append(record)
        scores = [r["score"] for r in records if r["score"] is not None]
        run_dir.write_metrics({"n": len(records), "score": float(np.mean(scores)) if scores else None})
        run_dir.set_status("finished")


@pytest.mark.parametrize("kind", FIGURE_KINDS)
def test_report_draws_every_kind_to_a_png(kind, tmp_path, capsys):
    write_runs(
        tmp_path / "runs",
        sweep()
        + profiled_sweep()[:2]
        + [
            fake_run(
                "cacheblend",
                [1, 2],
                [0.3, 0.3],
                recompute_ratio=0.3,
                selection="random",
                deviations=[dev(1.0, 3.0), dev(1.0, 4.0)],
            )
        ],
    )
    out = tmp_path / "figs" / f"{kind}.png"
    assert (
        cli.main(["report", str(tmp_path / "runs"), "--figure", str(out), "--where", "task=rag", "--figure-kind", kind])
        == 0
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(out) in capsys.readouterr().out


def test_report_defaults_to_quality_vs_ttft_and_names_the_other_kinds(tmp_path, capsys):
    write_runs(tmp_path / "runs", sweep())
    out = tmp_path / "default.png"
    assert comparison_figure([tmp_path / "runs"], out, where={"task": "rag"}) == out and out.exists()
    assert "drew the quality_ttft figure; --figure-kind ratio|deviation|selection" in capsys.readouterr().err


def test_report_refuses_an_unknown_kind_in_one_line_and_writes_nothing(tmp_path, capsys):
    write_runs(tmp_path / "runs", sweep())
    out = tmp_path / "figs" / "x.png"
    assert cli.main(["report", str(tmp_path / "runs"), "--figure", str(out), "--figure-kind", "heatmap"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no figure kind 'heatmap'" in err[0] and "--figure-kind quality_ttft or ratio" in err[0]
    assert not out.parent.exists()


def test_a_task_with_one_figure_refuses_a_kind(tmp_path):
    run_dir = RunDir(tmp_path / "runs" / "niah-full")
    run_dir.create(
        yaml.safe_dump({"model": {"name": "m"}, "method": {"name": "full"}, "task": {"name": "niah"}}), {}, total=1
    )
    run_dir.append({"id": "a", "score": 1.0, "meta": {"length": 100, "depth": 0.5}})
    run_dir.write_metrics({"n": 1, "score": 1.0})
    run_dir.set_status("finished")
    with pytest.raises(ConfigError, match="drop --figure-kind"):
        comparison_figure([tmp_path / "runs"], tmp_path / "n.png", kind="ratio")
    assert not (tmp_path / "n.png").exists()


def test_an_experiment_figure_item_draws_the_kind_it_names(tmp_path):
    """`render: [{figure: {kind: K}}]` in an experiment file draws the task's figure K of its runs (the
    runs' configs reach the figure, which places them by their settings); a kind the task lacks is one
    clear error."""
    from kvbench.render import render_figure
    from kvbench.reproduce import our_runs

    write_runs(tmp_path / "runs", sweep())
    runs = our_runs(sorted((tmp_path / "runs").iterdir()))
    (section,) = render_figure(None, {"kind": "ratio", "split": ["model"]}, runs, tmp_path, "exp")
    (path,) = section.figures
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ConfigError, match="no figure kind 'heatmap'"):
        render_figure(None, {"kind": "heatmap"}, runs, tmp_path, "bad")
    assert not (tmp_path / "bad-0.png").exists()


def test_the_figures_name_no_method():
    """kvbench/figures/ knows no method by name (no string that is one, no `method=...` hint naming one):
    labels, styles and the baseline, subject and reuse roles all come from the legend."""
    import ast
    import re
    from pathlib import Path

    from kvbench.methods import PARAMS as KVBENCH_METHODS  # every registered method's name

    named = []
    for path in sorted(Path(rag.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                hinted = {m for hint in re.findall(r"method=([a-z_,]+)", node.value) for m in hint.split(",")}
                named += [f"{path.name}:{node.lineno}: {m}" for m in KVBENCH_METHODS if m == node.value or m in hinted]
    assert named == []


def test_a_paper_legend_is_checked_when_the_paper_loads(tmp_path):
    from kvbench.papers import PaperDataError, load_file, papers_dir

    data = yaml.safe_load((papers_dir() / "cacheblend.yaml").read_text(encoding="utf-8"))
    assert load_file(papers_dir() / "cacheblend.yaml").legend["roles"]["subject"] == "cacheblend"
    for bad, message in (
        ({"methods": {"nope": {"label": "N"}}, "roles": {}}, "unknown method 'nope'"),
        ({"methods": {"full": {"color": "#000"}}, "roles": {}}, "full needs a label"),
        ({"methods": {"full": {"label": "F", "width": "2"}}, "roles": {}}, "full takes label, color"),
        ({"methods": {"full": {"label": "F"}}, "roles": {"baseline": "full"}}, "legend.roles must name"),
    ):
        path = tmp_path / "cacheblend.yaml"
        path.write_text(yaml.safe_dump({**data, "legend": bad}), encoding="utf-8")
        with pytest.raises(PaperDataError, match=message):
            load_file(path)
