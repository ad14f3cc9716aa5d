"""Shared pieces of decode-time selection: the sink / middle / local layout, exact top-k, recall.

Every retrieval method attends ``sink + selected + local window + current token`` (PQCache §2.2,
ClusterKV §1.7 with ``local`` = the unclustered recent tokens). These helpers compute that layout from
a store that never evicted (slots are positions) and compose the final, sorted slot lists.

:func:`attended_recall` is the recall the engine reports by default (``profile.recall_rule=attended``,
see :mod:`kvbench.telemetry`): one definition for every method, whatever its selection's shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.kv.store import LayerKV
from kvbench.methods.base import Selection
from kvbench.methods.primitives.pq import GQA_RULES, group_scores, topk_keyed
from kvbench.methods.primitives.pq import topk_ascending as topk_sorted

__all__ = [
    "GQA_RULES",
    "Layout",
    "layout",
    "StaticLayout",
    "static_layout",
    "topk_keyed",
    "compose",
    "aggregate",
    "topk_sorted",
    "group_logits",
    "exact_topk",
    "attended_recall",
]


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


@dataclass(frozen=True)
class StaticLayout:
    """The layout of a static decode step (:mod:`kvbench.engine.decode`): the same three parts as
    :class:`Layout`, from host constants and the device-side length only, so that every step of a
    regime issues the same ops. Candidates are the ``width`` slots ``[sink, end)`` of the layer's bucket,
    of which those from ``middle_end`` on are masked (the local window, the current token, unheld slots).

    Valid while the budget leaves tokens out (``n - 1 - local > sink``, the method's regime): a covering
    budget attends the layer densely and has no layout."""

    kv: LayerKV
    sink: int
    local: int

    @property
    def end(self) -> int:
        return self.kv.bucket_end

    @property
    def width(self) -> int:
        return self.end - self.sink

    def middle_end(self) -> torch.Tensor:
        """``[1]``: the first slot after the middle (the local window's first), on the device."""
        assert self.kv.length is not None, "a static layout needs the decoder's counters"
        return self.kv.length - (1 + self.local)

    def candidates(self, middle_end: torch.Tensor) -> torch.Tensor:
        """``[width]`` bool: which slots of ``[sink, end)`` are middle tokens (below ``middle_end``)."""
        return self.kv.iota(self.end)[self.sink :] < middle_end

    def outside(self, middle_end: torch.Tensor) -> torch.Tensor:
        """``[width]`` bool: the complement of :meth:`candidates` (one op, for a ``masked_fill``)."""
        return self.kv.iota(self.end)[self.sink :] >= middle_end

    def unheld(self) -> torch.Tensor:
        """``[end]`` bool: the slots of the bucket that hold no token yet (from the length on)."""
        assert self.kv.length is not None
        return self.kv.iota(self.end) >= self.kv.length

    def compose(self, selected: torch.Tensor, middle_end: torch.Tensor) -> Selection:
        """Sinks, ``selected`` (``[rows, k]`` middle slots, ascending per row) and the local window with the
        current token: ``[rows, sink + k + local + 1]`` slots, ascending (no sort: the parts are ordered)."""
        rows = selected.shape[0]
        sinks = self.kv.iota(self.sink).expand(rows, -1)
        local = (middle_end + self.kv.iota(self.local + 1)).expand(rows, -1)
        return Selection(slots=torch.cat([sinks, selected, local], dim=1), selected=selected)


def static_layout(kv: LayerKV, sink: int, local: int) -> StaticLayout:
    return StaticLayout(kv=kv, sink=sink, local=local)


def compose(lay: Layout, selected: torch.Tensor, *, ascending: bool = False) -> Selection:
    """Final selection: fixed slots plus ``selected`` (``[rows, k]`` middle slots), sorted per row.

    ``ascending``: every row of ``selected`` is already in ascending order (``topk_sorted``'s output,
    offset or not). Sinks lie below the middle and the local window above it, so the sorted slots are
    then sinks, ``selected``, local, concatenated as they are: no sort."""
    rows = selected.shape[0]
    device = selected.device
    if ascending:
        sinks = torch.arange(0, lay.sink_end, device=device).expand(rows, -1)
        local = torch.arange(lay.middle_end, lay.n, device=device).expand(rows, -1)
        slots = torch.cat([sinks, selected, local], dim=1)
    else:
        fixed = lay.fixed(device).expand(rows, -1)
        slots, _ = torch.sort(torch.cat([fixed, selected], dim=1), dim=1)
    return Selection(slots=slots, selected=selected, candidates=lay.candidates(device))


def group_logits(query: torch.Tensor, keys: torch.Tensor, group: int) -> torch.Tensor:
    """Exact ``q·k`` logits ``[kv_heads, group, n]`` from ``query`` ``[1, H, 1, d]`` and ``keys``
    ``[kv_heads, n, d]``."""
    q = query[0, :, -1, :].to(device=keys.device, dtype=torch.float32)
    q = q.view(keys.shape[0], group, -1)
    return torch.einsum("hgd,hnd->hgn", q, keys.to(torch.float32))


def aggregate(
    logits: torch.Tensor, rule: str, scale: float, candidates: torch.Tensor | slice | None = None
) -> torch.Tensor:
    """Per-KV-head token scores ``[kv_heads, n_candidates]`` from ``[kv_heads, group, n]`` exact logits.

    ``candidates``: slots (a tensor), or a ``slice`` for a contiguous range (a view: no gather).

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
    candidates: torch.Tensor | slice,
    k: int,
    *,
    group: int,
    per_query_head: bool,
    rule: str = "softmax_sum",
    scale: float,
) -> torch.Tensor:
    """The exact top-``k`` candidate slots: ``[kv_heads, k]`` under a GQA rule, or ``[q_heads, k]``
    by each query head's own logits, ascending per row. This is the Oracle's pick and the recall
    reference. ``candidates``: slots, or a ``slice(start, stop)`` of consecutive slots (the middle of a
    :class:`Layout`), which reads the logits through a view instead of a gather."""
    logits = group_logits(query, keys, group)
    if isinstance(candidates, slice):
        start = candidates.start or 0
        picked = logits[..., candidates]
        scores = picked.reshape(-1, picked.shape[-1]) if per_query_head else aggregate(logits, rule, scale, candidates)
        return topk_sorted(scores, k) + start
    cand = candidates.to(keys.device)
    if per_query_head:
        scores = logits[..., cand].reshape(-1, cand.numel())
    else:
        scores = aggregate(logits, rule, scale, cand)
    return cand[topk_sorted(scores, k)]


def attended_recall(
    query: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, prompt: int, b: int
) -> torch.Tensor:
    """Recall of the exact top-``b`` prompt tokens per query head: ``[H]`` fractions in ``[0, 1]``.

    The ClusterKV paper's Fig. 11 quantity (``|I_T ∩ I_T^true| / B``; its code's ``stat_topk``):

    * **exact set** of query head ``h``: the ``b`` prompt tokens (``positions < prompt``, sinks included)
      with the largest raw ``q_h · k`` (no softmax, no group reduction), ranked over every held prompt
      key of the head's KV head; ties go to the lower slot;
    * **predicted set**: the prompt tokens among ``slots`` — everything the method attends at this
      step (sinks, local window and selected alike; generated tokens never count). ``slots`` is
      ``[rows, a]``: rows = query heads (a per-query-head selection), or KV heads, whose set every query
      head of the group attends;
    * ``|predicted ∩ exact| / b``. With ``b`` larger than the held prompt the denominator is the held
      prompt (the method can then attend all of it, which scores 1).

    ``query`` ``[1, H, 1, d]``, ``keys`` ``[kv_heads, n, d]``, ``positions`` ``[kv_heads, n]``. Which
    method produced ``slots`` plays no part: two methods attending the same tokens score the same.
    """
    heads, kv_heads = query.shape[1], keys.shape[0]
    group = heads // kv_heads
    logits = group_logits(query, keys, group).reshape(heads, -1)  # row h: query head h against KV head h // group
    in_prompt = (positions < prompt).to(logits.device).repeat_interleave(group, dim=0)
    k = min(int(b), int(in_prompt.sum(dim=1).min()))
    if k <= 0:
        raise ValueError(f"recall needs a positive budget and held prompt tokens, got b={b}")
    exact = topk_sorted(logits.masked_fill(~in_prompt, float("-inf")), k)
    truth = torch.zeros_like(in_prompt).scatter_(1, exact, True)
    rows = slots.shape[0]
    if heads % rows:
        raise ValueError(f"cannot map {rows} selection rows onto {heads} query heads")
    attended = slots.to(logits.device).repeat_interleave(heads // rows, dim=0)
    predicted = torch.zeros_like(in_prompt).scatter_(1, attended, True)
    return (predicted & truth).sum(dim=1).float() / k
