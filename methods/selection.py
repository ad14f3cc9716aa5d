"""Shared pieces of decode-time selection: the sink / middle / local layout and exact top-k.

Every retrieval method attends ``sink + selected + local window + current token`` (PQCache §2.2,
ClusterKV §1.7 with ``local`` = the unclustered recent tokens). These helpers compute that layout from
a store that never evicted (slots are positions) and compose the final, sorted slot lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.kv.store import LayerKV
from kvbench.methods.base import Selection
from kvbench.methods.primitives.pq import GQA_RULES, group_scores
from kvbench.methods.primitives.pq import topk_ascending as topk_sorted

__all__ = ["GQA_RULES", "Layout", "layout", "compose", "aggregate", "topk_sorted", "group_logits", "exact_topk"]


@dataclass(frozen=True)
class Layout:
    """Slot ranges of a non-evicting layer at a decode step (the current token is slot ``n - 1``)."""

    n: int
    sink_end: int
    middle_end: int  # middle = [sink_end, middle_end); local = [middle_end, n - 1)

    @property
    def middle(self) -> int:
        return self.middle_end - self.sink_end

    def candidates(self, device: torch.device) -> torch.Tensor:
        return torch.arange(self.sink_end, self.middle_end, device=device)

    def fixed(self, device: torch.device) -> torch.Tensor:
        """Sink, local window and current token: attended whatever the selection."""
        return torch.cat(
            [torch.arange(0, self.sink_end, device=device), torch.arange(self.middle_end, self.n, device=device)]
        )


def layout(kv: LayerKV, sink: int, local: int) -> Layout:
    n = kv.n
    sink_end = min(sink, max(n - 1, 0))
    middle_end = max(sink_end, n - 1 - local)
    return Layout(n=n, sink_end=sink_end, middle_end=middle_end)


def compose(lay: Layout, selected: torch.Tensor) -> Selection:
    """Final selection: fixed slots plus ``selected`` (``[rows, k]`` middle slots), sorted per row."""
    rows = selected.shape[0]
    fixed = lay.fixed(selected.device).expand(rows, -1)
    slots, _ = torch.sort(torch.cat([fixed, selected], dim=1), dim=1)
    return Selection(slots=slots, selected=selected, candidates=lay.candidates(selected.device))


def group_logits(query: torch.Tensor, keys: torch.Tensor, group: int) -> torch.Tensor:
    """Exact ``q·k`` logits ``[kv_heads, group, n]`` from ``query`` ``[1, H, 1, d]`` and ``keys`` ``[kv_heads, n, d]``."""
    q = query[0, :, -1, :].to(device=keys.device, dtype=torch.float32)
    q = q.view(keys.shape[0], group, -1)
    return torch.einsum("hgd,hnd->hgn", q, keys.to(torch.float32))


def aggregate(logits: torch.Tensor, rule: str, scale: float, candidates: torch.Tensor | None = None) -> torch.Tensor:
    """Per-KV-head token scores ``[kv_heads, n_candidates]`` from ``[kv_heads, group, n]`` exact logits.

    ``softmax_sum`` is the PQCache authors' Oracle: per query head softmax over *all* held tokens, then
    sliced to the candidates and summed over the group (their approximate path normalises over the
    candidates only: ``group_scores`` on the candidates' scores). ``logit_sum`` / ``max``: see
    :func:`~kvbench.methods.primitives.pq.group_scores`.
    """
    if rule == "softmax_sum" and candidates is not None:
        return torch.softmax(logits * scale, dim=-1)[..., candidates].sum(dim=1)
    return group_scores(logits if candidates is None else logits[..., candidates], rule, scale)


def exact_topk(
    query: torch.Tensor,
    keys: torch.Tensor,
    candidates: torch.Tensor,
    k: int,
    *,
    group: int,
    per_query_head: bool,
    rule: str = "softmax_sum",
    scale: float,
) -> torch.Tensor:
    """The exact top-``k`` candidate slots: ``[kv_heads, k]`` under a GQA rule, or ``[q_heads, k]``
    by each query head's own logits. This is the Oracle's pick and the recall reference."""
    logits = group_logits(query, keys, group)
    cand = candidates.to(keys.device)
    if per_query_head:
        scores = logits[..., cand].reshape(-1, cand.numel())
    else:
        scores = aggregate(logits, rule, scale, cand)
    return cand[topk_sorted(scores, k)]
