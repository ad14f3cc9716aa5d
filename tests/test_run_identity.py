"""A method key added after runs were recorded names its legacy value (``param(..., legacy=)``): a run at
that value is the run recorded before the key existed (same id, resumable), any other value is a new run."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvbench.results import config_hash, identity, run_id_for

RECORD = Path(__file__).resolve().parents[1] / "benchmarks/records/cacheblend-fig12"


def _recorded() -> tuple[str, dict]:
    folder = sorted(p for p in RECORD.iterdir() if p.name.startswith("rag-cacheblend-"))[0]
    return folder.name, yaml.safe_load((folder / "config.yaml").read_text())


def test_a_recorded_run_keeps_its_id_when_keys_are_added_at_their_legacy_value():
    name, recorded = _recorded()
    assert "check_rows" not in recorded["method"]  # recorded before the key existed
    assert run_id_for(recorded) == name
    legacy = {**recorded, "method": {**recorded["method"], "check_rows": "all", "deviation": "v"}}
    assert run_id_for(legacy) == name
    assert identity(legacy)["method"] == recorded["method"]


def test_another_value_of_an_added_key_is_another_run():
    name, recorded = _recorded()
    for key, value in (("check_rows", "selected"), ("deviation", "k")):
        changed = {**recorded, "method": {**recorded["method"], key: value}}
        assert run_id_for(changed) != name
        assert config_hash(changed) != config_hash(recorded)


def test_keys_without_a_legacy_value_are_always_part_of_the_id():
    _, recorded = _recorded()
    other = {**recorded, "method": {**recorded["method"], "recompute_ratio": 0.3}}
    assert config_hash(other) != config_hash(recorded)


def test_planning_a_recorded_experiment_writes_nothing_into_its_records(tmp_path):
    """`kvbench reproduce --dry-run` over a record folder reads it and leaves every file and the folder's
    listing as they were (the output-folder check used to create and delete a probe file in it)."""
    import os
    import shutil

    from kvbench.reproduce import reproduce

    from .conftest import SHARED_DATA

    if not (SHARED_DATA / "cacheblend").is_dir():
        pytest.skip("needs ../shared/data/cacheblend (the experiment's data is checked while planning)")
    records = tmp_path / "records"
    shutil.copytree(RECORD, records)
    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in records.rglob("*")}
    listing = sorted(os.listdir(records))
    mtime = records.stat().st_mtime_ns
    reproduce("cacheblend/fig12", "cpu", [f"output_dir={records}"], dry_run=True)
    assert {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in records.rglob("*")} == before
    assert sorted(os.listdir(records)) == listing and records.stat().st_mtime_ns == mtime


# ---------------------------------------------------------------------- task keys (rag_stream's zipf stream)
FIG14 = Path(__file__).resolve().parents[1] / "benchmarks/records/fig14-smollm2"


def _recorded_stream() -> tuple[str, dict]:
    folder = sorted(p for p in FIG14.iterdir() if p.name.startswith("rag_stream-full-"))[0]
    return folder.name, yaml.safe_load((folder / "config.yaml").read_text())


def test_a_recorded_stream_run_keeps_its_id_with_the_new_task_keys_at_their_legacy_value():
    from kvbench.tasks.rag_stream import STREAM_KEYS

    name, recorded = _recorded_stream()
    assert "popularity" not in recorded["task"]  # recorded before the zipf stream existed
    assert run_id_for(recorded) == name
    legacy = {**recorded, "task": {**recorded["task"], **STREAM_KEYS}}
    assert STREAM_KEYS["popularity"] == "repeat" and run_id_for(legacy) == name
    assert identity(legacy)["task"] == recorded["task"]


def test_another_value_of_a_new_task_key_is_another_run():
    from kvbench.tasks.rag_stream import STREAM_KEYS, RagStream

    name, recorded = _recorded_stream()
    zipf = {**recorded["task"], **STREAM_KEYS, "popularity": "zipf", "chunk_tokens": None}
    runs = {
        run_id_for({**recorded, "task": task})
        for task in (
            recorded["task"],
            zipf,
            {**zipf, "zipf_s": 1.0},
            {**zipf, "requests": 100},
            {**zipf, "candidates": 8},
        )
    }
    assert len(runs) == 5 and name in runs
    # a zipf run keeps every key in its id and recorded config, also at the default (a later change of a
    # default cannot rename or reinterpret it)
    assert RagStream.recorded_config(zipf) == zipf and identity({**recorded, "task": zipf})["task"] == zipf


def test_a_dry_run_of_the_recorded_stream_experiment_finds_its_runs(tmp_path, capsys):
    """`kvbench reproduce cacheblend/fig14 --dry-run` over the 2026-11-27 record folder (a copy) finds its
    full and prefix-caching runs finished: the task keys added since leave their ids as they were (its
    CacheBlend run, ``cacheblend_allrows``, is no longer a point of the experiment: the two CacheBlend
    points, the authors' way, are not started there); over the 2026-11-29 folder all four are finished."""
    import shutil

    from kvbench.reproduce import reproduce

    from .conftest import SHARED_DATA

    if not (SHARED_DATA / "cacheblend").is_dir():
        pytest.skip("needs ../shared/data/cacheblend (the experiment's data is checked while planning)")
    records = tmp_path / "records"
    shutil.copytree(FIG14, records)
    reproduce("cacheblend/fig14", "cpu", [f"output_dir={records}"], dry_run=True)
    out = capsys.readouterr().out
    runs = [line for line in out.splitlines() if str(records) in line and "rag_stream-" in line]
    assert len(runs) == 4, out
    assert sorted(line.split()[0] for line in runs if "rag_stream-cacheblend-" not in line) == ["finished"] * 2, out
    assert all(line.split()[0] != "finished" for line in runs if "rag_stream-cacheblend-" in line), out
    again = tmp_path / "again"
    shutil.copytree(FIG14.with_name("fig14-smollm2-prefill"), again)
    reproduce("cacheblend/fig14", "cpu", [f"output_dir={again}"], dry_run=True)
    out = capsys.readouterr().out
    runs = [line for line in out.splitlines() if str(again) in line and "rag_stream-" in line]
    assert len(runs) == 4 and all(line.split()[0] == "finished" for line in runs), out
