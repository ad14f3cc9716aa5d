"""Scale-out: task.shard=i/n, Hydra's joblib and submitit launchers, per-job device pinning.

Processes that run side by side (two shard workers, a launcher's jobs) are real ``python -m kvbench``
processes; the runs they are compared with, and the runs that need no second process, run in this process
(``kvbench_in_process``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvbench.errors import ConfigError

from .conftest import kvbench_in_process

REPO = Path(__file__).resolve().parent.parent
TINY = ["model=tiny_llama", "task.lengths=[512]", "task.max_new_tokens=4", "progress=false"]
#: processes running side by side take one intra-op thread each (two two-thread processes on CI's two cores
#: would wait on each other at every parallel region); so does the run in this process they are compared
#: with, so that both sides do the same arithmetic
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def kvbench_child(*args, timeout=600):
    """``kvbench <args>`` as a separate process with one intra-op thread."""
    return subprocess.run(
        [sys.executable, "-m", "kvbench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=ONE_THREAD,
    )


def kvbench(*args, threads: int | None = None):
    """``kvbench <args>`` in this process (``threads``: with that many intra-op threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return kvbench_in_process(*args, cwd=REPO)
    finally:
        torch.set_num_threads(before)


def samples_by_run(output_dir: Path) -> dict[str, dict[str, tuple]]:
    """run id -> sample id -> (prediction, score), read straight from the files."""
    out = {}
    for path in sorted(output_dir.glob("*/samples.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out[path.parent.name] = {r["id"]: (r["prediction"], r["score"]) for r in rows}
    return out


# ---------------------------------------------------------------------- shards
def test_shards_partition_the_ids():
    from kvbench.tasks import create_task
    from kvbench.tasks.base import parse_shard

    ids = create_task({"name": "niah", "lengths": [256, 512], "depths": [0, 0.25, 0.5, 0.75, 1]}).sample_ids()
    parts = [
        create_task(
            {"name": "niah", "lengths": [256, 512], "depths": [0, 0.25, 0.5, 0.75, 1], "shard": f"{i}/3"}
        ).shard_sample_ids()
        for i in range(3)
    ]
    assert sorted(sum(parts, [])) == sorted(ids) and len(set(sum(parts, []))) == len(ids)
    assert [len(p) for p in parts] == [4, 3, 3]
    assert parse_shard(None) is None and parse_shard("0/1") is None and parse_shard("1/4") == (1, 4)
    for bad in ("2/2", "-1/2", "a/b", "3"):
        with pytest.raises(ConfigError, match="task.shard"):
            parse_shard(bad)


def test_two_shard_workers_lose_and_duplicate_nothing(tmp_path):
    """Two processes on one run with task.shard=0/2 and 1/2 at the same time: each writes its own run
    directory (no waiting on a lock), and the merged run equals the unsharded one sample for sample."""
    common = [*TINY, "task.depths=[0,0.5,1]", "method=streamingllm", "budget.tokens=64"]
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvbench",
                "run",
                *common,
                f"task.shard={i}/2",
                f"output_dir={tmp_path / 'sharded'}",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ONE_THREAD,
        )
        for i in range(2)
    ]
    for worker in workers:
        _, err = worker.communicate(timeout=600)
        assert worker.returncode == 0, err[-2000:]
    whole = kvbench("run", *common, f"output_dir={tmp_path / 'whole'}", threads=1)
    assert whole.returncode == 0, whole.stderr[-2000:]

    shards = samples_by_run(tmp_path / "sharded")
    ((unsharded_id, expected),) = samples_by_run(tmp_path / "whole").items()
    assert len(shards) == 2
    seen = [i for part in shards.values() for i in part]
    assert sorted(seen) == sorted(expected) and len(seen) == len(set(seen)), "no sample lost, none duplicated"

    from kvbench.results import load

    runs = load(tmp_path / "sharded")
    assert len(runs) == 1
    merged = runs.iloc[0]
    assert merged["run_id"] == unsharded_id, "the merged shards carry the unsharded run's id"
    assert merged["state"] == "finished" and merged["n"] == len(expected)
    whole_runs = load(tmp_path / "whole").iloc[0]
    assert merged["score"] == pytest.approx(whole_runs["score"])
    merged_samples = load(tmp_path / "sharded", samples=True)
    assert {r.id: (r.prediction, r.score) for r in merged_samples.itertuples()} == expected

    report = kvbench("report", str(tmp_path / "sharded"))
    assert report.returncode == 0 and report.stdout.count("| finished |") == 1


def test_a_missing_shard_leaves_the_run_unfinished(tmp_path):
    out = kvbench("run", *TINY, "task.depths=[0,1]", "task.shard=1/2", f"output_dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-2000:]
    from kvbench.results import load

    row = load(tmp_path).iloc[0]
    assert row["state"] == "unfinished" and row["done"] == 1
    assert row["status"] == "unfinished 1 (shards 1/2)"  # says why: the other shard has not run


def test_the_shards_of_a_method_without_a_budget_merge(tmp_path):
    """`full` records its budget as nulls (its runs do not depend on one): a finished set of its
    shards still merges into one finished run with its metrics, and a sweep's closing table reads it."""
    out = kvbench(
        "run", "-m", *TINY, "task.depths=[0,1]", "method=full", "task.shard=0/2,1/2", f"output_dir={tmp_path}"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("| finished |") == 1, "the sweep's table shows the merged run"
    from kvbench.results import load

    row = load(tmp_path).iloc[0]
    assert row["state"] == "finished" and row["n"] == 2 and row["score"] == row["score"]


# ---------------------------------------------------------------------- launchers
def test_joblib_sweep_equals_the_sequential_sweep(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    sweep = ["-m", *TINY, "task.depths=[0,1]", "method=full,streamingllm", "budget.tokens=64"]
    sequential = kvbench("run", *sweep, f"output_dir={tmp_path / 'seq'}", threads=1)
    assert sequential.returncode == 0, sequential.stderr[-2000:]
    parallel = kvbench_child(
        "run", *sweep, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"output_dir={tmp_path / 'par'}"
    )
    assert parallel.returncode == 0, parallel.stderr[-2000:]
    a, b = samples_by_run(tmp_path / "seq"), samples_by_run(tmp_path / "par")
    assert len(a) == 2 and a == b, "same run directories, same predictions and scores"
    assert parallel.stdout.count("| finished |") == 2, "the sweep's table lists the jobs' runs"


def test_submitit_local_executor_runs_the_sweep(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    out = kvbench_child(
        "run",
        "-m",
        *TINY,
        "task.depths=[0.5]",
        "method=full,streamingllm",
        "budget.tokens=64",
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=10",
        f"output_dir={tmp_path}",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    runs = samples_by_run(tmp_path)
    assert len(runs) == 2 and all(len(r) == 1 for r in runs.values())


def test_kvbench_presets_compose():
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_module

    from kvbench.compose import CONFIG_MODULE, register_method_configs

    register_method_configs()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        local = compose("config", overrides=["hydra/launcher=local"], return_hydra_config=True).hydra.launcher
        slurm = compose("config", overrides=["hydra/launcher=slurm"], return_hydra_config=True).hydra.launcher
    assert local._target_.endswith("JoblibLauncher") and local.n_jobs == 2
    assert slurm._target_.endswith("SlurmLauncher") and slurm.gpus_per_node == 1 and slurm.max_num_timeout == 3


def test_device_pinning_spreads_jobs_over_gpus():
    from kvbench.sweep import pinned_device

    assert [pinned_device(i, 4) for i in range(6)] == [0, 1, 2, 3, 0, 1]
    assert pinned_device(3, 1) is None and pinned_device(0, 0) is None


def test_device_pinning_leaves_a_single_run_alone_and_pins_sweep_jobs(monkeypatch: pytest.MonkeyPatch):
    """On a CUDA node, a plain `kvbench run` (no --multirun: Hydra's job number is MISSING) runs where it
    is, and sweep job i takes GPU i mod n. (Reading the MISSING job number used to raise, which stopped
    every single run on a CUDA machine; CI has no GPU, so CUDA is faked here.)"""
    import torch
    from hydra import compose, initialize_config_module
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    from kvbench.compose import CONFIG_MODULE, register_method_configs
    from kvbench.sweep import pin_device

    register_method_configs()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        cfg = compose("config", return_hydra_config=True)
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.delenv("KVBENCH_PIN_DEVICES", raising=False)
    saved = HydraConfig.instance().cfg
    try:
        HydraConfig.instance().set_config(cfg)
        pin_device({"model": {"device": "auto"}})  # a single run: job.num is MISSING
        assert chosen == []
        OmegaConf.set_readonly(cfg.hydra, False)  # (set_config made it read-only)
        with open_dict(cfg):
            cfg.hydra.job.num = 3
        HydraConfig.instance().set_config(cfg)
        pin_device({"model": {"device": "auto"}})
        pin_device({"model": {"device": "cuda:0"}})  # an explicit device is kept
        assert chosen == [1]
    finally:
        HydraConfig.instance().cfg = saved
