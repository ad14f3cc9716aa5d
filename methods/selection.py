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

GQA_RULES = ("softmax_sum", "logit_sum", "max")


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
    """Per-KV-head token scores ``[kv_heads, n_candidates]`` from ``[kv_heads, group, n]`` logits.

    ``softmax_sum`` (the PQCache authors' rule): per query head softmax over *all* tokens, sliced to
    the candidates, summed over the group. ``logit_sum``: raw logits summed. ``max``: max over the group.
    """
    if rule == "softmax_sum":
        scores = torch.softmax(logits * scale, dim=-1)
        scores = scores if candidates is None else scores[..., candidates]
        return scores.sum(dim=1)
    picked = logits if candidates is None else logits[..., candidates]
    if rule == "logit_sum":
        return picked.sum(dim=1)
    if rule == "max":
        return picked.max(dim=1).values
    raise ValueError(f"unknown GQA rule {rule!r}; use one of {GQA_RULES}")


def topk_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest scores per row, ascending. Ties go to the lower index."""
    k = min(k, scores.shape[-1])
    # A stable descending sort breaks ties by position, so the pick is deterministic.
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.sort(order, dim=-1).values


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
