"""Cache-Craft's score experiment and the stream's chunk-store hit rate: the per-chunk deviation of
``profile.deviation`` (0 for a chunk reused after exactly its creating prefix, > 0 after another), the
Spearman helper of the ``chunk_scores`` render item on hand-made data, and ``chunk_hit_rate`` (chunks
found in the store / looked up, warm-up left out) for the reuse methods."""

from __future__ import annotations

import pytest

from kvbench.budget import BudgetConfig
from kvbench.engine.generate import generate
from kvbench.kv.chunks import ChunkStore, StoreConfig
from kvbench.methods import create_method
from kvbench.metrics import chunk_hit_rate
from kvbench.profile import Profile
from kvbench.render.chunk_scores import chunk_rows, ranks, spearman
from kvbench.requests import Segment, join_segments

NEW = 2


def _parts(random_ids):
    ids = random_ids(6 + 3 * 30 + 8 + 8, seed=9)
    chunks = [tuple(ids[6 + 30 * i : 36 + 30 * i]) for i in range(3)]
    return tuple(ids[:6]), chunks, (tuple(ids[-16:-8]), tuple(ids[-8:]))


def _prompt(parts, order, query=0):
    prefix, chunks, queries = parts
    return (
        Segment(prefix, "prefix"),
        *[Segment(chunks[i], "chunk") for i in order],
        Segment(queries[query], "query"),
    )


def _run(loaded, method, segments, deviation=False):
    out = generate(
        loaded,
        method,
        join_segments(segments),
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        segments=segments,
        budget=BudgetConfig(),
        profile=Profile(deviation=deviation),
    )
    return {"id": "r", "telemetry": out.telemetry}


def _store():
    return ChunkStore(StoreConfig(tier="ram", disk_gb=0))


# ---------------------------------------------------------------------- per-chunk deviation
def test_a_chunk_reused_after_its_creating_prefix_does_not_deviate_and_one_moved_does(tiny_llama, random_ids):
    parts = _parts(random_ids)
    craft = create_method({"name": "cachecraft", "cfo": 0.0})  # reuse every variant as it is
    craft.attach_store(_store())
    _run(tiny_llama, craft, _prompt(parts, (0, 1, 2)))
    # chunks 0 and 1 after the same prefix as when they were made (another question after them); chunk 2
    # now directly after chunk 0: its variant was made after chunks 0 and 1
    record = _run(tiny_llama, craft, _prompt(parts, (0, 1, 2), query=1), deviation=True)
    same = record["telemetry"]["prefill"]["deviation"]["chunks"]
    assert [c["begin"] for c in same] == [0, 6, 36, 66] and same[0]["mode"] == "prefix"
    assert all(c["reused_v"] < 1e-8 and c["blended_v"] < 1e-8 for c in same)
    moved = _run(tiny_llama, craft, _prompt(parts, (0, 2, 1), query=1), deviation=True)
    chunks = {c["begin"]: c for c in moved["telemetry"]["prefill"]["deviation"]["chunks"]}
    assert chunks[6]["reused_v"] < 1e-8  # chunk 0: still right after the prefix
    assert chunks[36]["reused_v"] > 1e-4 and chunks[66]["reused_v"] > 1e-4  # chunks 2 and 1: new contexts
    rows = chunk_rows([moved])  # joined with Cache-Craft's per-chunk scores on begin
    assert [(r["begin"], r["action"]) for r in rows] == [(6, "reuse"), (36, "reuse"), (66, "reuse")]
    assert rows[0]["one_minus_beta_prime"] == 0.0 and rows[1]["one_minus_beta_prime"] > 0
    assert all(r["cci_x_one_minus_beta_prime"] == pytest.approx(r["cci"] * r["one_minus_beta_prime"]) for r in rows)


def test_the_fix_lowers_what_is_left_of_the_deviation(tiny_llama, random_ids):
    parts = _parts(random_ids)
    craft = create_method({"name": "cachecraft", "cfo": 0.5, "new_variant_cfo": 1.0})
    craft.attach_store(_store())
    _run(tiny_llama, craft, _prompt(parts, (0, 1, 2)))
    record = _run(tiny_llama, craft, _prompt(parts, (2, 1, 0)), deviation=True)
    rows = chunk_rows([record])
    assert {r["action"] for r in rows} == {"fix"} and len(rows) == 3
    assert all(r["blended_v"] < r["reused_v"] for r in rows if r["reused_v"] > 1e-4)


# ---------------------------------------------------------------------- Spearman
def test_ranks_average_ties():
    assert ranks([10, 30, 20, 20]).tolist() == [1.0, 4.0, 2.5, 2.5]


