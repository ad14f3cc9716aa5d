"""Cache-Craft's baselines (issue 43): ``random_recomp`` and ``prefill_h2o`` (which chunk tokens are
recomputed on the same reuse plan) and ``set_cache`` (chunks reordered to hit the longest stored prefix)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvbench.budget import BudgetConfig
from kvbench.engine.attention_stats import column_mass
from kvbench.engine.generate import generate
from kvbench.kv.chunks import ChunkStore, StoreConfig
from kvbench.methods import create_method
from kvbench.methods.set_cache import arrange, follow
from kvbench.requests import Segment, join_segments

NEW = 10
SIZES = {"pre": 6, "c1": 40, "c2": 50, "c3": 45, "c4": 35, "q": 12, "q2": 9}
PICKERS = ["random_recomp", "prefill_h2o"]


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


def ram():
    return ChunkStore(StoreConfig(tier="ram", disk_gb=0))


def run(loaded, method, segments, store=None, n=NEW):
    if isinstance(method, dict):
        method = create_method(method)
    if hasattr(method, "attach_store"):
        method.attach_store(store if store is not None else ram())
    ids = join_segments(segments)
    return generate(loaded, method, ids, max_new_tokens=n, min_new_tokens=n, segments=segments, budget=BudgetConfig())


def chunks_of(out):
    return out.telemetry["method"]["chunk_recompute"]["chunks"]


# ---------------------------------------------------------------------- received attention (H2O's score)
@pytest.mark.parametrize("heads", ["mean", "max", "sum"])
def test_column_mass_in_row_blocks_equals_an_explicit_softmax(heads):
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(6, 23, 8, generator=generator)  # 6 query heads over 2 KV heads
    k = torch.randn(2, 40, 8, generator=generator)
    q_pos = torch.arange(17, 40)
    k_pos = torch.arange(40)
    logits = torch.einsum("hrd,hnd->hrn", q, k.repeat_interleave(3, dim=0)) * 0.3
    logits = logits.masked_fill(k_pos[None, None] > q_pos[None, :, None], float("-inf"))
    per_head = torch.softmax(logits, dim=-1).sum(dim=1)  # [H, n]: each key's received attention
    expected = {"mean": per_head.mean(0), "max": per_head.amax(0), "sum": per_head.sum(0)}[heads]
    for block in (1, 6 * 40 * 4, 1 << 22):  # one row at a time, 4 rows, all rows
        got = column_mass(q, q_pos, k, k_pos, 0.3, heads=heads, block_elements=block)
        assert torch.allclose(got, expected, atol=1e-5)


def test_column_mass_by_hand_on_uniform_attention():
    """Keys of zeros: row r attends its r + 1 keys equally, so key k receives sum_{r >= k} 1 / (r + 1)."""
    q, k = torch.randn(2, 4, 3), torch.zeros(1, 4, 3)
    got = column_mass(q, torch.arange(4), k, torch.arange(4), 1.0)
    hand = [1 + 1 / 2 + 1 / 3 + 1 / 4, 1 / 2 + 1 / 3 + 1 / 4, 1 / 3 + 1 / 4, 1 / 4]
    assert got.tolist() == pytest.approx(hand)
    # rows 2-3 only (e.g. the later rows of a block): keys 0-1 get 1/3 + 1/4 each
    assert column_mass(q[:, 2:], torch.arange(2, 4), k, torch.arange(4), 1.0).tolist() == pytest.approx(
        [1 / 3 + 1 / 4, 1 / 3 + 1 / 4, 1 / 3 + 1 / 4, 1 / 4]
    )


def eager_scores(loaded, ids, start):
    """Each token's received attention in a dense forward of ``ids``, from transformers' eager attention:
    column sums over rows, mean over heads, sum over layers (an independent reference)."""
    previous = loaded.model.config._attn_implementation
    loaded.model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = loaded.model(torch.tensor([ids]), output_attentions=True).attentions  # [1, H, n, n]
    finally:
        loaded.model.set_attn_implementation(previous)
    return sum(a[0].double().sum(dim=1).mean(dim=0) for a in attentions)[start:].numpy()


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_prefill_h2o_scores_equal_the_models_own_eager_attention(fixture, request, parts):
    loaded = request.getfixturevalue(fixture)
    method = create_method({"name": "prefill_h2o"})
    out = run(loaded, method, prompt(parts, "c1", "c2", "c3"), n=1)
    bos = out.telemetry["prepared"]["chunk_mode"] == "bos"
    assert len(method.scores) == 3
    for name, scores in zip(("c1", "c2", "c3"), method.scores.values()):
        ids = [loaded.tokenizer.bos_token_id, *parts[name]] if bos else list(parts[name])
        assert np.allclose(scores, eager_scores(loaded, ids, int(bos)), atol=1e-4)


def test_prefill_h2o_recomputes_each_chunks_top_received_attention_tokens(tiny_llama, parts):
    ratio = 0.2
    method = create_method({"name": "prefill_h2o", "recompute_ratio": ratio})
    segments = prompt(parts, "c2", "c1", "c3")
    out = run(tiny_llama, method, segments, n=2)
    bos = out.telemetry["prepared"]["chunk_mode"] == "bos"
    chosen = 0
    for name, chunk in zip(("c2", "c1", "c3"), chunks_of(out)):
        ids = [tiny_llama.tokenizer.bos_token_id, *parts[name]] if bos else list(parts[name])
        scores = eager_scores(tiny_llama, ids, int(bos))
        count = math.ceil(ratio * SIZES[name])
        top = np.argsort(-scores, kind="stable")[:count]
        assert chunk["offsets"] == sorted(top.tolist()) and chunk["recomputed"] == count
        chosen += count
    n = len(join_segments(segments))
    assert out.telemetry["prefill"]["recompute_per_layer"] == [(12 + chosen) / n] * tiny_llama.spec.n_layers
    assert out.telemetry["prefill"]["reused_tokens"] == n - 12 - chosen


def test_prefill_h2o_scores_a_chunk_another_method_stored(tiny_llama, parts):
    store, segments = ram(), prompt(parts, "c1", "c2")
    run(tiny_llama, {"name": "full_reuse"}, segments, store, n=1)
    method = create_method({"name": "prefill_h2o"})
    out = run(tiny_llama, method, segments, store, n=1)
    assert out.telemetry["prepared"]["scored_chunks"] == 2 and out.telemetry["prepared"]["precomputed_chunks"] == 0
    fresh = create_method({"name": "prefill_h2o"})
    run(tiny_llama, fresh, segments, n=1)
    for ours, theirs in zip(method.scores.values(), fresh.scores.values()):
        assert np.allclose(ours, theirs)


# ---------------------------------------------------------------------- random_recomp
def test_random_recomp_draws_ceil_ratio_tokens_per_chunk_reproducibly(tiny_llama, parts):
    segments = prompt(parts, "c1", "c2", "c3")
    first = chunks_of(run(tiny_llama, {"name": "random_recomp", "seed": 3}, segments, n=1))
    again = chunks_of(run(tiny_llama, {"name": "random_recomp", "seed": 3}, segments, n=1))
    other = chunks_of(run(tiny_llama, {"name": "random_recomp", "seed": 4}, segments, n=1))
    assert first == again and [c["offsets"] for c in first] != [c["offsets"] for c in other]
    for name, chunk in zip(("c1", "c2", "c3"), first):
        count = math.ceil(0.15 * SIZES[name])  # 6, 8, 7
        assert chunk["recomputed"] == len(set(chunk["offsets"])) == count
        assert all(0 <= o < SIZES[name] for o in chunk["offsets"])
    # the draw belongs to the chunk (its tokens and the seed), not to its place in the prompt
    moved = chunks_of(run(tiny_llama, {"name": "random_recomp", "seed": 3}, prompt(parts, "c3", "c1"), n=1))
    assert [c["offsets"] for c in moved] == [first[2]["offsets"], first[0]["offsets"]]
    assert [c["recomputed"] for c in chunks_of(run(tiny_llama, {"name": "random_recomp", "recompute_ratio": 0.5},
                                                   segments, n=1))] == [20, 25, 23]  # fmt: skip


# ---------------------------------------------------------------------- the ratio's ends
@pytest.mark.parametrize("name", PICKERS)
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_ratio_one_is_token_identical_to_full(fixture, name, request, parts):
    loaded = request.getfixturevalue(fixture)
    method, store = create_method({"name": name, "recompute_ratio": 1.0}), ram()
    for chunks in (("c1", "c2", "c3"), ("c2", "c1", "c3")):
        segments = prompt(parts, *chunks)
        full = run(loaded, {"name": "full"}, segments)
        out = run(loaded, method, segments, store)
        assert out.tokens == full.tokens and len(set(full.tokens)) > 2
        n = len(join_segments(segments))
        assert out.telemetry["prefill"]["recompute_per_layer"] == [(n - 6) / n] * loaded.spec.n_layers
    bare = (Segment(parts["c1"], "chunk"), Segment(parts["q"], "query"))  # no prefix: nothing is reused, no guard
    assert run(loaded, method, bare).tokens == run(loaded, {"name": "full"}, bare).tokens


@pytest.mark.parametrize("name", PICKERS)
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_ratio_zero_is_token_identical_to_full_reuse(fixture, name, request, parts):
    loaded = request.getfixturevalue(fixture)
    segments = prompt(parts, "c2", "c1", "c3")
    ours = run(loaded, {"name": name, "recompute_ratio": 0.0}, segments)
    theirs = run(loaded, {"name": "full_reuse"}, segments)
    assert ours.tokens == theirs.tokens
    assert ours.telemetry["prefill"]["reused_tokens"] == theirs.telemetry["prefill"]["reused_tokens"] == 6 + 135
    assert [c["recomputed"] for c in chunks_of(ours)] == [0, 0, 0]


# ---------------------------------------------------------------------- set_cache
def test_follow_and_arrange(parts):
    segments = prompt(parts, "c1", "c2", "c3")
    stored = tuple(join_segments(prompt(parts, "c3", "c1", "c4")))
    assert follow(segments, stored) == ([3, 1], 6 + 45 + 40)
    assert [s.ids for s in arrange(segments, [3, 1])] == [parts[k] for k in ("pre", "c3", "c1", "c2", "q")]
    assert follow(segments, tuple(parts["c1"])) == ([], 0)  # the prefix must match first


def test_set_cache_reorders_to_hit_the_longest_stored_prefix(tiny_llama, parts):
    method, store = create_method({"name": "set_cache", "warm": "none"}), ram()
    run(tiny_llama, method, prompt(parts, "c2", "c3", "c1", query="q2"), store, n=1)  # stores pre c2 c3 c1
    run(tiny_llama, method, prompt(parts, "c1", "c4"), store, n=1)  # nothing continues: stores pre c1 c4
    segments = prompt(parts, "c1", "c2", "c3")  # retrieval order: c1 continues the first stored prompt
    out = run(tiny_llama, method, segments, store)
    order = out.telemetry["method"]["set_cache"]
    assert order == {
        "order": [1, 2, 0],
        "reordered": True,
        "matched_chunks": 3,
        "matched_tokens": 6 + 50 + 45 + 40,
        "stored_tokens": 6 + 50 + 45 + 40,
    }
    served = prompt(parts, "c2", "c3", "c1")
    assert out.telemetry["prefill"]["reused_tokens"] == 6 + 50 + 45 + 40
    assert out.tokens == run(tiny_llama, {"name": "full"}, served).tokens  # exact reuse of the served prompt
    # what it stored is the served prompt: the same request again hits it whole, with no reordering left
    again = run(tiny_llama, method, served, store)
    assert again.telemetry["method"]["set_cache"]["order"] == [0, 1, 2] and again.tokens == out.tokens


@pytest.mark.parametrize("warm", ["first_chunk", "prefix", "none"])
def test_set_cache_with_nothing_stored_is_prefix_caching(tiny_llama, parts, warm):
    ours, theirs = (
        create_method({"name": "set_cache", "warm": warm}),
        create_method({"name": "prefix_cache", "warm": warm, "store_prompts": True}),
    )
    ours_store, theirs_store = ram(), ram()
    for chunks in (("c1", "c2", "c3"), ("c4", "c3")):  # no stored prompt continues with another's chunk
        segments = prompt(parts, *chunks)
        a, b = run(tiny_llama, ours, segments, ours_store), run(tiny_llama, theirs, segments, theirs_store)
        assert a.tokens == b.tokens
        assert a.telemetry["prefill"]["reused_tokens"] == b.telemetry["prefill"]["reused_tokens"]
        assert a.telemetry["method"]["set_cache"]["order"] == list(range(len(chunks)))
        assert a.telemetry["method"]["set_cache"]["reordered"] is False
