"""Key-norm eviction (``method=knorm``): per layer and KV head it keeps exactly the prompt tokens whose
keys have the smallest L2 norms, as a written-out reference over a dense run's keys picks them. (A covering
budget equals full: tests/test_covering_contract.py.)"""

from __future__ import annotations

from kvbench.methods import create_method

from .test_eviction import generate_with_ctx


def _reference(keys, s, sink, local, select):
    """Per KV head, the sorted positions a key-norm rule keeps, written out with Python's sort (over the
    float32 norms the method computes: two keys of this test tie there, 83 and 224 of layer 0, and the
    earlier one is kept)."""
    kept = []
    all_norms = keys.float().norm(dim=-1).tolist()
    for head in range(keys.shape[0]):
        norms = all_norms[head]
        middle = sorted(range(sink, s - local), key=lambda i: (norms[i], i))[:select]
        kept.append(sorted([*range(sink), *middle, *range(s - local, s)]))
    return kept


def test_knorm_keeps_the_smallest_key_norms_per_layer_and_head(tiny_llama, random_ids):
    s, ids = 300, random_ids(300, seed=71)
    _, dense = generate_with_ctx(tiny_llama, create_method({"name": "full"}), ids, n=2)
    for budget, parts in (({"tokens": 48}, (0, 0, 48)), ({"tokens": 60, "sink": 4, "local": 12}, (4, 12, 48))):
        out, ctx = generate_with_ctx(tiny_llama, create_method({"name": "knorm"}), ids, n=2, **budget)
        b = out.budget
        assert (b.sink, b.local, b.select) == parts  # KnormPress's defaults: no sinks, no window
        for layer in range(tiny_llama.spec.n_layers):
            keys = dense.store[layer].keys[:, :s]  # [kv_heads, s, d], post-RoPE (the norm is the same before it)
            kept = ctx.store[layer].positions[:, : b.total].sort(dim=1).values.tolist()
            assert kept == _reference(keys, s, *parts), (layer, budget)
    heads = tiny_llama.spec.n_kv_heads
    assert heads > 1 and len({tuple(row) for row in kept}) > 1  # each head its own tokens
