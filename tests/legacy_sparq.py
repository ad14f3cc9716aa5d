"""SparQ's decode-time selection as it was before the static decode step, kept as an independent reference.

:class:`LegacySparQ` is the pre-conversion ``select`` of :class:`~kvbench.methods.sparq.SparQ` with its
scoring function, verbatim: a host-side layout read from ``kv.n`` at every step, the middle keys sliced to
their current length, ``topk_sorted`` over the approximate scores. It runs on the dynamic per-layer step
(``static_decode = False``); ``tests/test_static_sparq.py`` checks that the static method attends exactly
the same positions, generates the same tokens and counts the same bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from kvbench.engine.protocol import Selection
from kvbench.kv.store import LayerKV
from kvbench.methods.selection import compose, topk_sorted
from kvbench.methods.sparq import SparQ


def sparq_scores(query: torch.Tensor, keys: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Approximate scores ``[kv_heads, n]`` (group-summed) and the chosen components ``[kv_heads, r]``.

    ``query`` ``[kv_heads, group, d]``, ``keys`` ``[kv_heads, n, d]``.
    """
    d = query.shape[-1]
    components = torch.topk(query.abs().sum(dim=1), r, dim=-1).indices  # [kv_heads, r]
    q_r = torch.gather(query, 2, components[:, None, :].expand(-1, query.shape[1], -1))  # [h, g, r]
    k_r = torch.gather(keys, 2, components[:, None, :].expand(-1, keys.shape[1], -1))  # [h, n, r]
    share = q_r.abs().sum(-1) / query.abs().sum(-1).clamp_min(1e-12)  # ‖q[i_r]‖₁ / ‖q‖₁, [h, g]
    scale = torch.sqrt(d * share).clamp_min(1e-12)
    scores = torch.einsum("hgr,hnr->hgn", q_r, k_r) / scale[..., None]
    return scores.sum(dim=1), components


class LegacySparQ(SparQ):
    name = "_legacy_sparq"
    static_decode = False

    def before_step(self, ctx: Any) -> None:
        """Nothing (the static step's host-side preparation is not the earlier method's)."""

    def select(self, layer: int, query: torch.Tensor, kv: LayerKV) -> Selection:
        budget, spec = self.ctx.budget, self.ctx.spec
        lay = self.layout(kv)
        candidates = lay.candidates(kv.home)
        if budget.select >= lay.middle:
            return compose(lay, candidates.expand(spec.n_kv_heads, -1), ascending=True)
        r = self.rank()
        q = query[0, :, 0, :].to(kv.home).float().view(spec.n_kv_heads, spec.group, -1)
        keys = kv.keys[:, lay.sink_end : lay.middle_end].float()
        scores, _ = sparq_scores(q, keys, r)
        if kv.offload:
            kv.count_index_bytes(spec.n_kv_heads * lay.middle * r * kv.element_bytes)
        return compose(lay, candidates[topk_sorted(scores, budget.select)], ascending=True)
