"""H2O, SnapKV and PyramidKV: budget invariants, selections on hand-made
attention patterns, the scoring primitives, the pyramid schedule and the store's swap-remove
(a covering budget equals full: tests/test_covering_contract.py, for every compressing method)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kvbench.budget import BudgetConfig, ResolvedBudget
from kvbench.engine.generate import generate
from kvbench.kv.store import LayerKV
from kvbench.methods import create_method
from kvbench.methods.attention_scores import accumulated_attention, group_reduce, pool1d, window_votes
from kvbench.methods.pyramidkv import PyramidKV, pyramid_budgets

METHODS = ["h2o", "snapkv", "pyramidkv"]
NEW = 16
SMALL = dict(token_ratio=0.1, comm_ratio=1 / 64, compensate=True)


def generate_with_ctx(loaded, method, ids, n=NEW, **budget):
    """Generate and also return the engine's GenerationContext (its per-step telemetry and store)."""
    seen = []
    original = method.start

    def spy(ctx):
        seen.append(ctx)
        original(ctx)

    method.start = spy
    out = generate(loaded, method, ids, max_new_tokens=n, min_new_tokens=n, budget=BudgetConfig(**budget))
    return out, seen[0]


# ---------------------------------------------------------------------- budget invariants
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("name", METHODS)
def test_a_small_budget_keeps_and_attends_exactly_the_resolved_budget(fixture, name, request, random_ids):
    loaded = request.getfixturevalue(fixture)
    s, layers = 700, loaded.spec.n_layers
    cfg = {"name": name, "rounding": "exact"} if name == "pyramidkv" else {"name": name}
    out, ctx = generate_with_ctx(loaded, create_method(cfg), random_ids(s, seed=42), n=8, **SMALL)
    b, t = out.budget, out.telemetry
    assert b.sink == 32 and b.compensation == math.floor(1 / 128 * (s - 32))
    assert b.budget == math.floor(0.1 * (s - 32)) + b.compensation
    kept = [b.sink + b.layer_budget(layer) for layer in range(layers)]
    assert t["kept_per_layer"] == kept
    if name == "pyramidkv":
        assert b.to_dict()["per_layer"] == [k - b.sink for k in kept]  # recorded with the sample
        assert kept == sorted(kept, reverse=True) and kept[0] > kept[-1]
        assert sum(kept) == layers * b.total  # same total as uniform (exact rounding)
    else:
        assert kept == [b.total] * layers
        if name == "snapkv":
            assert (b.local, b.select) == (32, b.budget - 32)  # the window is the local part
    for layer in range(layers):
        attended = ctx.telemetry.attended[layer]
        assert len(attended) == 7
        if name == "h2o":  # evicts one token per step: sink + budget + the current token, every step
            assert attended == [kept[layer] + 1] * 7
            assert ctx.store[layer].n == kept[layer]
        else:  # prompt-only compression: generated tokens accumulate
            assert attended == [kept[layer] + step for step in range(1, 8)]
    # SnapKV / PyramidKV keep a set per query head (their authors' code): K/V stored per query head
    rows = 1 if name == "h2o" else loaded.spec.group
    assert {ctx.store[layer].n_kv_heads for layer in range(layers)} == {loaded.spec.n_kv_heads * rows}
    assert t["kv_bytes_ratio"] == pytest.approx(rows * sum(kept) / (s * layers))
    assert t["kv_bytes_after_prefill"] == rows * sum(kept) * t["kv_bytes_full"] // (s * layers)


