"""Cache-Craft's experiments (``kvbench reproduce cachecraft/<artifact>``): the prefill computation metric
``compute_ratio`` (one definition for every method, :func:`kvbench.metrics.prefill_compute_ratio`) and the
five experiment files."""

from __future__ import annotations

import pytest

from kvbench.budget import BudgetConfig
from kvbench.engine.generate import generate
from kvbench.kv.chunks import ChunkStore, StoreConfig
from kvbench.methods import create_method
from kvbench.metrics import prefill_compute_ratio
from kvbench.requests import Segment, join_segments

NEW = 4
ARTIFACTS = ("compute", "quality", "scores", "early_stop", "stream")


def _prompt(random_ids, chunk_order=(0, 1, 2)):
    ids = random_ids(6 + 3 * 30 + 8, seed=5)
    chunks = [tuple(ids[6 + 30 * i : 36 + 30 * i]) for i in range(3)]
    return (
        Segment(tuple(ids[:6]), "prefix"),
        *[Segment(chunks[i], "chunk") for i in chunk_order],
        Segment(tuple(ids[-8:]), "query"),
    )


def _run(loaded, method, segments):
    ids = join_segments(segments)
    out = generate(
        loaded, method, ids, max_new_tokens=NEW, min_new_tokens=NEW, segments=segments, budget=BudgetConfig()
    )
    return {"telemetry": out.telemetry}, len(ids)


def test_a_dense_prefill_computes_exactly_n_times_layers(tiny_llama, random_ids):
    record, _ = _run(tiny_llama, create_method({"name": "full"}), _prompt(random_ids))
    assert prefill_compute_ratio(record) == 1.0


def test_a_full_prefix_hit_computes_its_uncached_share_only(tiny_llama, random_ids):
    method = create_method({"name": "prefix_cache", "warm": "none", "store_prompts": True})
    method.attach_store(ChunkStore(StoreConfig(tier="ram", disk_gb=0)))
    segments = _prompt(random_ids)
    cold, n = _run(tiny_llama, method, segments)
    assert prefill_compute_ratio(cold) == 1.0  # nothing stored yet: every row at every layer
    hit, n = _run(tiny_llama, method, segments)  # the same prompt: a 100 % hit up to the question
    plan = hit["telemetry"]["prefill"]
    uncached = n - plan["reused_tokens"]
    assert uncached == 8 and plan["layers"] == tiny_llama.spec.n_layers
    assert prefill_compute_ratio(hit) == pytest.approx(uncached / n, abs=1e-12)


def test_chunks_precomputed_for_the_request_count_and_cachecrafts_own_count_agrees(tiny_llama, random_ids):
    blend = create_method({"name": "cacheblend", "miss": "precompute", "recompute_ratio": 0.2})
    blend.attach_store(ChunkStore(StoreConfig(tier="ram", disk_gb=0)))
    record, n = _run(tiny_llama, blend, _prompt(random_ids))
    plan, prepared = record["telemetry"]["prefill"], record["telemetry"]["prepared"]
    # the prefix and the three chunks, each precomputed alone before the request's clock
    assert prepared["precomputed_chunks"] == 4 and prepared["precomputed_tokens"] == 6 + 90
    layers = plan["layers"]
    expected = (plan["computed_token_layers"] + 96 * layers) / (n * layers)
    assert prefill_compute_ratio(record) == pytest.approx(expected) and expected > plan["recompute_ratio"]

    craft = create_method({"name": "cachecraft"})
    craft.attach_store(ChunkStore(StoreConfig(tier="ram", disk_gb=0)))
    _run(tiny_llama, craft, _prompt(random_ids))
    record, _ = _run(tiny_llama, craft, _prompt(random_ids, (2, 0, 1)))
    own = record["telemetry"]["method"]["cachecraft"]
    assert prefill_compute_ratio(record) == pytest.approx(own["recomputed_token_layers"] / own["full_token_layers"])
    assert prefill_compute_ratio(record) < 1.0


def test_records_without_the_counts_give_none_and_dense_records_one():
    assert prefill_compute_ratio({"telemetry": {"ttft_s": 1.0}}) == 1.0
    assert prefill_compute_ratio({"telemetry": {}}) is None
    old = {"telemetry": {"prefill": {"recompute_ratio": 0.5, "tokens": 10}}}
    assert prefill_compute_ratio(old) is None


@pytest.mark.parametrize("artifact", ARTIFACTS)
def test_every_cachecraft_experiment_loads_and_names_a_paper_artifact(artifact):
    from kvbench import experiments, papers

    exp = experiments.load_experiment(f"cachecraft/{artifact}")
    assert papers.get_artifact("cachecraft", artifact).id == artifact
    assert {"smoke", "cpu", "paper"} <= set(exp.scales)
