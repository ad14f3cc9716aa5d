"""CacheBlend as its authors' released code and LMCache run it.

* ``check_rows: selected`` (default): the check layer computes Q/K/V for every row and then attention,
  the output projection and the MLP for the selected rows only; ``all`` runs every row through the
  whole layer (what kvbench did before). The selected rows' results are the same computation, so the
  two agree to float rounding, and the MLP sees fewer rows.
* ``mask: code`` is the released bottom-right-aligned mask at the check layer too: the k selected
  queries attend as the last k positions.
* ``suffix: last_token`` caches the query segment like a chunk, so no held slot is a never-written
  one; the store refuses to be attended with one.
* ``deviation: k`` ranks tokens by the post-RoPE K deviation (LMCache v1) instead of V's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbench.engine import attention
from kvbench.kv.store import LayerKV
from tests.test_reuse_static import LARGE, SMALL, prefill, segmented


def _mlp_rows(loaded, monkeypatch):
    """Rows each layer's MLP is called with, in call order."""
    seen: list[int] = []
    for layer in loaded.model.model.layers:
        original = layer.mlp.forward

        def counting(x, _original=original):
            seen.append(int(x.shape[1]))
            return _original(x)

        monkeypatch.setattr(layer.mlp, "forward", counting)
    return seen


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_selected_rows_agree_with_every_row_and_skip_the_rest(model, request, monkeypatch):
    loaded = request.getfixturevalue(model)
    segments = segmented(LARGE)
    n = sum(LARGE)
    rows = _mlp_rows(loaded, monkeypatch)
    layers = loaded.spec.n_layers
    ctx_all, logits_all, _ = prefill(loaded, {"name": "cacheblend", "check_rows": "all"}, segments)
    all_rows = rows[-layers:]  # (the chunks' precomputation ran the MLPs first)
    ctx_sel, logits_sel, _ = prefill(loaded, {"name": "cacheblend"}, segments)
    rows = rows[-layers:]
    # layer 0 and the check layer (1) see every row with `all`; with `selected` the check layer's MLP
    # sees the selected rows, as every later layer does
    assert all_rows[:2] == [n, n]
    kept = all_rows[2]
    assert kept < n and rows[0] == n and rows[1] == kept and rows[2:] == all_rows[2:]
    torch.testing.assert_close(logits_sel, logits_all, rtol=1e-4, atol=1e-4)
    for layer in range(loaded.spec.n_layers):
        a, b = ctx_all.store[layer], ctx_sel.store[layer]
        assert torch.equal(a.positions, b.positions)
        torch.testing.assert_close(b.keys, a.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b.values, a.values, rtol=1e-4, atol=1e-4)
    assert ctx_sel.telemetry.prefill_plan["reused_tokens"] == ctx_all.telemetry.prefill_plan["reused_tokens"]


def test_code_mask_covers_the_check_layer(tiny_llama, monkeypatch):
    """With the released mask, the check layer's selected queries attend as the last k positions
    (bottom-right), the layout the later layers reuse; with ``all`` the check layer runs exact."""
    made: list[np.ndarray] = []
    original = attention.past_layout

    def recording(keys, positions, **kwargs):
        made.append(np.asarray(positions).copy())
        return original(keys, positions, **kwargs)

    monkeypatch.setattr(attention, "past_layout", recording)
    n = sum(LARGE)
    ctx, _, _ = prefill(tiny_llama, {"name": "cacheblend", "mask": "code"}, segmented(LARGE))
    assert len(made) == 1  # one layout, made at the check layer and reused by every later layer
    k = len(made[0])
    assert k < n and made[0].tolist() == list(range(n - k, n))
    made.clear()
    prefill(tiny_llama, {"name": "cacheblend", "mask": "code", "check_rows": "all"}, segmented(LARGE))
    assert len(made) == 1 and made[0].tolist() == list(range(n - k, n))  # the check layer ran dense
    _, exact, _ = prefill(tiny_llama, {"name": "cacheblend"}, segmented(LARGE))
    _, code, _ = prefill(tiny_llama, {"name": "cacheblend", "mask": "code"}, segmented(LARGE))
    assert not torch.allclose(exact, code)  # the mask is really applied


