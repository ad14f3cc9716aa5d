"""H2O, SnapKV and PyramidKV: equivalence, budget invariants, and selections on hand-made patterns."""

from types import SimpleNamespace

import pytest
import torch

from kvbench.budget import BudgetConfig, ResolvedBudget
from kvbench.engine.generate import generate
from kvbench.kv.store import LayerKV
from kvbench.methods import create_method
from kvbench.methods.attention_scores import accumulated_attention, group_reduce, pool1d, window_votes
from kvbench.methods.pyramidkv import pyramid

METHODS = ["h2o", "snapkv", "pyramidkv"]


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("name", METHODS)
def test_covering_budget_is_token_identical_to_full(fixture, name, request, random_ids):
    loaded = request.getfixturevalue(fixture)
    ids = random_ids(500, seed=41)
    full = generate(loaded, create_method({"name": "full"}), ids, max_new_tokens=16, min_new_tokens=16)
    out = generate(loaded, create_method({"name": name}), ids, max_new_tokens=16, min_new_tokens=16,
                   budget=BudgetConfig(tokens=516))
    assert out.tokens == full.tokens


@pytest.mark.parametrize("name", METHODS)
def test_small_budget_keeps_and_attends_the_resolved_budget(tiny_llama, random_ids, name):
    out = generate(tiny_llama, create_method({"name": name}), random_ids(900, seed=42), max_new_tokens=6,
                   min_new_tokens=6, budget=BudgetConfig(token_ratio=0.1, comm_ratio=1 / 64, compensate=True))
    b, t = out.budget, out.telemetry
    assert b.compensation == int(1 / 128 * (900 - b.sink))
    expected = [b.sink + b.layer_budget(layer) for layer in range(tiny_llama.spec.n_layers)]
    assert t["kept_per_layer"] == expected
    assert t["attended_first_step"] == [k + 1 for k in expected]
    assert t["kv_bytes_ratio"] == pytest.approx(sum(expected) / (900 * tiny_llama.spec.n_layers))
    if name == "h2o":  # keeps evicting: the cache never grows
        assert t["attended_per_layer"] == [k + 1 for k in expected]
    if name == "pyramidkv":
        assert expected == sorted(expected, reverse=True) and expected[0] > expected[-1]


def fake_prefill(method, query, key, budget: ResolvedBudget, group=1):
    """Run a method's on_prefill on crafted tensors; return the kept positions per KV head."""
    h_kv, s, d = key.shape
    kv = LayerKV(h_kv, d, dtype=torch.float32, device=torch.device("cpu"))
    kv.append(key, key.clone())
    spec = SimpleNamespace(head_dim=d, group=group, n_kv_heads=h_kv, n_heads=h_kv * group)
    method.start(SimpleNamespace(budget=budget, spec=spec))
    method.on_prefill(0, query[None], key[None], key[None], kv)
    return kv.positions.tolist()


def test_snapkv_keeps_a_spike_and_its_pooled_neighbours():
    s, d = 40, 4
    key = torch.zeros(1, s, d)
    key[0, 12] = torch.tensor([8.0, 0, 0, 0])  # every window query attends position 12
    query = torch.zeros(1, s, d)
    query[0, :, 0] = 1.0
    budget = ResolvedBudget(context=s, sink=0, local=8, select=5)
    kept = fake_prefill(create_method({"name": "snapkv", "window": 8, "kernel": 5}), query, key, budget)
    assert kept[0] == [10, 11, 12, 13, 14] + list(range(32, 40))  # spike ± 2 (kernel 5) + the window
    no_pool = fake_prefill(create_method({"name": "snapkv", "window": 8, "kernel": 1}), query, key,
                           ResolvedBudget(context=s, sink=0, local=8, select=1))
    assert no_pool[0] == [12] + list(range(32, 40))


def test_snapkv_max_and_avg_pooling_differ():
    votes = torch.tensor([[0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 4.0, 4.0, 4.0, 0.0]])
    # max pooling spreads the peak (9 around index 2 wins), avg favours the plateau around 7
    assert pool1d(votes, 3, "max").argmax().item() in (1, 2, 3)
    assert pool1d(votes, 3, "avg").argmax().item() == 7


def test_h2o_keeps_the_heavy_hitter_over_light_tokens():
    s, d = 30, 4
    key = torch.zeros(1, s, d)
    key[0, 7] = torch.tensor([6.0, 0, 0, 0])  # every query attends position 7
    query = torch.zeros(1, s, d)
    query[0, :, 0] = 1.0
    budget = ResolvedBudget(context=s, sink=2, local=4, select=1)
    kept = fake_prefill(create_method({"name": "h2o"}), query, key, budget)
    assert kept[0] == [0, 1, 7, 26, 27, 28, 29]


def test_h2o_keeps_the_heavy_hitter_during_decode(tiny_llama, random_ids):
    method = create_method({"name": "h2o"})
    ids = random_ids(300, seed=43)
    out = generate(tiny_llama, method, ids, max_new_tokens=30, min_new_tokens=30, budget=BudgetConfig(tokens=60))
    assert out.telemetry["kept_per_layer"] == [92] * tiny_llama.spec.n_layers  # 32 sinks + 60
    for layer in range(tiny_llama.spec.n_layers):
        scores = method.scores[layer]
        assert scores.shape[1] == 92  # evicted one per step, scores track the slots


def test_chunked_accumulation_equals_the_full_matrix():
    torch.manual_seed(0)
    q, k = torch.randn(4, 50, 8), torch.randn(2, 50, 8)
    chunked = accumulated_attention(q, k, 0.3, chunk=7)
    keys = k.repeat_interleave(2, dim=0)
    logits = torch.einsum("hqd,hkd->hqk", q, keys) * 0.3
    mask = torch.ones(50, 50).tril().bool()
    full = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1).sum(1)
    assert torch.allclose(chunked, full, atol=1e-5)
    votes = window_votes(q, k, 5, 0.3)
    assert torch.allclose(votes, torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)[:, -5:, :45].sum(1), atol=1e-5)


def test_gqa_reductions_pick_differently():
    scores = torch.tensor([[5.0, 1.0], [0.0, 3.0]])  # two query heads of one KV head
    assert group_reduce(scores, 2, "sum").argmax().item() == 0  # 5 vs 4
    assert group_reduce(scores, 2, "max").argmax().item() == 0
    assert group_reduce(torch.tensor([[5.0, 4.0], [0.0, 2.0]]), 2, "mean").argmax().item() == 1  # 2.5 vs 3


def test_pyramid_schedule_worked_example():
    # B = 1000, beta 20: min = 50, max = 1950; 5 layers: steps = 1900 // 4 = 475
    assert pyramid(1000, 32, 100_000, 5, 20) == [1950, 1475, 1000, 525, 50]
    # a prompt too short for max: max = s - window = 1500, min = 2000 - 1500 = 500, steps 250
    assert pyramid(1000, 32, 1532, 5, 20) == [1500, 1250, 1000, 750, 500]
