"""The default recall (``profile.recall_rule=attended``, the ClusterKV paper's Fig. 11 quantity):
hand-built cases with known overlaps, the oracle's 1.0, and one definition whatever method runs
(checked against an independent set-based reference in the style of ClusterKV's ``stat_topk``)."""

from __future__ import annotations

import pytest
import torch

from kvbench.budget import BudgetConfig
from kvbench.engine.generate import generate
from kvbench.errors import ConfigError
from kvbench.methods import create_method
from kvbench.methods.selection import attended_recall
from kvbench.profile import Profile


def two_heads():
    """One KV head, two query heads (group 2), 8 prompt tokens and 2 generated ones.

    Query head 0 looks along e0, head 1 along e1. Prompt keys 0-3 point along e0 (head 0's exact top-4),
    keys 4-7 along e1 (head 1's); the generated keys 8 and 9 outscore everything but are not prompt."""
    keys = torch.zeros(1, 10, 2)
    keys[0, 0:4, 0] = torch.tensor([4.0, 3.5, 3.0, 2.5])
    keys[0, 4:8, 1] = torch.tensor([4.0, 3.5, 3.0, 2.5])
    keys[0, 0:4, 1] = 0.1  # small cross terms: the other head ranks them below its own
    keys[0, 4:8, 0] = 0.1
    keys[0, 8:10] = 50.0
    query = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 2, 1, 2)
    positions = torch.arange(10).view(1, 10)
    return query, keys, positions


def test_a_kv_head_selection_scores_its_overlap_with_each_query_heads_top_b():
    query, keys, positions = two_heads()
    # one set for both query heads: {0, 1} of head 0's top-4, {4, 5} of head 1's, a generated token
    slots = torch.tensor([[0, 1, 4, 5, 8]])
    recall = attended_recall(query, keys, positions, slots, prompt=8, b=4)
    assert recall.tolist() == [0.5, 0.5]


def test_a_query_head_selection_scores_each_head_against_its_own_top_b():
    query, keys, positions = two_heads()
    slots = torch.tensor([[0, 1, 2, 9], [4, 5, 6, 7]])  # head 0: 3 of 4 (9 is generated); head 1: all 4
    assert attended_recall(query, keys, positions, slots, prompt=8, b=4).tolist() == [0.75, 1.0]
    # B counts sinks like any token: the exact top-2 of head 0 is {0, 1}
    assert attended_recall(query, keys, positions, slots, prompt=8, b=2).tolist() == [1.0, 1.0]
    # a budget larger than the held prompt is capped at it: 3 (head 0) and 4 (head 1) of 8
    assert attended_recall(query, keys, positions, slots, prompt=8, b=100).tolist() == [3 / 8, 4 / 8]


def test_recall_rules_are_checked():
    assert Profile().recall_rule == "attended"
    with pytest.raises(ConfigError, match="recall_rule"):
        Profile(recall_rule="per_kv_head")


def one_step(loaded, method_cfg, ids, budget, rule="attended"):
    """One decode step (two generated tokens), recording every selecting layer's inputs to ``select``."""
    method = create_method(method_cfg)
    seen: dict[int, tuple] = {}
    original = method.select

    def spy(layer, query, kv):
        selection = original(layer, query, kv)
        seen[layer] = (query.clone(), kv.keys.clone(), kv.positions.clone(), selection.slots.clone())
        return selection

    method.select = spy
    out = generate(
        loaded,
        method,
        ids,
        max_new_tokens=2,
        min_new_tokens=2,
        budget=budget,
        profile=Profile(recall=True, recall_rule=rule),
    )
    return out, seen


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_the_oracle_per_query_head_covering_its_own_selection_scores_one(fixture, request, random_ids):
    loaded = request.getfixturevalue(fixture)
    ids = random_ids(400, seed=61)
    budget = BudgetConfig(tokens=64, sink=0, local=0)  # B = 64 = what the oracle selects
    out, _ = one_step(loaded, {"name": "oracle", "per_query_head": True}, ids, budget)
    assert out.telemetry["recall_b"] == 64
    assert out.telemetry["recall"] == pytest.approx(1.0)
    assert all(r == pytest.approx(1.0) for r in out.telemetry["recall_per_layer"])
    # one set per KV head cannot be every query head's top-B: the same B, a lower recall
    shared, _ = one_step(loaded, {"name": "oracle", "per_query_head": False}, ids, budget)
    assert shared.telemetry["recall"] < 0.99


def reference_recall(query, keys, positions, slots, prompt, b):
    """ClusterKV's ``stat_topk`` written with Python sets: per query head, top-b of raw q·k over the
    prompt keys, overlap with the attended prompt slots, divided by b; mean over heads."""
    query, keys, positions, slots = query.cpu(), keys.cpu(), positions.cpu(), slots.cpu()
    heads = query.shape[1]
    group = heads // keys.shape[0]
    per_row = heads // slots.shape[0]
    values = []
    for h in range(heads):
        prompt_slots = [i for i in range(keys.shape[1]) if positions[h // group, i] < prompt]
        logits = torch.stack([query[0, h, 0].float() @ keys[h // group, i].float() for i in prompt_slots])
        exact = {prompt_slots[i] for i in torch.topk(logits, b).indices.tolist()}
        predicted = {s for s in slots[h // per_row].tolist() if positions[h // group, s] < prompt}
        values.append(len(predicted & exact) / b)
    return sum(values) / heads


@pytest.mark.parametrize(
    "cfg",
    [
        {"name": "oracle"},
        {"name": "oracle", "per_query_head": True},
        {"name": "quest"},
        {"name": "clusterkv"},
        {"name": "sparq"},
        {"name": "infllm", "block_size": 32},
        {"name": "pqcache", "m": 2, "b": 4},
    ],
    ids=lambda cfg: "-".join(str(v) for v in cfg.values()),
)
def test_every_method_is_scored_by_the_same_definition(cfg, tiny_llama, random_ids):
    """The engine's recall of each layer equals the independent reference computed from what that
    layer attended, with the same B for every method (same budget.* keys)."""
    ids = random_ids(600, seed=62)
    budget = BudgetConfig(tokens=96, sink=16, local=16, comm_ratio=1 / 64)
    out, seen = one_step(tiny_llama, cfg, ids, budget)
    b = out.telemetry["recall_b"]
    assert b == 16 + 96
    per_layer = out.telemetry["recall_per_layer"]
    assert set(seen) == {layer for layer, r in enumerate(per_layer) if r is not None} and seen
    for layer, (query, keys, positions, slots) in seen.items():
        assert per_layer[layer] == pytest.approx(reference_recall(query, keys, positions, slots, 600, b), abs=1e-6)


def test_the_earlier_rule_is_still_available(tiny_llama, random_ids):
    """``softmax_sum`` scores only the chosen part against the oracle's own rule: the oracle gets 1."""
    out, _ = one_step(
        tiny_llama, {"name": "oracle"}, random_ids(400, seed=63), BudgetConfig(token_ratio=0.1), rule="softmax_sum"
    )
    assert out.telemetry["recall"] == pytest.approx(1.0) and "recall_b" not in out.telemetry
