"""Cache-Craft (``method=cachecraft``): its arithmetic on hand-computed attention, the row-block statistics
against an explicit softmax, equivalences with ``full`` and ``prefix_cache``, token selection, early
termination, variants, the store's eviction policy, and a run through the runner on SmolLM2."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvbench.budget import BudgetConfig
from kvbench.engine.attention_stats import segment_mass
from kvbench.engine.generate import generate
from kvbench.errors import ConfigError
from kvbench.kv.chunks import ChunkKey, ChunkKV, ChunkStore, StoreConfig
from kvbench.methods import create_method
from kvbench.methods.primitives import cachecraft as cc
from kvbench.requests import Segment, join_segments

from .conftest import SHARED_DATA

NEW = 10
SIZES = {"pre": 6, "c1": 40, "c2": 50, "c3": 45, "c4": 35, "q": 12, "q2": 9}


@pytest.fixture
def parts(random_ids):
    ids = random_ids(sum(SIZES.values()), seed=21)
    out, at = {}, 0
    for name, size in SIZES.items():
        out[name] = tuple(ids[at : at + size])
        at += size
    return out


def prompt(parts, *chunks, query="q"):
    return (
        Segment(parts["pre"], "prefix"),
        *[Segment(parts[c], "chunk") for c in chunks],
        Segment(parts[query], "query"),
    )


def run(loaded, method, segments, store=None, n=NEW):
    if isinstance(method, dict):
        method = create_method(method)
    if store is not None:
        method.attach_store(store)
    ids = join_segments(segments)
    return generate(loaded, method, ids, max_new_tokens=n, min_new_tokens=n, segments=segments, budget=BudgetConfig())


def ram():
    return ChunkStore(StoreConfig(tier="ram", disk_gb=0))


def report(out):
    return out.telemetry["method"]["cachecraft"]


# ---------------------------------------------------------------------- the arithmetic, by hand
#: one chunk C2 (3 tokens, positions 4-6) after C0 (positions 0-1) and C1 (2-3): its rows' attention
#: over positions 0..6 at two layers (rows sum to 1, causal)
LAYER_A = np.array(
    [
        [0.1, 0.1, 0.2, 0.2, 0.4, 0.0, 0.0],
        [0.0, 0.1, 0.1, 0.1, 0.2, 0.5, 0.0],
        [0.1, 0.0, 0.0, 0.1, 0.2, 0.2, 0.4],
    ]
)
LAYER_B = np.array(  # the chunk attends only itself
    [
        [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.4],
    ]
)
SEGMENT_OF = [0, 0, 1, 1, 2, 2, 2]


def hand_stats():
    per_segment = [np.stack([a[:, [p for p, s in enumerate(SEGMENT_OF) if s == j]].sum(1) for j in range(3)], 1)
                   for a in (LAYER_A, LAYER_B)]  # fmt: skip
    return cc.VariantStats.from_mass(np.stack(per_segment), 2, ("C0", "C1"), (2, 2))


def test_statistics_beta_gamma_cci_cfo_on_a_hand_computed_attention():
    stats = hand_stats()
    # Eq. 3-4 by hand: inter(C2, C0) = .2 + .1 + .1, inter(C2, C1) = .4 + .2 + .1, intra = .4 + .7 + .8
    assert stats.inter[0] == pytest.approx([0.4, 0.7]) and stats.inter[1] == pytest.approx([0.0, 0.0])
    assert stats.intra == pytest.approx([1.9, 3.0])
    assert stats.tokens[0] == pytest.approx([0.6, 0.3, 0.2])
    # Eq. 6: beta, the old context's inter attention (summed over layers) still present
    assert cc.beta(stats, ["C1"], empty=0.0) == pytest.approx(0.7 / 1.1)
    assert cc.beta(stats, ["C1", "X", "C0"], empty=0.0) == pytest.approx(1.0)
    assert cc.beta(stats, ["X"], empty=0.0) == 0.0
    # Eq. 7: discordant pairs over C(m, 2) among the common chunks
    assert cc.kendall_gamma(["C0", "C1"], ["C1", "X", "C0"]) == 1.0
    assert cc.kendall_gamma(["a", "b", "c"], ["c", "a", "b"]) == pytest.approx(2 / 3)
    assert cc.kendall_gamma(["a", "b", "c", "d"], ["a", "b", "d", "c"]) == pytest.approx(1 / 6)
    assert cc.kendall_gamma(["a", "b"], ["b"]) == 0.0 and cc.kendall_gamma([], []) == 0.0
    # Eqs. 9-11: a = mean_l sum_j inter / (|Ci| |Cj|), b = mean_l intra / |Ci|^2
    a = (0.4 / 6 + 0.7 / 6 + 0.0) / 2
    b = (1.9 / 9 + 3.0 / 9) / 2
    impact = 1 / (1 + math.exp(-a / b))
    assert cc.cci(stats) == pytest.approx(impact)
    # Eq. 12 and 14: CFO = alpha CCI (1 - beta'), ceil(CFO |C|) tokens by inter score (mean over layers)
    beta_prime = (0.7 / 1.1) * (1 - 0.0)
    assert cc.cfo(1.0, impact, beta_prime) == pytest.approx(impact * (1 - 0.7 / 1.1))
    assert cc.cfo(10.0, impact, 0.0) == 1.0 and cc.cfo(0.0, impact, 0.0) == 0.0
    assert cc.token_scores(stats) == pytest.approx([0.3, 0.15, 0.1])
    assert cc.recompute_count(cc.cfo(1.0, impact, beta_prime), 3) == 1
    assert cc.recompute_count(1 / 3, 3) == 1 and cc.recompute_count(0.34, 3) == 2 and cc.recompute_count(0.0, 3) == 0
    assert cc.select_tokens(np.array([0.1, 0.5, 0.2, 0.5]), 2).tolist() == [1, 3]
    assert cc.select_tokens(np.array([0.3, 0.3, 0.3]), 1).tolist() == [0]  # ties: the earlier token


def test_an_empty_old_context_and_a_context_free_chunk():
    alone = cc.VariantStats.from_mass(np.array([[[0.7]], [[1.0]]]), 0, (), ())
    assert cc.beta(alone, [], empty=0.0) == 1.0  # the same (empty) context
    assert cc.beta(alone, ["C9"], empty=0.0) == 0.0 and cc.beta(alone, ["C9"], empty=0.4) == 0.4
    assert cc.cci(alone) == 0.5  # no inter attention: a = 0
    assert cc.cfo(1.0, 0.5, 0.0) == 0.5


# ---------------------------------------------------------------------- the row-block statistics pass
@pytest.mark.parametrize("heads", ["mean", "max", "sum"])
def test_segment_mass_in_row_blocks_equals_an_explicit_softmax(heads):
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(6, 23, 8, generator=generator)  # 6 query heads over 2 KV heads
    k = torch.randn(2, 40, 8, generator=generator)
    q_pos = torch.arange(17, 40)
    k_pos = torch.arange(40)
    segments = torch.tensor([-1] * 5 + [0] * 10 + [1] * 12 + [2] * 13)
    logits = torch.einsum("hrd,hnd->hrn", q, k.repeat_interleave(3, dim=0)) * 0.3
    logits = logits.masked_fill(k_pos[None, None] > q_pos[None, :, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    per_head = torch.stack([probs[:, :, segments == s].sum(-1) for s in range(3)], dim=-1)
    expected = {"mean": per_head.mean(0), "max": per_head.amax(0), "sum": per_head.sum(0)}[heads]
    for block in (1, 6 * 40 * 4, 1 << 22):  # one row at a time, 4 rows, all rows
        got = segment_mass(q, q_pos, k, k_pos, segments, 3, 0.3, heads=heads, block_elements=block)
        assert torch.allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize("stats", ["recompute", "attention"])
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_variant_statistics_equal_those_of_the_models_own_eager_attention(fixture, stats, request, parts):
    """The statistics recorded in a request equal inter/intra/token scores computed from transformers'
    eager attention probabilities of a full forward pass (an independent reference), whether a second
    pass recomputes them or the prefill's own attention returns them."""
    loaded = request.getfixturevalue(fixture)
    segments = prompt(parts, "c1", "c2", "c3")
    method = create_method({"name": "cachecraft", "stats": stats})
    run(loaded, method, segments, store=ram(), n=1)
    ids = torch.tensor([join_segments(segments)])
    previous = loaded.model.config._attn_implementation
    loaded.model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = loaded.model(ids, output_attentions=True).attentions  # per layer [1, H, n, n]
    finally:
        loaded.model.set_attn_implementation(previous)
    bounds = [(6, 46), (46, 96), (96, 141)]
    for index, (begin, end) in enumerate(bounds):
        (variant,) = method.catalogue[method._plans[index].digest]
        mass = np.stack(
            [
                np.stack([a[0, :, begin:end, b:e].sum(-1).mean(0).double().numpy() for b, e in bounds], -1)
                for a in attentions
            ]
        )  # [layers, |C|, chunks]
        assert np.allclose(variant.stats.inter, mass[:, :, :index].sum(1), atol=1e-4)
        assert np.allclose(variant.stats.intra, mass[:, :, index].sum(1), atol=1e-4)
        assert np.allclose(variant.scores, mass[:, :, :index].sum(2).mean(0), atol=1e-5)
        assert variant.stats.context == tuple(c.label for c in method._plans[:index])