class _Watch(PyramidKV):
    """PyramidKV that checks, at every decode step, that attention spans exactly the held tokens."""

    name = "_pyramidkv_watch"
    needs_attention_probs = True

    def start(self, ctx):
        super().start(ctx)
        self.kept: dict[int, list[set[int]]] = {}
        self.steps = 0

    def on_prefill(self, layer, query, key, value, kv):
        super().on_prefill(layer, query, key, value, kv)
        self.kept[layer] = [set(row) for row in kv.positions.tolist()]

    def after_attention(self, layer, query, selection, kv, probs):
        # the static step attends a bucket of slots with the ones past the held tokens masked (no weight)
        assert selection is None and probs.shape[0] == self.ctx.spec.n_heads and probs.shape[1] >= kv.n
        assert float(probs[:, kv.n :].abs().sum()) == 0.0
        generated = set(range(self.ctx.budget.context, kv.seen))
        for head, row in enumerate(kv.positions.tolist()):
            assert set(row) == self.kept[layer][head] | generated and len(row) == kv.n
        self.steps += 1


def test_pyramid_layers_attend_only_their_own_kept_tokens(tiny_llama, random_ids):
    from kvbench.methods import register

    register(_Watch)
    method = create_method({"name": _Watch.name})
    out, _ = generate_with_ctx(tiny_llama, method, random_ids(600, seed=44), n=6, **SMALL)
    sizes = [len(method.kept[layer][0]) for layer in range(tiny_llama.spec.n_layers)]
    assert len(set(sizes)) == tiny_llama.spec.n_layers  # every layer holds a different count
    assert method.steps == 5 * tiny_llama.spec.n_layers


def test_authors_rounding_may_keep_a_whole_layer_without_tripping_the_guard(tiny_llama, random_ids):
    # at a large budget the pyramid's bottom layer can keep every prompt token (max clamps to s - window)
    # window 32 (the default is now the authors' 8, whose larger select makes this prompt "short": uniform)
    out = generate(
        tiny_llama,
        create_method({"name": "pyramidkv", "rounding": "authors", "window": 32}),
        random_ids(400, seed=45),
        max_new_tokens=3,
        budget=BudgetConfig(token_ratio=0.6),
    )
    b = out.budget
    assert b.sink + b.layer_budget(0) == 400 and out.telemetry["kept_per_layer"][0] == 400
    assert out.telemetry["kept_per_layer"][-1] < 400


# ---------------------------------------------------------------------- hand-made patterns
def bare(method, budget: ResolvedBudget, kv_heads: int, group: int, d: int):
    spec = SimpleNamespace(head_dim=d, group=group, n_kv_heads=kv_heads, n_heads=kv_heads * group, n_layers=1)
    method.start(SimpleNamespace(budget=budget, spec=spec))
    return method


def prefill(method, query, key, budget, group=1):
    """Run ``on_prefill`` on crafted ``query`` ``[H, s, d]`` / ``key`` ``[H_kv, s, d]``; return the store."""
    kv_heads, s, d = key.shape
    kv = LayerKV(kv_heads, d, dtype=torch.float32, device=torch.device("cpu"))
    kv.append(key, key.clone())
    bare(method, budget, kv_heads, group, d).on_prefill(0, query[None], key[None], key[None], kv)
    return kv


def spike_pattern(s=48, d=4, spikes=((12, 8.0),)):
    """Every query looks along e0; keys at the given positions point there with the given strength."""
    key = torch.zeros(1, s, d)
    for position, strength in spikes:
        key[0, position, 0] = strength
    query = torch.zeros(1, s, d)
    query[0, :, 0] = 1.0
    return query, key


def test_snapkv_keeps_a_spike_and_its_pooled_neighbours():
    query, key = spike_pattern()
    budget = ResolvedBudget(context=48, sink=2, local=8, select=5)
    kv = prefill(create_method({"name": "snapkv", "window": 8, "kernel": 5}), query, key, budget)
    assert kv.positions[0].tolist() == [0, 1, 10, 11, 12, 13, 14] + list(range(40, 48))  # sinks, spike ± 2, window
    lone = prefill(
        create_method({"name": "snapkv", "window": 8, "kernel": 1}),
        query,
        key,
        ResolvedBudget(context=48, sink=2, local=8, select=1),
    )
    assert lone.positions[0].tolist() == [0, 1, 12] + list(range(40, 48))


