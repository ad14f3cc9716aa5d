"""The random-eviction control (``method=random_eviction``): the budget kept exactly, drawn per layer and head,
repeatable, and a seed that changes the draw. (A covering budget equals full: tests/test_covering_contract.py.)"""

from __future__ import annotations

from kvbench.methods import create_method

from .test_eviction import generate_with_ctx


def _kept(loaded, ids, seed=0, **budget):
    """The run and, per layer, the positions each KV head kept after the prefill."""
    out, ctx = generate_with_ctx(loaded, create_method({"name": "random_eviction", "seed": seed}), ids, n=4, **budget)
    return out, [ctx.store[layer].positions[:, : out.budget.total].clone() for layer in range(loaded.spec.n_layers)]


def test_random_keeps_the_budget_drawn_per_layer_and_head_and_repeatably(tiny_llama, random_ids):
    ids = random_ids(500, seed=61)
    out, kept = _kept(tiny_llama, ids, tokens=64)
    b = out.budget
    assert (b.sink, b.local, b.select) == (0, 0, 64)  # RandomPress's defaults: the whole budget drawn
    assert out.telemetry["kept_per_layer"] == [64] * tiny_llama.spec.n_layers
    heads = kept[0].shape[0]
    assert heads == tiny_llama.spec.n_kv_heads > 1
    assert not all(set(kept[0][0].tolist()) == set(kept[0][h].tolist()) for h in range(heads))  # per head
    assert set(kept[0][0].tolist()) != set(kept[1][0].tolist())  # per layer
    again, kept_again = _kept(tiny_llama, ids, tokens=64)
    assert all(a.equal(b) for a, b in zip(kept, kept_again)) and again.tokens == out.tokens  # repeatable
    _, other = _kept(tiny_llama, ids, seed=1, tokens=64)
    assert not all(a.equal(b) for a, b in zip(kept, other))  # another seed, another draw


def test_sinks_and_a_window_are_kept_whole_when_asked(tiny_llama, random_ids):
    ids = random_ids(400, seed=62)
    out, kept = _kept(tiny_llama, ids, tokens=100, sink=4, local=20)
    for positions in kept:
        for row in positions.tolist():
            assert set(range(4)) <= set(row) and set(range(380, 400)) <= set(row) and len(set(row)) == 104