# ---------------------------------------------------------------------- equivalences
@pytest.mark.parametrize("stats", ["recompute", "attention"])
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_cfo_forced_to_one_is_token_identical_to_full(fixture, stats, request, parts):
    loaded = request.getfixturevalue(fixture)
    method, store = create_method({"name": "cachecraft", "cfo": 1.0, "stats": stats}), ram()
    for chunks in (("c1", "c2", "c3"), ("c2", "c1", "c3"), ("c2", "c1", "c3")):
        segments = prompt(parts, *chunks)
        full = run(loaded, {"name": "full"}, segments)
        out = run(loaded, method, segments, store=store)
        assert out.tokens == full.tokens and len(set(full.tokens)) > 2
        n = len(join_segments(segments))
        assert out.telemetry["prefill"]["recompute_per_layer"] == [(n - 6) / n] * loaded.spec.n_layers
        assert {c["recomputed_tokens"] for c in report(out)["chunks"]} == {40, 50, 45}


@pytest.mark.parametrize("forced,stats", [(0.0, "recompute"), (None, "recompute"), (None, "attention")])
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_a_variant_made_after_the_same_prefix_is_token_identical_to_prefix_caching(
    fixture, forced, stats, request, parts
):
    loaded = request.getfixturevalue(fixture)
    first, second = prompt(parts, "c1", "c2", "c3"), prompt(parts, "c1", "c2", "c4", query="q2")
    craft, craft_store = create_method({"name": "cachecraft", "cfo": forced, "stats": stats}), ram()
    prefix, prefix_store = create_method({"name": "prefix_cache", "warm": "none", "store_prompts": True}), ram()
    assert run(loaded, craft, first, craft_store).tokens == run(loaded, prefix, first, prefix_store).tokens
    ours, theirs = run(loaded, craft, second, craft_store), run(loaded, prefix, second, prefix_store)
    assert ours.tokens == theirs.tokens == run(loaded, {"name": "full"}, second).tokens
    assert ours.telemetry["prefill"]["reused_tokens"] == theirs.telemetry["prefill"]["reused_tokens"] == 6 + 40 + 50
    chunks = report(ours)["chunks"]
    assert [c["action"] for c in chunks] == ["reuse", "reuse", "miss"] and chunks[1]["beta_prime"] == 1.0
    assert [c["cfo"] for c in chunks] == [0.0, 0.0, None] and chunks[0]["beta"] == 1.0