def test_snapkv_max_and_avg_pooling_keep_different_tokens():
    # one tall spike (position 10) against a plateau of three medium keys (24..26): avg pooling favours
    # the plateau's centre, max pooling spreads the spike's height over its neighbours
    d = 4
    scale = d**-0.5
    tall, medium = math.log(900) / scale, math.log(400) / scale
    query, key = spike_pattern(s=48, spikes=((10, tall), (24, medium), (25, medium), (26, medium)))
    budget = ResolvedBudget(context=48, sink=0, local=8, select=1)
    avg = prefill(create_method({"name": "snapkv", "window": 8, "kernel": 3, "pooling": "avg"}), query, key, budget)
    mx = prefill(create_method({"name": "snapkv", "window": 8, "kernel": 3, "pooling": "max"}), query, key, budget)
    assert avg.positions[0, 0].item() == 25
    assert mx.positions[0, 0].item() in (9, 10, 11)


def gqa_pattern(loved: int, liked: int, loved_key, liked_key, s=24, d=4):
    """Two query heads of one KV head: head 0 (looking along e0) loves token ``loved``; both heads
    like token ``liked`` moderately. The sum over the group prefers ``liked``, the max ``loved``."""
    query = torch.zeros(2, s, d)
    query[0, :, 0] = 1.0
    query[1, :, 1] = 1.0
    key = torch.zeros(1, s, d)
    key[0, loved, :2] = torch.tensor(loved_key)
    key[0, liked, :2] = torch.tensor(liked_key)
    return query, key


@pytest.mark.parametrize(
    "name, loved, liked, loved_key, liked_key",
    [  # H2O accumulates over every query, so its loved token sits later (fewer queries see it)
        ("snapkv", 5, 11, (12.0, 0.0), (11.0, 6.0)),
        ("h2o", 11, 5, (14.0, 0.0), (6.0, 6.0)),
    ],
)
def test_gqa_reductions_pick_differently(name, loved, liked, loved_key, liked_key):
    query, key = gqa_pattern(loved, liked, loved_key, liked_key)
    budget = ResolvedBudget(context=24, sink=0, local=4, select=1)
    picks = {}
    for rule in ("sum", "mean", "max"):
        cfg = {
            "name": name,
            "gqa": rule,
            **({"kernel": 1, "window": 4, "granularity": "kv_head"} if name == "snapkv" else {}),
        }
        picks[rule] = prefill(create_method(cfg), query, key, budget, group=2).positions[0, 0].item()
    assert picks == {"sum": liked, "mean": liked, "max": loved}


def test_snapkv_per_query_head_keeps_each_heads_own_tokens_in_a_repeated_store():
    query, key = gqa_pattern(5, 11, (12.0, 0.0), (11.0, 6.0))
    budget = ResolvedBudget(context=24, sink=0, local=4, select=1)
    kv = prefill(create_method({"name": "snapkv", "kernel": 1, "window": 4}), query, key, budget, group=2)
    assert kv.n_kv_heads == 2 and kv.repeat == 2  # one stored row per query head
    # head 0 (e0) loves token 5; head 1 (e1) sees only token 11's e1 part
    assert kv.positions.tolist() == [[5, 20, 21, 22, 23], [11, 20, 21, 22, 23]]
    assert torch.equal(kv.keys[0, 0], key[0, 5]) and torch.equal(kv.keys[1, 0], key[0, 11])
    kv.append(torch.ones(1, 1, 4), torch.ones(1, 1, 4))  # a decode token of the one KV head: stored twice
    assert kv.n == 6 and kv.positions[:, -1].tolist() == [24, 24] and torch.equal(kv.keys[:, -1], torch.ones(2, 4))
    assert kv.nbytes() == 2 * 6 * kv.token_bytes()


