"""CacheBlend's misses (``method.miss``, issue 44 item 4).

* ``prefill`` (default; the paper §6, LMCache): a chunk the store lacks is computed in the request's own
  prefill — uncached rows at every layer — so a request that misses every chunk *is* the full prefill
  (token-identical to ``full``, every row computed once, no precompute), and after it the K/V it computed
  are stored; a second request then hits every chunk and reads exactly those K/V (re-rotated when the
  chunk moved). A partial miss computes the missing chunk throughout and ``r`` of the reused rows.
* ``precompute`` (the legacy value) is the plan before, bit for bit (the digests of test_reuse_static).
* The recorded CacheBlend runs keep their ids: ``cacheblend_allrows`` pins ``miss: precompute``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from kvbench.budget import BudgetConfig
from kvbench.engine.attention import activate
from kvbench.engine.generate import _new_context, generate
from kvbench.engine.rope import rerotate
from kvbench.kv.chunks import ChunkStore, StoreConfig
from kvbench.methods import create_method, method_node
from kvbench.profile import Profile
from kvbench.requests import Segment, join_segments, segment_spans
from kvbench.results import run_id_for
from tests.test_reuse_static import CASES, LARGE, RECORDED, digest, recorded_threads, segmented

RECORD = Path(__file__).resolve().parents[1] / "benchmarks/records/cacheblend-fig12"
NEW = 6


def ram() -> ChunkStore:
    return ChunkStore(StoreConfig(tier="ram", disk_gb=0))


def request(loaded, method, segments, store=None):
    """One request through the engine's steps, as :func:`generate` runs them up to the first token:
    (context, logits, the method's reuse plan, what ``prepare`` reported); the method's
    ``after_request`` runs (a prefill miss is stored then)."""
    if store is not None:
        method.attach_store(store)
    ids = torch.tensor(join_segments(segments), dtype=torch.long)
    ctx = _new_context(loaded, method, BudgetConfig(), ids.numel(), 1, Profile())
    try:
        with torch.inference_mode():
            prepared = method.prepare(ctx, ids, segments)
        with torch.inference_mode(), activate(ctx):
            logits = ctx.prefill(ids, segments)
            method.after_request(ctx, segments)
        plan = getattr(method, "plan", None)
    finally:
        method.release()
    return ctx, logits, plan, prepared


def answer(loaded, cfg, segments, store=None):
    method = create_method(dict(cfg))
    if store is not None:
        method.attach_store(store)
    ids = join_segments(segments)
    return generate(
        loaded, method, ids, max_new_tokens=NEW, min_new_tokens=NEW, segments=segments, budget=BudgetConfig()
    )


def mlp_rows(loaded, monkeypatch) -> list[int]:
    """Rows every MLP call of the model's layer modules sees, in call order (precomputation included;
    the decode steps do not call them)."""
    seen: list[int] = []
    for layer in loaded.model.model.layers:
        original = layer.mlp.forward

        def counting(x, _original=original):
            seen.append(int(x.shape[1]))
            return _original(x)

        monkeypatch.setattr(layer.mlp, "forward", counting)
    return seen


# ---------------------------------------------------------------------- (a) a full miss is the full prefill
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_a_full_miss_is_the_full_prefill_and_computes_every_row_once(model, request_fixture, monkeypatch):
    loaded = request_fixture(model)
    segments = segmented(LARGE)
    n, layers = sum(LARGE), loaded.spec.n_layers
    spans = len(LARGE) - 1  # the prefix and the chunks (the query is computed, never cached)
    full = answer(loaded, {"name": "full"}, segments)
    rows = mlp_rows(loaded, monkeypatch)
    blend = answer(loaded, {"name": "cacheblend"}, segments, store=ram())
    assert blend.tokens == full.tokens
    # every row through every layer once: no precompute, nothing twice (decode steps run another path)
    assert rows == [n] * layers
    prepared, plan = blend.telemetry["prepared"], blend.telemetry["prefill"]
    assert prepared["miss"] == "prefill" and prepared["chunk_mode"] == "prompt"
    assert prepared["precomputed_chunks"] == 0 and prepared["prefill_chunks"] == spans
    assert prepared["prefill_tokens"] == n - LARGE[-1]
    assert plan["chunks"] == 0 and plan["missed_chunks"] == spans and plan["missed_tokens"] == n - LARGE[-1]
    assert plan["reused_tokens"] == 0 and plan["recompute_per_layer"] == [1.0] * layers
    assert plan["chunk_tiers"] == {}  # (nothing loaded)
    assert blend.telemetry["method"]["filled"] == {"stored": spans, "not_stored": 0}

    # the same request with its chunks precomputed first (miss: precompute): the chunks' own prefills,
    # then the blended prefill — what a full miss cost before
    rows.clear()
    before = answer(loaded, {"name": "cacheblend", "miss": "precompute"}, segments, store=ram())
    chunk_rows = sum(LARGE[:-1]) + (spans - 1 if loaded.tokenizer.bos_token_id is not None else 0)
    assert sum(rows[: spans * layers]) == chunk_rows * layers  # the precomputation
    assert before.telemetry["prepared"]["precomputed_chunks"] == spans
    assert rows[spans * layers] == n and len(rows) == (spans + 1) * layers  # then the blend's layers
    assert sum(rows) > n * layers


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_a_full_miss_has_the_full_prefills_kv(model, request_fixture):
    loaded = request_fixture(model)
    segments = segmented(LARGE)
    dense, dense_logits, _, _ = request(loaded, create_method({"name": "full"}), segments)
    ctx, logits, plan, _ = request(loaded, create_method({"name": "cacheblend"}), segments, store=ram())
    assert plan is not None and plan.throughout.all()
    torch.testing.assert_close(logits, dense_logits, rtol=0, atol=1e-6)
    for a, b in zip(dense.store.layers, ctx.store.layers):
        n = a.n
        assert b.n == n and torch.equal(a.positions, b.positions)
        torch.testing.assert_close(b.keys[:, :n], a.keys[:, :n], rtol=0, atol=1e-6)
        torch.testing.assert_close(b.values[:, :n], a.values[:, :n], rtol=0, atol=1e-6)


# ---------------------------------------------------------------------- (b) later requests read what it stored
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_a_second_request_hits_every_chunk_and_reads_the_first_requests_kv(model, request_fixture):
    loaded = request_fixture(model)
    segments = segmented(LARGE)
    store = ram()
    method = create_method({"name": "cacheblend"})
    first, _, _, _ = request(loaded, method, segments, store=store)
    spans = method.cached_segments(first, segments)
    assert len(spans) == len(LARGE) - 1 and all(span.key.mode.startswith("prompt:") for span in spans)
    for span in spans:  # the entry is the first request's K/V of those rows, at their positions there
        entry = store.get(span.key)
        assert entry is not None and entry.start == span.begin and entry.n_tokens == span.end - span.begin
        for layer, kv in enumerate(first.store.layers):
            assert torch.equal(entry.keys[layer], kv.keys[:, span.begin : span.end])
            assert torch.equal(entry.values[layer], kv.values[:, span.begin : span.end])

    second, logits, plan, prepared = request(loaded, create_method({"name": "cacheblend"}), segments, store=store)
    report = second.telemetry.prefill_plan
    assert prepared["prefill_chunks"] == 0 and prepared["precomputed_chunks"] == 0
    assert report["chunks"] == len(spans) and report["missed_chunks"] == 0 and report["reused_tokens"] > 0
    assert second.telemetry.prefill_plan["recompute_per_layer"][-1] < 1.0
    # the rows the second request did not recompute hold the first request's K/V, unchanged (same positions)
    reused = np.setdiff1d(np.arange(sum(LARGE)), plan.rows.positions)
    assert reused.size == report["reused_tokens"]
    last_first, last_second = first.store.layers[-1], second.store.layers[-1]
    assert torch.equal(last_second.keys[:, reused], last_first.keys[:, reused])
    assert torch.equal(last_second.values[:, reused], last_first.values[:, reused])
    # reusing the full prefill's own K/V, the blend gives the full prefill's answer
    dense, dense_logits, _, _ = request(loaded, create_method({"name": "full"}), segments)
    torch.testing.assert_close(logits, dense_logits, rtol=1e-4, atol=1e-4)


def test_a_moved_chunk_is_found_and_its_keys_re_rotated(tiny_llama):
    """CacheBlend's key ignores position and context: a chunk stored from one prompt is found in another
    with other chunks before it, and its keys are rotated by the shift of positions."""
    prefix, a, b, c, query = segmented((6, 40, 50, 45, 12))
    store = ram()
    method = create_method({"name": "cacheblend"})
    first, _, _, _ = request(tiny_llama, method, (prefix, a, b, query), store=store)
    moved = (prefix, c, b, query)  # b now after c (45 tokens) instead of a (40): 5 positions later
    second, _, plan, prepared = request(tiny_llama, create_method({"name": "cacheblend"}), moved, store=store)
    assert prepared["prefill_chunks"] == 1  # c is new; the prefix and b hit
    assert second.telemetry.prefill_plan["chunks"] == 2
    begin_first, begin_second = 6 + 40, 6 + 45
    reused = [p for p in range(begin_second, begin_second + 50) if p not in set(plan.rows.positions.tolist())]
    assert reused
    rows_first = [p - begin_second + begin_first for p in reused]
    # at the last layer the reused rows of b are the first request's keys, rotated by 5 positions
    expected = rerotate(tiny_llama.model, first.store.layers[-1].keys[:, rows_first], 5)
    torch.testing.assert_close(second.store.layers[-1].keys[:, reused], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(second.store.layers[-1].values[:, reused], first.store.layers[-1].values[:, rows_first])


def test_a_partial_miss_computes_the_missing_chunk_at_every_layer_and_r_of_the_reused_rows(tiny_llama):
    prefix, a, b, c, query = segmented((6, 40, 50, 45, 12))
    store = ram()
    request(tiny_llama, create_method({"name": "cacheblend"}), (prefix, a, b, query), store=store)
    segments = (prefix, a, c, query)
    ctx, _, plan, prepared = request(
        tiny_llama, create_method({"name": "cacheblend", "recompute_ratio": 0.25}), segments, store=store
    )
    spans = segment_spans(segments)
    c_rows = np.arange(*spans[2])
    assert prepared["prefill_chunks"] == 1 and prepared["prefill_tokens"] == 45
    assert plan.throughout[c_rows].all()  # the missed chunk is computed at every layer
    reused_rows = 6 + 40
    assert plan.rows.count == int(reused_rows * 0.25) + 45 + 12  # r of the reused rows, the miss, the query
    assert ctx.telemetry.prefill_plan["missed_tokens"] == 45
    key = next(span.key for span in ctx.method.cached_segments(ctx, segments) if span.begin == spans[2][0])
    stored = store.get(key)  # stored after the request, at its positions there
    assert stored is not None and stored.start == spans[2][0]
    for layer, kv in enumerate(ctx.store.layers):
        assert torch.equal(stored.keys[layer], kv.keys[:, spans[2][0] : spans[2][1]])


# ---------------------------------------------------------------------- (c) precompute: the plan before
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_precompute_is_the_plan_before_bit_for_bit(model, request_fixture):
    """test_reuse_static's digests, recorded before ``miss`` existed, with ``miss: precompute`` given."""
    from tests.test_reuse_static import prefill

    loaded = request_fixture(model)
    if loaded.spec.device != "cpu" or not torch.__version__.startswith("2.13"):
        pytest.skip("the digests were recorded on torch 2.13 on a CPU")
    got = {}
    with recorded_threads():
        for name, (cfg, sizes) in CASES.items():
            if cfg["name"] != "cacheblend":
                continue
            ctx, logits, _ = prefill(loaded, {**cfg, "miss": "precompute"}, segmented(sizes))
            got[f"{model}/{name}"] = digest(ctx, logits)
    assert got in [{key: each[key] for key in got} for each in RECORDED]  # one recorded CPU's set, entry for entry