# ---------------------------------------------------------------------- planning
def test_the_recomputed_tokens_are_the_variants_top_inter_attention_ones(tiny_llama, parts):
    method, store = create_method({"name": "cachecraft", "cfo": 0.25, "new_variant_cfo": 1.0}), ram()
    run(tiny_llama, method, prompt(parts, "c1", "c2", "c3"), store, n=1)
    segments = prompt(parts, "c3", "c1", "c2")
    out = run(tiny_llama, method, segments, store, n=2)
    n = len(join_segments(segments))
    chosen = 0
    for chunk in method._plans:
        assert chunk.action == "fix" and chunk.variant is not None
        count = math.ceil(0.25 * chunk.length)
        top = np.argsort(-chunk.variant.scores, kind="stable")[:count]
        assert chunk.selected.tolist() == sorted((chunk.begin + top).tolist())
        chosen += count
    assert out.telemetry["prefill"]["recompute_per_layer"] == [(12 + chosen) / n] * tiny_llama.spec.n_layers
    figures = report(out)
    assert figures["recomputed_token_layers"] == (12 + chosen) * tiny_llama.spec.n_layers
    assert figures["redundant_token_layers"] == chosen * tiny_llama.spec.n_layers
    assert 0 < figures["recompute_flops"] < figures["full_flops"]