def test_snapkv_kv_head_granularity_reduces_the_group_before_pooling():
    """KVCache-Factory's kv_head order: reduce the group's votes, then pool. Head 0 votes for token 10,
    head 1 for token 12 (less); with max pooling over 3 the reduced votes tie at 9-11 (head 0's spike)
    and the lowest wins, where pooling each head first would make 11 (both spikes) the clear winner."""
    s, d = 24, 4
    query = torch.zeros(2, s, d)
    query[0, :, 0] = 1.0
    query[1, :, 1] = 1.0
    key = torch.zeros(1, s, d)
    key[0, 10, 0] = 12.0
    key[0, 12, 1] = 3.0
    budget = ResolvedBudget(context=s, sink=0, local=4, select=1)
    method = create_method({"name": "snapkv", "window": 4, "kernel": 3, "pooling": "max", "granularity": "kv_head"})
    kv = prefill(method, query, key, budget, group=2)
    assert kv.n_kv_heads == 1 and kv.positions[0, 0].item() == 9
    votes = window_votes(query, key, 4, d**-0.5)[:, : s - 4]
    pooled_first = group_reduce(pool1d(votes, 3, "max"), 2, "sum")
    assert pooled_first.argmax().item() == 11  # the other order picks differently: the test discriminates


def test_group_reduce_rules():
    scores = torch.tensor([[10.0, 6.0], [0.0, 6.0]])  # [query heads of one KV head, tokens]
    assert group_reduce(scores, 2, "sum").tolist() == [[10.0, 12.0]]
    assert group_reduce(scores, 2, "mean").tolist() == [[5.0, 6.0]]
    assert group_reduce(scores, 2, "max").tolist() == [[10.0, 6.0]]
    with pytest.raises(ValueError, match="GQA"):
        group_reduce(scores, 2, "median")


def test_h2o_keeps_the_heavy_hitter_over_recent_light_tokens():
    query, key = spike_pattern(s=30, spikes=((7, 6.0),))
    budget = ResolvedBudget(context=30, sink=2, local=4, select=1)
    kv = prefill(create_method({"name": "h2o"}), query, key, budget)
    assert kv.positions[0].tolist() == [0, 1, 7, 26, 27, 28, 29]


@pytest.mark.parametrize("swap", [True, False])
def test_h2o_keeps_evicting_during_decode_and_keeps_the_heavy_hitter(swap):
    s, d = 30, 4
    query, key = spike_pattern(s=s, spikes=((7, 6.0),))
    budget = ResolvedBudget(context=s, sink=2, local=4, select=2)
    method = create_method({"name": "h2o", "swap_remove": swap})
    kv = prefill(method, query, key, budget)
    assert kv.n == 8 and 7 in kv.positions[0].tolist()
    prefill_score = {p: method.scores[0][0, 0, i].item() for i, p in enumerate(kv.positions[0].tolist())}
    heavy_total = prefill_score[7]
    for _ in range(12):
        kv.append(torch.zeros(1, 1, d), torch.zeros(1, 1, d))
        positions = kv.positions[0].tolist()
        # the step's attention: half on the heavy hitter, the rest spread evenly
        probs = torch.full((1, kv.n), 0.5 / (kv.n - 1))
        probs[0, positions.index(7)] = 0.5
        before = {p: method.scores[0][0, 0, i].item() for i, p in enumerate(positions[:-1])}
        method.after_attention(0, None, None, kv, probs)
        heavy_total += 0.5
        held = kv.positions[0].tolist()
        assert kv.n == 8 and len(set(held)) == 8  # sink + budget, every step
        assert {0, 1, 7} <= set(held)  # sinks and the heavy hitter stay
        assert set(range(kv.seen - 4, kv.seen)) <= set(held)  # the recent window, by position
        # the evicted token was the lightest candidate (neither sink nor recent)
        evicted = (set(positions) - set(held)).pop()
        candidates = [p for p in positions if p >= 2 and p < kv.seen - 4]
        score = {p: before.get(p, 0.0) + probs[0, positions.index(p)].item() for p in candidates}
        assert score[evicted] == pytest.approx(min(score.values()))
        # scores still follow their slots
        slot = held.index(7)
        assert method.scores[0][0, 0, slot].item() == pytest.approx(heavy_total, rel=1e-5)
    assert method.evicted_in_decode == 12


