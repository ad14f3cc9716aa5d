"""The runs of a sweep share one chunk store (kvbench.shared.Sweep.chunk_store): each chunk is precomputed
once per sweep instead of once per run, and no run's answers change."""

import pytest

from kvbench.compose import compose
from kvbench.kv.chunks import StoreConfig
from kvbench.results import RunDir
from kvbench.runner import run
from kvbench.shared import Sweep

from .conftest import SHARED_DATA

EXAMPLE = SHARED_DATA / "cacheblend" / "example_inputs"


def test_one_store_per_configuration_with_its_figures_restarted_for_each_run():
    sweep = Sweep()
    first = sweep.chunk_store(StoreConfig())
    first.stats["ram"].hits, first.precomputed, first.precompute_s = 3, 2, 1.5
    again = sweep.chunk_store(StoreConfig())
    assert again is first and again.stats["ram"].hits == 0 and (again.precomputed, again.precompute_s) == (0, 0.0)
    assert sweep.chunk_store(StoreConfig(read_mbps=200.0)) is not first
    assert Sweep().chunk_store(StoreConfig()) is not first  # (another sweep shares nothing)


def _runs(out, *, task, methods, shared):
    base = ["model=tiny_llama", *task, "task.limit=1", "task.max_length=600", "progress=false", f"output_dir={out}"]
    records = []
    with Sweep() as sweep:
        for method in methods:
            records.append(RunDir(run(compose([*base, *method]), sweep=sweep if shared else None).run_dir).records())
    return records


def _precomputed(records):
    return sum(r["telemetry"]["prepared"]["precomputed_chunks"] for r in records)


@pytest.mark.skipif(not EXAMPLE.is_dir(), reason="needs ../shared/data/cacheblend")
def test_a_sweep_precomputes_each_chunk_once_and_answers_as_separate_runs(tmp_path):
    task = ["task=rag", "task.dataset=example", f"task.data_dir={EXAMPLE}"]
    methods = [
        ["method=cacheblend", "method.recompute_ratio=0.15", "method.miss=precompute"],
        ["method=full_reuse"],
        ["method=cacheblend", "method.recompute_ratio=0.5", "method.miss=precompute"],
    ]
    alone = _runs(tmp_path / "alone", task=task, methods=methods, shared=False)
    swept = _runs(tmp_path / "swept", task=task, methods=methods, shared=True)
    assert [[r["prediction"] for r in rs] for rs in swept] == [[r["prediction"] for r in rs] for rs in alone]
    assert all(_precomputed(rs) > 0 for rs in alone), "a run on its own store precomputes its chunks"
    assert _precomputed(swept[0]) == _precomputed(alone[0]) > 0
    assert _precomputed(swept[1]) == _precomputed(swept[2]) == 0, "later runs of the sweep find every chunk"
    # the store figures a run reports are its own: the first run's precomputation is not in the later ones
    assert swept[0][-1]["telemetry"]["method"]["store"]["precomputed"] == _precomputed(swept[0])
    assert [rs[-1]["telemetry"]["method"]["store"]["precomputed"] for rs in swept[1:]] == [0, 0]
    assert swept[2][-1]["telemetry"]["method"]["store"]["ram_hits"] > 0


@pytest.mark.skipif(not EXAMPLE.is_dir(), reason="needs ../shared/data/cacheblend")
def test_a_request_stream_starts_every_run_of_a_sweep_on_an_empty_store(tmp_path):
    task = [
        "task=rag_stream",
        "task.dataset=example",
        f"task.data_dir={EXAMPLE}",
        "task.repeats=1",
        "task.warmup=0",
        "store.disk_gb=0",
    ]
    methods = [["method=cacheblend", "method.miss=precompute"], ["method=full_reuse"]]
    swept = _runs(tmp_path, task=task, methods=methods, shared=True)
    assert _precomputed(swept[0]) > 0 and _precomputed(swept[1]) == _precomputed(swept[0])