def test_a_new_prefix_makes_a_new_variant_up_to_the_cap(tiny_llama, parts):
    method, store = create_method({"name": "cachecraft"}), ram()
    run(tiny_llama, method, prompt(parts, "c1", "c2", "c3"), store, n=1)
    out = run(tiny_llama, method, prompt(parts, "c2", "c1", "c3"), store, n=1)
    chunks = report(out)["chunks"]
    # c2 first: S_old = [c1] lost entirely (beta' = 0, CFO = CCI >= 0.5); c1 second: empty S_old (empty_beta 0);
    # c3: both chunks kept but swapped (gamma = 1)
    assert [c["action"] for c in chunks] == ["refresh"] * 3 and [c["gamma"] for c in chunks] == [0.0, 0.0, 1.0]
    assert all(c["cfo"] >= 0.5 and c["stored"] for c in chunks) and report(out)["variants_held"] == 6
    again = run(tiny_llama, method, prompt(parts, "c2", "c1", "c3"), store, n=1)
    assert [c["action"] for c in report(again)["chunks"]] == ["reuse"] * 3
    assert again.telemetry["prefill"]["reused_tokens"] == len(join_segments(prompt(parts, "c1", "c2", "c3"))) - 12
    capped, store = create_method({"name": "cachecraft", "max_variants": 1}), ram()
    run(tiny_llama, capped, prompt(parts, "c1", "c2", "c3"), store, n=1)
    out = run(tiny_llama, capped, prompt(parts, "c2", "c1", "c3"), store, n=1)
    chunks = report(out)["chunks"]
    assert {c["action"] for c in chunks} <= {"fix", "full"} and report(out)["variants_held"] == 3
    assert not any(c["stored"] for c in chunks)
    assert [c["recomputed_tokens"] for c in chunks] == [math.ceil(c["cfo"] * c["tokens"] - 1e-9) for c in chunks]


def test_an_evicted_variant_is_forgotten_and_the_chunk_recomputed(tiny_llama, parts):
    method, store = create_method({"name": "cachecraft"}), ram()
    run(tiny_llama, method, prompt(parts, "c1", "c2", "c3"), store, n=1)
    (variant,) = method.catalogue[method._plans[1].digest]
    store._ram.pop(variant.key)
    out = run(tiny_llama, method, prompt(parts, "c1", "c2", "c3"), store, n=1)
    assert [c["action"] for c in report(out)["chunks"]] == ["reuse", "miss", "reuse"]


def test_variants_served_from_the_disk_tier_give_the_same_tokens(tiny_llama, parts, tmp_path):
    outs = []
    for store in (ram(), ChunkStore(StoreConfig(tier="disk", dir=str(tmp_path)))):
        method = create_method({"name": "cachecraft", "cfo": 0.2, "new_variant_cfo": 1.0})
        run(tiny_llama, method, prompt(parts, "c1", "c2", "c3"), store, n=1)
        outs.append(run(tiny_llama, method, prompt(parts, "c3", "c1", "c2"), store, n=4))
    assert outs[0].tokens == outs[1].tokens
    assert outs[1].telemetry["prefill"]["chunk_tiers"] == {"disk": 4}  # the prefix and three variants
    assert outs[0].telemetry["prefill"]["recompute_per_layer"] == outs[1].telemetry["prefill"]["recompute_per_layer"]


