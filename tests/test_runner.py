"""Runs end to end on a tiny model: files, resume, crash safety, sweeps."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from kvbench.results import RunDir, load, run_id_for
from kvbench.runner import run

from .conftest import kvbench_in_process

KVBENCH = [sys.executable, "-m", "kvbench"]


def cli_args(tmp_path, essays, *more):
    return [
        "run",
        "model=tiny_llama",
        f"output_dir={tmp_path / 'runs'}",
        "progress=false",
        "task.lengths=[600,700]",
        "task.depths=[0,0.25,0.5,0.75,1]",
        f"task.data_dir={essays}",
        "task.max_new_tokens=4",
        *more,
    ]


def test_a_run_writes_its_directory_and_resumes(tmp_path, niah_config):
    cfg = niah_config()
    first = run(cfg)
    assert first.ran == 4
    run_dir = first.run_dir
    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert run_dir.name == run_id_for(written) and run_dir.name.startswith("niah-full-tiny_llama-")
    assert written["budget"]["token_ratio"] is None  # a dense method ignores (and does not hash) the budget
    for name in ("config.yaml", "samples.jsonl", "metrics.json", "env.json", "heatmap.png"):
        assert (run_dir / name).exists(), name
    records = RunDir(run_dir).records()
    assert [r["id"] for r in records] == ["len600_depth0", "len600_depth1", "len700_depth0", "len700_depth1"]
    assert all({"id", "prediction", "reference", "score", "telemetry"} <= set(r) for r in records)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["n"] == 4 and metrics["ttft_s"] > 0 and metrics["grid"]["600"]["0"] >= 0
    env = json.loads((run_dir / "env.json").read_text())
    assert env["torch"] and env["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    status = (run_dir / "status.json").read_bytes()
    again = run(cfg)
    assert again.ran == 0 and again.metrics["n"] == 4
    assert (run_dir / "status.json").read_bytes() == status  # a finished run revisited keeps its "updated"


def test_a_torn_last_line_is_dropped_and_recomputed(tmp_path, niah_config):
    cfg = niah_config()
    run_dir = run(cfg).run_dir
    samples = run_dir / "samples.jsonl"
    lines = samples.read_text().splitlines(keepends=True)
    samples.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2])
    resumed = run(cfg)
    assert resumed.ran == 2
    assert [json.loads(line)["id"] for line in samples.read_text().splitlines()] == [
        json.loads(line)["id"] for line in lines
    ]


def test_sigkill_loses_no_finished_sample(tmp_path, essays):
    args = cli_args(tmp_path, essays, "task.max_new_tokens=24")
    proc = subprocess.Popen(
        KVBENCH + args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 120
    samples = None
    while time.time() < deadline:
        found = list((tmp_path / "runs").glob("*/samples.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= 2:
            samples = found[0]
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert samples is not None, "the run never wrote a sample"
    kept = [json.loads(line)["id"] for line in samples.read_text().splitlines()]
    assert len(kept) >= 2 and len(kept) == len(set(kept))
    done = kvbench_in_process(*args)  # the resume (the killed run was a real process)
    assert done.returncode == 0, done.stderr
    final = [json.loads(line)["id"] for line in samples.read_text().splitlines()]
    assert final[: len(kept)] == kept and len(final) == len(set(final)) == 10


def test_a_sweep_runs_every_method_and_prints_one_table(tmp_path, essays):
    out = kvbench_in_process(
        *cli_args(
            tmp_path, essays, "-m", "method=full,oracle,streamingllm", "budget.token_ratio=0.1", "task.depths=[0.5]"
        )
    )
    assert out.returncode == 0, out.stderr
    runs = sorted(p.name.split("-")[1] for p in (tmp_path / "runs").iterdir() if not p.name.startswith("."))
    assert runs == ["full", "oracle", "streamingllm"]
    assert out.stdout.count("| niah |") == 3
    frame = load(tmp_path / "runs")
    assert sorted(frame["config.method.name"]) == ["full", "oracle", "streamingllm"]
    assert set(frame["n"]) == {2}
    per_sample = load(tmp_path / "runs", samples=True)
    assert len(per_sample) == 6 and "telemetry.ttft_s" in per_sample.columns


def test_report_diff_and_confidence_interval(tmp_path, niah_config):
    from kvbench.metrics import bootstrap_ci
    from kvbench.report import protocol_diff

    a = run(niah_config()).run_dir
    b = run(niah_config(task__question_position="start")).run_dir
    diff = protocol_diff(a, b)
    assert "config.task.question_position | end | start" in diff and "protocol.question_position" in diff
    assert "config.model.name" not in diff
    low, high = bootstrap_ci([0.0, 100.0] * 20)
    assert low < 50 < high and bootstrap_ci([5.0]) is None
    assert bootstrap_ci([70.0] * 10) == [70.0, 70.0]


def test_report_pivots_one_metric_and_refuses_hidden_runs(tmp_path, niah_config):
    from kvbench.errors import ConfigError
    from kvbench.report import pivot_table

    end = run(niah_config()).metrics
    start = run(niah_config(task__question_position="start")).metrics
    oracle = run(niah_config(method="oracle", budget__token_ratio=0.1)).metrics
    table = pivot_table([tmp_path / "runs"], ["method"], ["question"], value="score")
    lines = table.splitlines()
    assert lines[0] == "| method | end | start |"
    assert lines[2] == f"| full | {end['score']:.4g} | {start['score']:.4g} |"
    assert lines[3].startswith(f"| oracle | {oracle['score']:.4g} | –")
    only = pivot_table([tmp_path / "runs"], ["method", "budget"], [], value="attended", where={"method": "oracle"})
    assert only.splitlines()[2] == f"| oracle | ratio 0.1 | {oracle['attended_tokens']:.4g} |"
    with pytest.raises(ConfigError, match="several runs share the cell"):
        pivot_table([tmp_path / "runs"], ["task"], [], value="score")
    with pytest.raises(ConfigError, match="unknown report column"):
        pivot_table([tmp_path / "runs"], ["nope"], [], value="score")
    # any flattened key of a run works as a column or a filter
    by_window = pivot_table(
        [tmp_path / "runs"],
        ["config.method.name"],
        ["protocol.question_position"],
        value="kv_bytes_ratio",
        where={"config.method.name": "full"},
    )
    assert by_window.splitlines()[2] == "| full | 1 | 1 |"
    dense = pivot_table([tmp_path / "runs"], ["method", "question"], [], where={"config.budget.token_ratio": "None"})
    assert [line.split(" | ")[0] for line in dense.splitlines()[2:]] == ["| full", "| full"]
    # numbers match numbers even where a missing value made pandas hold the column as floats (0.1 vs None)
    ratio = pivot_table([tmp_path / "runs"], ["method"], [], where={"config.budget.token_ratio": "0.10"})
    assert [line.split(" | ")[0] for line in ratio.splitlines()[2:]] == ["| oracle"]


def test_report_draws_the_matching_runs_in_their_tasks_figure(tmp_path, niah_config):
    from kvbench.errors import ConfigError
    from kvbench.report import comparison_figure

    run(niah_config())
    run(niah_config(method="streamingllm", budget__token_ratio=0.1))
    out = comparison_figure([tmp_path / "runs"], tmp_path / "fig" / "niah.png")
    assert out.exists() and out.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ConfigError, match="no finished runs match"):
        comparison_figure([tmp_path / "runs"], tmp_path / "none.png", where={"method": "h2o"})
    assert not (tmp_path / "none.png").exists()


def test_pivot_keys_read_as_numbers_sort_as_numbers():
    import pandas as pd

    from kvbench.report import _label, _natural_order

    assert [_label(v) for v in (256.0, 1024, float("nan"), None, "ratio 0.1")] == ["256", "1024", "–", "–", "ratio 0.1"]
    frame = pd.DataFrame({"x": [1, 2, 3, 4]}, index=["512", "1024", "256", "b"])
    assert list(frame.sort_index(key=_natural_order).index) == ["256", "512", "1024", "b"]


def test_a_replay_that_answers_otherwise_than_recorded_says_so(tmp_path, capsys):
    """A resumed order-dependent run serves its finished samples again (kvbench.runner.Replay): the log
    counts the answers that came out as recorded, and a difference is also a warning on stderr."""
    from types import SimpleNamespace

    from kvbench.runner import Replay

    run_dir = RunDir(tmp_path / "run")
    run_dir.create("{}\n", {}, total=3)
    for i, answer in enumerate(["a", "b"]):
        run_dir.append({"id": f"s{i}", "prediction": answer, "reference": None, "score": 0.0, "telemetry": {}})
    replay = Replay(run_dir, {"s0", "s1"})
    replay.check("s0", SimpleNamespace(prediction="a"))
    replay.check("s1", SimpleNamespace(prediction="c"))
    replay.close()
    replay.close()  # (once)
    log = (run_dir.path / "run.log").read_text()
    assert "serving the 2 finished samples again" in log
    assert log.count("replay: 2 samples served again, 1 answers as recorded") == 1
    assert "warning: replay: 2 samples served again, 1 answers as recorded" in capsys.readouterr().err
