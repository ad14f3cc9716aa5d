"""The profiling tools under tools/ run where CI runs (a CPU), so they do not rot between GPU sessions."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_profile_kmeans_times_every_variant_and_restores_the_module(tmp_path: Path, capsys: pytest.CaptureFixture):
    from kvbench.methods.primitives import kmeans as kmeans_module

    tool = load("profile_kmeans")
    before = {name: getattr(kmeans_module, name) for name in tool.SETTINGS}
    argv = ["--device", "cpu", "--length", "400", "--repeats", "1", "--pq-iters", "3", "--out", str(tmp_path)]
    summary = tool.main(argv)
    assert {name: getattr(kmeans_module, name) for name in tool.SETTINGS} == before
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    ckv, pq = summary["cases"]["clusterkv"], summary["cases"]["pqcache"]
    assert ckv["problems"] == [8, 400 - 16, 128] and ckv["k"] == round(384 / 80)
    assert pq["problems"] == [16, 400 - 32, 64] and pq["k"] == 64
    for case in (ckv, pq):
        for label in tool.VARIANTS:
            assert case[label]["s"] > 0 and case[label]["updates"] >= 1
        assert case["profile"]["by_cpu"] and "host_reads" in case["profile"]
    assert 1 <= pq["serial"]["updates"] <= 3  # the cap
    assert "atomic/serial" in capsys.readouterr().out