# ---------------------------------------------------------------------- early termination
@pytest.mark.parametrize("stats", ["recompute", "attention"])
@pytest.mark.parametrize("focus_mass,stops", [(1.0, True), (0.0, False)])
def test_early_termination_drops_unfocused_chunks_tokens_after_the_stop_layer(
    tiny_llama, parts, focus_mass, stops, stats
):
    cfg = {"name": "cachecraft", "cfo": 0.3, "new_variant_cfo": 1.0, "stop_layer": 2, "focus_mass": focus_mass}
    cfg["stats"] = stats
    method, store = create_method(cfg), ram()
    run(tiny_llama, method, prompt(parts, "c1", "c2", "c3"), store, n=1)
    segments = prompt(parts, "c3", "c1", "c2")
    out = run(tiny_llama, method, segments, store, n=2)
    n = len(join_segments(segments))
    chosen = sum(math.ceil(0.3 * size) for size in (45, 40, 50))
    per_layer = out.telemetry["prefill"]["recompute_per_layer"]
    after = 12 if stops else 12 + chosen  # layers 0..2 recompute the selected tokens; 3 only if focused
    assert per_layer == [(12 + chosen) / n] * 3 + [after / n]
    figures = report(out)
    assert figures["stopped_chunks"] == (3 if stops else 0)
    assert [c["token_layers"] for c in figures["chunks"]] == [
        math.ceil(0.3 * size) * (3 if stops else 4) for size in (45, 40, 50)
    ]


def test_early_termination_keeps_focused_chunks(tiny_llama, parts):
    cfg = {"name": "cachecraft", "cfo": 0.3, "new_variant_cfo": 1.0, "stop_layer": 1, "focus_mass": 0.3}
    method, store = create_method(cfg), ram()
    run(tiny_llama, method, prompt(parts, "c1", "c2", "c3"), store, n=1)
    run(tiny_llama, method, prompt(parts, "c3", "c1", "c2"), store, n=1)
    assert method._focus is not None
    share = (method._focus / method._focus.sum()).tolist()
    assert [c.stopped for c in method._plans] == [s < 0.3 for s in share]


# ---------------------------------------------------------------------- the store's eviction policy
def _entry(n_tokens, value=1.0):
    return ChunkKV([torch.full((2, n_tokens, 4), value)], [torch.full((2, n_tokens, 4), -value)], 0)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_statistics_from_the_prefills_attention_equal_the_recomputed_ones(fixture, request, parts):
    """``stats: attention`` (value columns in the prefill's own attention, on the dense path, on the
    reuse path with cached rows, and for the question's focus) gives the recomputing pass's statistics
    and focus, up to float rounding, and the same tokens."""
    loaded = request.getfixturevalue(fixture)
    cfg = {"name": "cachecraft", "cfo": 0.3, "new_variant_cfo": 1.0, "stop_layer": 2, "focus_mass": 0.3}
    methods = {s: (create_method({**cfg, "stats": s}), ram()) for s in ("recompute", "attention")}
    # a miss (dense), then a reuse with a new chunk (c4: statistics on the reuse path) and the focus
    for chunks in (("c1", "c2", "c3"), ("c3", "c1", "c4")):
        outs = {s: run(loaded, m, prompt(parts, *chunks), store) for s, (m, store) in methods.items()}
        assert outs["attention"].tokens == outs["recompute"].tokens
    (ours, _), (theirs, _) = methods["attention"], methods["recompute"]
    assert ours._focus is not None and theirs._focus is not None
    assert torch.allclose(ours._focus, theirs._focus, atol=1e-5)
    assert sorted(ours.catalogue) == sorted(theirs.catalogue) and len(ours.catalogue) == 4
    for digest, variants in theirs.catalogue.items():
        for mine, reference in zip(ours.catalogue[digest], variants, strict=True):
            assert np.allclose(mine.stats.inter, reference.stats.inter, atol=1e-5)
            assert np.allclose(mine.stats.intra, reference.stats.intra, atol=1e-5)
            assert np.allclose(mine.scores, reference.scores, atol=1e-6)
    assert [c.action for c in ours._plans] == ["fix", "fix", "miss"]


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_a_priority_evicts_the_lowest_scored_entry_and_lru_among_equals(tier, tmp_path):
    one = _entry(100).nbytes()
    size = 3.5 * (one if tier == "ram" else one + 400) / 2**30
    store = ChunkStore(StoreConfig(tier=tier, ram_gb=size, disk_gb=size, dir=str(tmp_path)))
    keys = [ChunkKey("m", (i,), "alone") for i in range(5)]
    scores = {keys[0].digest: 5.0, keys[1].digest: 1.0, keys[2].digest: 3.0, keys[3].digest: 3.0}
    store.priority = lambda digest: scores.get(digest, 9.0)
    for key in keys[:3]:
        store.put(key, _entry(100))
    store.put(keys[3], _entry(100))  # full: the lowest score goes (1), not the least recently used (0)
    assert store.contains(keys[1]) is None and store.contains(keys[0]) is not None
    store.put(keys[4], _entry(100))  # 2 and 3 tie at 3.0: the least recently used of them (2)
    assert store.contains(keys[2]) is None and store.contains(keys[3]) is not None
    store.priority = None
    store.put(ChunkKey("m", (9,), "alone"), _entry(100))  # plain LRU again: the oldest held (0)
    assert store.contains(keys[0]) is None