def test_spearman_on_hand_made_data():
    perfect = spearman([1, 2, 3, 4, 5], [10, 20, 30, 40, 1000])
    assert perfect["rho"] == pytest.approx(1.0) and perfect["test"] == "exact"
    assert perfect["p"] == pytest.approx(2 / 120)  # the identity and the reversal of 5! orders
    assert spearman([1, 2, 3, 4, 5], [5, 4, 3, 2, 1])["rho"] == pytest.approx(-1.0)
    # d = rank differences (0, 0, 1, -1, 0): rho = 1 - 6 sum d^2 / (n (n^2 - 1)) = 1 - 12 / 120
    swapped = spearman([1, 2, 3, 4, 5], [1, 2, 4, 3, 5])
    assert swapped["rho"] == pytest.approx(0.9)
    lo, hi = swapped["ci"]
    assert -1.0 <= lo <= 0.9 <= hi <= 1.0
    assert spearman([1, 1, 1], [1, 2, 3])["rho"] is None and spearman([1], [2])["rho"] is None
    many = spearman(list(range(30)), [x * x for x in range(30)], resamples=500)
    assert many["rho"] == pytest.approx(1.0) and many["test"] == "permutation" and many["p"] == pytest.approx(1 / 501)
    scipy = pytest.importorskip("scipy.stats")
    x, y = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0], [2.0, 7.0, 1.0, 8.0, 2.0, 8.0, 1.0, 8.0, 2.0, 8.0]
    assert spearman(x, y, resamples=50)["rho"] == pytest.approx(scipy.spearmanr(x, y).statistic)


# ---------------------------------------------------------------------- chunk_hit_rate
@pytest.mark.parametrize(
    "method",
    [
        {"name": "cacheblend", "recompute_ratio": 0.2},
        {"name": "full_reuse"},
        {"name": "prefix_cache", "warm": "none", "store_prompts": True},
        {"name": "set_cache", "warm": "none"},
        {"name": "cachecraft"},
        {"name": "random_recomp", "recompute_ratio": 0.2},
        {"name": "prefill_h2o", "recompute_ratio": 0.2},
    ],
    ids=lambda m: m["name"],
)
def test_a_repeated_request_hits_every_chunk_and_a_cold_one_none(tiny_llama, random_ids, method):
    parts = _parts(random_ids)
    m = create_method(method)
    m.attach_store(_store())
    cold = _run(tiny_llama, m, _prompt(parts, (0, 1, 2)))
    again = _run(tiny_llama, m, _prompt(parts, (0, 1, 2)))
    assert cold["telemetry"]["prepared"]["chunk_lookups"] == 3
    assert chunk_hit_rate([cold]) == 0.0
    assert chunk_hit_rate([again]) == 1.0
    assert chunk_hit_rate([{**cold, "meta": {"warmup": True}}, again]) == 1.0  # the warm-up left out
    assert chunk_hit_rate([cold, again]) == 0.5


def test_methods_without_a_chunk_store_have_no_chunk_hit_rate(tiny_llama, random_ids):
    record = _run(tiny_llama, create_method({"name": "full"}), _prompt(_parts(random_ids), (0, 1, 2)))
    assert chunk_hit_rate([record]) is None


def test_a_partial_prefix_hit_counts_the_chunks_inside_it(tiny_llama, random_ids):
    parts = _parts(random_ids)
    m = create_method({"name": "prefix_cache", "warm": "none", "store_prompts": True})
    m.attach_store(_store())
    _run(tiny_llama, m, _prompt(parts, (0, 1, 2)))
    record = _run(tiny_llama, m, _prompt(parts, (0, 2, 1)))  # the stored prompt's prefix and chunk 0 match
    assert record["telemetry"]["prepared"]["chunk_hits"] == 1
    assert chunk_hit_rate([record]) == pytest.approx(1 / 3)


def test_a_cachecraft_variant_found_is_a_hit_even_when_refreshed(tiny_llama, random_ids):
    parts = _parts(random_ids)
    craft = create_method({"name": "cachecraft"})
    craft.attach_store(_store())
    _run(tiny_llama, craft, _prompt(parts, (0, 1, 2)))
    record = _run(tiny_llama, craft, _prompt(parts, (1, 0, 2)))  # new contexts: refresh (CFO >= 0.5)
    prepared = record["telemetry"]["prepared"]
    actions = [c["action"] for c in record["telemetry"]["method"]["cachecraft"]["chunks"]]
    assert prepared["chunk_hits"] == 3 and prepared["chunk_refreshed"] == actions.count("refresh") > 0
