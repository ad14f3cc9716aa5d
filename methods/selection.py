"""Shared pieces of decode-time selection: the sink / middle / local layout, exact top-k, recall.

Every retrieval method attends ``sink + selected + local window + current token`` (PQCache §2.2,
ClusterKV §1.7 with ``local`` = the unclustered recent tokens). These helpers compute that layout from
a store that never evicted (slots are positions) and compose the final, sorted slot lists.

:func:`attended_recall` is the recall the engine reports by default (``profile.recall_rule=attended``,
see :mod:`kvbench.telemetry`): one definition for every method, whatever its selection's shape; it and
the exact top-k live in the engine (:mod:`kvbench.engine.recall`) and are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.engine.protocol import Selection
from kvbench.engine.ranking import GQA_RULES, topk_keyed
from kvbench.engine.ranking import topk_ascending as topk_sorted
from kvbench.engine.recall import aggregate, attended_recall, exact_topk, group_logits
from kvbench.kv.store import LayerKV

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