def test_frequency_eviction_is_installed_for_a_request_and_lru_is_the_ablation(tiny_llama, parts):
    for eviction in ("frequency", "lru"):
        method, store = create_method({"name": "cachecraft", "eviction": eviction}), ram()
        seen = []
        put = store.put
        store.put = lambda key, entry, put=put, store=store, seen=seen: (seen.append(store.priority), put(key, entry))
        run(tiny_llama, method, prompt(parts, "c1", "c2", "c3"), store, n=1)
        assert len(seen) == 4  # the prefix, then three variants
        assert all((p is not None) == (eviction == "frequency") for p in seen)
        assert store.priority is None  # released with the request
    variant = method.catalogue[method._plans[0].digest][0]
    assert method._priority(variant.key.digest) == pytest.approx(variant.stats.length / variant.nbytes)
    variant.uses, variant.last_cfo = 3, 0.25  # expected frequency x tokens saved per byte
    assert method._priority(variant.key.digest) == pytest.approx(4 * 0.75 * variant.stats.length / variant.nbytes)
    method._protected = {variant.key.digest}  # a variant the request reads is never the victim
    assert method._priority(variant.key.digest) == math.inf and method._priority("not-a-variant") == math.inf


# ---------------------------------------------------------------------- parameters
@pytest.mark.parametrize("bad", [{"chunk_bos": True}, {"cfo": 1.5}, {"max_variants": 0}, {"heads": "median"}])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ConfigError):
        create_method({"name": "cachecraft", **bad})


# ---------------------------------------------------------------------- SmolLM2
CB = SHARED_DATA / "cacheblend"
#: one question asked twice, its 3 chunks in the orders (1, 2, 0) then (1, 0, 2) (task.seed=8): the second
#: request reuses chunk 1 (same empty prefix) and chunk 2 (its old prefix (1) kept), and fixes chunk 0 (half
#: of its old prefix (1, 2) kept)
STREAM = ["task.limit=1", "task.repeats=2", "task.warmup=0", "task.seed=8", "task.top_k=3", "task.chunk_tokens=64"]


@pytest.mark.integration
@pytest.mark.skipif(not (CB / "wikimqa_s_clean.json").exists(), reason="needs ../shared/data/cacheblend")
def test_cachecraft_runs_a_request_stream_on_smollm2(tmp_path):
    from kvbench.compose import compose
    from kvbench.results import RunDir
    from kvbench.runner import run as run_config

    overrides = ["model=smollm2_135m", "method=cachecraft", "task=rag_stream", f"task.data_dir={CB}", *STREAM]
    run_dir = RunDir(run_config(compose([*overrides, f"output_dir={tmp_path}", "progress=false"])).run_dir)
    records = sorted(run_dir.records(), key=lambda r: r["meta"]["stream_position"])
    assert len(records) == 2 and run_dir.state().status == "finished"
    first, second = (r["telemetry"]["method"]["cachecraft"] for r in records)
    assert [c["action"] for c in first["chunks"]] == ["miss"] * 3 and first["variants_stored"] == 3
    assert first["redundant_token_layers"] == 0 and first["stats_s"] > 0
    assert [c["action"] for c in second["chunks"]] == ["reuse", "fix", "reuse"]
    assert 0 < second["chunks"][1]["beta"] < 1 and second["chunks"][1]["gamma"] == 0
    assert 0 < second["redundant_token_layers"] == second["context_token_layers"] < second["full_token_layers"]
    assert second["recompute_flops"] < first["recompute_flops"] < first["full_flops"]
    assert records[1]["telemetry"]["prefill"]["reused_tokens"] > records[0]["telemetry"]["prefill"]["reused_tokens"]