# ---------------------------------------------------------------------- (d) recorded runs keep their ids
def test_recorded_cacheblend_runs_keep_their_ids():
    folder = sorted(p for p in RECORD.iterdir() if p.name.startswith("rag-cacheblend-"))[0]
    recorded = yaml.safe_load((folder / "config.yaml").read_text())
    assert "miss" not in recorded["method"]  # recorded before the key existed
    preset = method_node("cacheblend_allrows")
    assert preset["miss"] == "precompute" and preset["check_rows"] == "all"
    assert method_node("cacheblend")["miss"] == "prefill"
    legacy = {**recorded, "method": {**recorded["method"], "check_rows": "all", "deviation": "v", "miss": "precompute"}}
    assert run_id_for(legacy) == folder.name
    prefill = {**recorded, "method": {**legacy["method"], "miss": "prefill"}}
    assert run_id_for(prefill) != folder.name


# ---------------------------------------------------------------------- the store's scope
def test_prompt_entries_are_one_runs_and_a_sweeps_store_is_not_shared(tmp_path):
    from kvbench.compose import compose
    from kvbench.runner import plan, sharing
    from kvbench.shared import Sweep

    def takes_sweeps_store(method):
        record = {"question": "q", "answers": ["a"], "ctxs": [{"title": "t", "text": "x"}]}
        (tmp_path / "musique_s.json").write_text(json.dumps([record]))
        overrides = ["task=rag", f"task.data_dir={tmp_path}", f"method={method}", "model=tiny_llama"]
        return sharing(plan(compose(overrides)), Sweep())[1]

    assert not takes_sweeps_store("cacheblend")  # (miss: prefill: its entries are this run's prompts')
    assert takes_sweeps_store("cacheblend_allrows")  # (precomputed entries are a pure function of their key)
    store = ram()
    one, two = create_method({"name": "cacheblend"}), create_method({"name": "cacheblend"})
    one.attach_store(store)
    two.attach_store(store)
    other = create_method({"name": "cacheblend"})
    other.attach_store(ram())

    class Ctx:  # (chunk_key reads the model's fingerprint only)
        loaded = type("Loaded", (), {"_kvbench_fingerprint": "m"})()

    chunk = Segment((1, 2, 3), "chunk")
    assert one.chunk_key(Ctx, chunk, 10) == two.chunk_key(Ctx, chunk, 99)  # one store: one scope, any position
    assert one.chunk_key(Ctx, chunk, 10) != other.chunk_key(Ctx, chunk, 10)


@pytest.fixture
def request_fixture(request):
    return request.getfixturevalue
