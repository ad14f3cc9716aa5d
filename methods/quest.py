"""``quest``: query-aware page selection by key min/max bounds (Tang et al., 2024), as Quest runs it.

Keys are grouped into pages of ``page_size`` (16) consecutive positions. Each page keeps the
element-wise minimum ``m`` and maximum ``M`` of its keys (per KV head). For a query ``q`` the page's
score ``Σ_c max(q_c·M_c, q_c·m_c)`` is an upper bound of ``q·k`` for every key of the page; the top
pages are attended whole. What Quest's code does (``evaluation/quest_attention.py``, and ClusterKV's
reimplementation ``accuracy/quest_attention.py``), and kvbench's defaults:

* **no sinks** (``sink: 0``): pages cover every token from position 0, generated ones included;
* **``max(min_pages, B // page_size)`` pages** with ``min_pages`` 3, where ``B`` is the selected
  budget (``budget.select``; Quest has no local window, ``local_fraction: 0``);
* **partial pages inside the budget**: pages are aligned at the first non-sink slot, so the only
  partial page is the newest one; it is always attended and counts as one of the pages. (Quest ranks
  it with the others; kvbench always keeps it so that every head attends the same number of slots);
* layers 0-1 dense; per-query-head selection (each query head ranks its KV head's pages with its own
  query); ``gqa: shared`` ranks pages once per KV head by the group's summed bounds instead.

So at most ``pages × page_size`` tokens of the budget are attended, plus the current token (which
Quest counts inside its newest page). A budget whose tokens cover every candidate attends them all
(kvbench's covering rule: such a run is token-identical to ``full``).

The 16 sink tokens ClusterKV retains are ClusterKV's own setting, not Quest's; ``method.sink=16``
(or ``budget.sink=16`` for every method) reproduces that alignment, with pages starting after the
sinks (at position 16, so still aligned to multiples of 16).
"""

from __future__ import annotations

import torch

from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.base import Selection
from kvbench.methods.params import QuestParams
from kvbench.methods.retrieval import RetrievalMethod
from kvbench.methods.selection import compose, topk_sorted


def page_bounds(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise ``(min, max)`` of consecutive pages: ``keys`` ``[h, pages * page_size, d]`` → ``[h, pages, d]``."""
    h, n, d = keys.shape
    pages = keys.reshape(h, n // page_size, page_size, d)
    return pages.amin(dim=2), pages.amax(dim=2)


def upper_bound_scores(query: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """``Σ_c max(q_c·high_c, q_c·low_c)``: ``query`` ``[h, g, d]``, bounds ``[h, p, d]`` → ``[h, g, p]``."""
    q = query[:, :, None, :]
    return torch.maximum(q * high[:, None], q * low[:, None]).sum(dim=-1)


@register
class Quest(RetrievalMethod):
    name = "quest"
    Params = QuestParams
    params: QuestParams

    def start(self, ctx) -> None:
        super().start(ctx)
        self._bounds: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}  # layer -> (first slot, low, high)

    def _page_bounds(
        self, layer: int, kv: LayerKV, start: int, pages: int, page: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bounds of the ``pages`` full pages from slot ``start``, kept per layer and extended as pages
        fill: device metadata, on the compute device (Quest keeps its page bounds in GPU memory), built
        from the held keys wherever they live."""
        cached = self._bounds.get(layer)
        low, high = (cached[1], cached[2]) if cached is not None and cached[0] == start else (None, None)
        done = 0 if low is None else low.shape[1]
        if pages > done:
            keys = kv.keys[:, start + done * page : start + pages * page].to(kv.device)
            new_low, new_high = page_bounds(keys.float(), page)
            low = new_low if low is None else torch.cat([low, new_low], dim=1)
            high = new_high if high is None else torch.cat([high, new_high], dim=1)
            self._bounds[layer] = (start, low, high)
        assert low is not None and high is not None  # pages > 0: built above or kept from before
        return low[:, :pages], high[:, :pages]

    def snapshot(self) -> dict[int, tuple[int, torch.Tensor, torch.Tensor]]:
        """The page bounds built so far (decode extends them as pages fill; the tensors are never
        modified in place, so a shallow copy keeps them)."""
        return dict(self._bounds)

    def restore(self, state: dict[int, tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        self._bounds = dict(state)

    def select(self, layer: int, query: torch.Tensor, kv: LayerKV) -> Selection:
        p = self.params
        page, spec, select = p.page_size, self.ctx.spec, self.ctx.budget.select
        lay = self.layout(kv)
        per_head = p.gqa == "per_query_head" and spec.group > 1
        rows = spec.n_heads if per_head else spec.n_kv_heads
        start, end = lay.sink_end, lay.middle_end  # pages over the middle, aligned at its first slot
        full = (end - start) // page
        tail = torch.arange(start + full * page, end, device=kv.home)  # the newest, partial page
        budget_pages = max(p.min_pages, select // page) if select > 0 else 0
        if end - start <= max(select, budget_pages * page):  # the budget covers every candidate
            return compose(lay, lay.candidates(kv.home).expand(rows, -1), ascending=True)
        if budget_pages == 0:
            return Selection(slots=lay.fixed(kv.home).expand(rows, -1))
        take = min(budget_pages - (1 if tail.numel() else 0), full)
        if take <= 0:
            return compose(lay, tail.expand(rows, -1), ascending=True)
        low, high = self._page_bounds(layer, kv, start, full, page)
        q = query[0, :, 0, :].to(low.device).float().view(spec.n_kv_heads, spec.group, -1)
        scores = upper_bound_scores(q, low, high)  # [kv_heads, group, pages], on the compute device
        scores = scores.reshape(rows, full) if per_head else scores.sum(dim=1)
        chosen = topk_sorted(scores, take).to(kv.home)  # page indices from ``start``, for the store
        pages = (start + chosen[:, :, None] * page + torch.arange(page, device=kv.home)).reshape(rows, -1)
        # pages in ascending order (topk_sorted), then the newest page after them: ascending rows
        return compose(lay, torch.cat([pages, tail.expand(rows, -1)], dim=1), ascending=True)