def test_h2o_decode_on_a_model_with_both_removal_paths(tiny_qwen2, random_ids):
    ids = random_ids(400, seed=46)
    outs = []
    for swap in (True, False):
        method = create_method({"name": "h2o", "swap_remove": swap})
        out, ctx = generate_with_ctx(tiny_qwen2, method, ids, n=10, tokens=60)
        b = out.budget
        for layer in range(tiny_qwen2.spec.n_layers):
            kv = ctx.store[layer]
            held = kv.positions[0].tolist()
            assert kv.n == b.total == 92 and method.scores[layer].shape == (1, 7, 92)
            assert set(range(32)) <= set(held) and set(range(kv.seen - b.local, kv.seen)) <= set(held)
        outs.append((out.tokens, [sorted(ctx.store[layer].positions[0].tolist()) for layer in range(3)]))
    assert outs[0] == outs[1]  # swap-remove changes slot order, not what is kept


# ---------------------------------------------------------------------- scoring primitives
def dense_attention(query, keys, scale):
    group = query.shape[0] // keys.shape[0]
    logits = torch.einsum("hqd,hkd->hqk", query, keys.repeat_interleave(group, dim=0)) * scale
    s = query.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)


def test_chunked_accumulation_equals_the_unchunked_matrix():
    torch.manual_seed(0)
    query, keys = torch.randn(6, 97, 8), torch.randn(2, 97, 8)
    reference = dense_attention(query, keys, 0.3).sum(dim=1)
    for chunk in (1, 7, 32, 97, None):
        assert torch.allclose(accumulated_attention(query, keys, 0.3, chunk=chunk), reference, atol=1e-5)
    tiny_blocks = accumulated_attention(query, keys, 0.3, max_elements=6 * 97 * 3)  # 3 rows per chunk
    assert torch.allclose(tiny_blocks, reference, atol=1e-5)
    assert torch.allclose(reference.sum(dim=1), torch.full((6,), 97.0))  # every query's row sums to 1


def test_window_votes_are_the_last_queries_attention():
    torch.manual_seed(1)
    query, keys = torch.randn(4, 50, 8), torch.randn(4, 50, 8)
    votes = window_votes(query, keys, 6, 0.3)
    assert torch.allclose(votes, dense_attention(query, keys, 0.3)[:, -6:].sum(dim=1), atol=1e-6)


def test_pooling_is_same_length_and_odd():
    votes = torch.tensor([[0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 4.0, 4.0, 4.0, 0.0]])
    assert pool1d(votes, 3, "avg").tolist()[0][1:4] == [3.0, 3.0, 3.0]
    assert pool1d(votes, 3, "avg")[0, 0].item() == 0.0 and pool1d(votes, 3, "avg")[0, 7].item() == 4.0
    assert pool1d(votes, 3, "max").tolist()[0][:5] == [0.0, 9.0, 9.0, 9.0, 0.0]
    assert torch.equal(pool1d(votes, 1, "max"), votes)
    with pytest.raises(ValueError, match="odd"):
        pool1d(votes, 4, "avg")


# ---------------------------------------------------------------------- the pyramid
def test_pyramid_schedule_matches_the_authors_formula_on_a_worked_example():
    # C = 74 selected tokens per layer, 30 layers, beta 20 (SmolLM2 at a 1k prompt):
    # min = 74 // 20 = 3, max = 2*74 - 3 = 145, step = (145 - 3) // 29 = 4 -> 145, 141, ..., 29
    authors = pyramid_budgets(74, 30, 10_000, 20, "authors")
    assert authors == [145 - 4 * layer for layer in range(30)]
    # the floored step keeps L*C + L*r/2 tokens, r = (max - min) mod (L - 1) = 142 mod 29 = 26
    assert sum(authors) == 30 * 74 + 30 * 26 // 2
    # a prompt too short for max: max = A = 1500, min = 2*1000 - 1500 = 500, step 250
    assert pyramid_budgets(1000, 5, 1500, 20, "authors") == [1500, 1250, 1000, 750, 500]