@pytest.mark.parametrize("check_rows", ["selected", "all"])
def test_last_token_suffix_attends_only_written_slots(tiny_llama, check_rows):
    """Before, ``suffix: last_token`` left the query rows the check layer dropped as never-written slots
    (zero K/V at position -1) in every later layer, and decode attended them."""
    n = sum(SMALL)
    cfg = {"name": "cacheblend", "suffix": "last_token", "recompute_ratio": 0.1, "check_rows": check_rows}
    ctx, logits, _ = prefill(tiny_llama, cfg, segmented(SMALL))
    for layer in range(tiny_llama.spec.n_layers):
        kv = ctx.store[layer]
        assert kv.n == n
        assert kv.positions[0].tolist() == list(range(n))
        kv.check_written(layer)
    plan = ctx.telemetry.prefill_plan
    assert plan["chunks"] == len(SMALL)  # the prefix, the chunks and the query, all cached
    assert torch.isfinite(logits).all()


def test_the_store_refuses_a_never_written_slot():
    kv = LayerKV(2, 4, dtype=torch.float32, device=torch.device("cpu"))
    kv.write(torch.tensor([0, 1, 2]), torch.ones(2, 3, 4), torch.ones(2, 3, 4), torch.tensor([0, 1, 2]))
    kv.check_written(0)
    kv.write(torch.tensor([5, 6]), torch.ones(2, 2, 4), torch.ones(2, 2, 4), torch.tensor([5, 6]))
    with pytest.raises(RuntimeError, match=r"layer 3 holds 2 slot\(s\) never written \(first: \[3, 4\]\)"):
        kv.check_written(3)
    kv.write(torch.tensor([4]), torch.ones(2, 1, 4), torch.ones(2, 1, 4), torch.tensor([4]))
    with pytest.raises(RuntimeError, match=r"1 slot\(s\) never written \(first: \[3\]\)"):
        kv.check_written()
    kv.write(torch.tensor([3]), torch.ones(2, 1, 4), torch.ones(2, 1, 4), torch.tensor([3]))
    kv.check_written()


def test_k_deviation_ranks_by_the_post_rope_keys(tiny_llama, monkeypatch):
    """``deviation: k`` keeps the forced rows and the top-k candidates of the K deviation, computed here
    independently from the plan's fresh and installed keys."""
    from kvbench.methods.cacheblend import CacheBlend

    seen = {}
    original = CacheBlend.on_layer

    def spying(self, plan, layer, fresh_v):
        keep = original(self, plan, layer, fresh_v)
        if keep is not None:
            fresh, cached = plan.fresh_keys(layer), plan.cached_keys(layer)
            seen["dev"] = (fresh.float() - cached.float()).pow(2).sum(dim=(0, 2))
            seen["forced"] = np.flatnonzero(plan.query_flags[plan.rows.positions])
            seen["keep"] = keep.tolist()
            seen["k"] = int(plan.n_context * self.params.recompute_ratio)
            seen["v_dev"] = (fresh_v.float() - plan.cached_values(layer).float()).pow(2).sum(dim=(0, 2))
        return keep

    monkeypatch.setattr(CacheBlend, "on_layer", spying)
    prefill(tiny_llama, {"name": "cacheblend", "deviation": "k"}, segmented(LARGE))
    dev, forced, k = seen["dev"], seen["forced"], seen["k"]
    candidates = np.setdiff1d(np.arange(len(dev)), forced)
    top = candidates[np.argsort(-dev[candidates].numpy(), kind="stable")[:k]]
    assert sorted(seen["keep"]) == sorted({*top.tolist(), *forced.tolist()})
    v_top = candidates[np.argsort(-seen["v_dev"][candidates].numpy(), kind="stable")[:k]]
    assert set(top.tolist()) != set(v_top.tolist())  # the two rankings differ here, so the test has teeth