def test_exact_pyramid_keeps_the_uniform_total_and_follows_the_formula():
    exact = pyramid_budgets(74, 30, 10_000, 20, "exact")
    assert sum(exact) == 30 * 74
    assert exact == sorted(exact, reverse=True) and exact[0] > exact[-1]
    low, high = 74 / 20, 2 * 74 - 74 / 20
    real = [high - layer * (high - low) / 29 for layer in range(30)]
    assert all(abs(b - r) <= 1 for b, r in zip(exact, real))
    assert pyramid_budgets(1000, 5, 1500, 20, "exact") == [1500, 1250, 1000, 750, 500]
    assert pyramid_budgets(10, 1, 100) == [10]


def test_pyramidkv_resolves_per_layer_budgets_of_the_same_total():
    method = PyramidKV({"window": 32, "rounding": "exact"})
    b = method.resolve_budget(BudgetConfig(**SMALL), 4096, 4096 + 16, 30)
    assert b.local == 32 and len(b.per_layer) == 30
    assert sum(b.per_layer) == 30 * b.budget
    assert [b.layer_budget(layer) - b.local for layer in range(30)] == pyramid_budgets(b.select, 30, 4096 - 32 - 32)
    covering = method.resolve_budget(BudgetConfig(tokens=600), 500, 600, 30)
    assert covering.per_layer == (covering.budget,) * 30
    short = method.resolve_budget(BudgetConfig(token_ratio=0.7), 500, 510, 30)  # s < 2C: uniform
    assert set(short.per_layer) == {short.budget}


# ---------------------------------------------------------------------- the store's swap-remove
def test_swap_remove_evicts_in_place_and_reports_the_moves():
    torch.manual_seed(2)
    for trial in range(20):
        heads, n, dim = 3, 40, 4
        kv = LayerKV(heads, dim, dtype=torch.float32, device=torch.device("cpu"))
        keys = torch.randn(heads, n, dim)
        kv.append(keys, -keys)
        capacity = kv.capacity
        r = 1 + trial % 6
        slots = torch.stack([torch.randperm(n)[:r] for _ in range(heads)])
        before = kv.positions.clone()
        tracked = before.clone()  # a method's per-slot state, moved with the reported pairs
        dst, src = kv.swap_remove(slots)
        index = torch.arange(heads)[:, None]
        tracked[index, dst] = tracked[index, src]
        assert kv.n == n - r and kv.capacity == capacity
        for h in range(heads):
            expected = sorted(set(range(n)) - set(slots[h].tolist()))
            assert sorted(kv.positions[h].tolist()) == expected
            assert torch.equal(kv.keys[h], keys[h, kv.positions[h]]) and torch.equal(kv.values[h], -kv.keys[h])
        assert torch.equal(tracked[:, : kv.n], kv.positions)
    kv.append(torch.ones(heads, 1, dim), torch.ones(heads, 1, dim))
    assert kv.positions[:, -1].tolist() == [n] * heads
    with pytest.raises(ValueError, match="distinct"):
        kv.swap_remove(torch.tensor([[0, 0], [1, 2], [3, 4]]))


def test_h2o_without_a_window_still_keeps_the_token_it_just_generated():
    """budget.local=0: nothing recent is protected, except the current token, which would otherwise be
    the first victim (it has received the attention of one query only)."""
    s, d = 30, 4
    query, key = spike_pattern(s=s, spikes=((7, 6.0),))
    budget = ResolvedBudget(context=s, sink=2, local=0, select=4)
    method = create_method({"name": "h2o"})
    kv = prefill(method, query, key, budget)
    for _ in range(6):
        kv.append(torch.zeros(1, 1, d), torch.zeros(1, 1, d))
        probs = torch.full((1, kv.n), 1.0 / kv.n)
        probs[0, -1] = 1e-6  # the new token attends almost nothing to itself: the lowest score
        method.after_attention(0, None, None, kv, probs)
        held = kv.positions[0].tolist()
        assert kv.seen - 1 in held and kv.n == 2 + 4  # the current token survived its own step
