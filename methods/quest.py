"""``quest``: query-aware page selection by key min/max bounds (Tang et al., 2024), as ClusterKV runs it.

Keys are grouped into pages of ``page_size`` (16) consecutive positions. Each page keeps the
element-wise minimum ``m`` and maximum ``M`` of its keys (per KV head). For a query ``q`` the page's
score ``Σ_c max(q_c·M_c, q_c·m_c)`` is an upper bound of ``q·k`` for every key of the page; the top
pages are attended whole. Defaults follow ClusterKV's alignment (seed-clusterkv.md §2, §5.2 #12):
layers 0-1 dense, 16 sink tokens, per-query-head selection (each query head ranks its KV head's pages
with its own query), and ``floor(select / page_size)`` pages — page-granular, so up to
``page_size - 1`` tokens of the budget stay unused. Pages are aligned to absolute positions; the
partial pages at either end of the middle (a sink not aligned to pages, the newest tokens) are always
attended, as Quest always attends the current page. ``gqa: shared`` ranks pages once per KV head by
the group's summed bounds instead.
"""

from __future__ import annotations

import torch

from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.base import Selection
from kvbench.methods.params import QuestParams
from kvbench.methods.retrieval import RetrievalMethod
from kvbench.methods.selection import topk_sorted


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
        self._bounds: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}  # layer -> (first page, low, high)

    def _page_bounds(self, layer: int, kv: LayerKV, first: int, last: int, page: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bounds of pages ``[first, last)``, kept per layer and extended as pages fill (device metadata)."""
        start, low, high = self._bounds.get(layer, (first, None, None))
        done = start + (0 if low is None else low.shape[1])
        if low is None or start != first:
            start, done, low, high = first, first, None, None
        if last > done:
            new_low, new_high = page_bounds(kv.keys[:, done * page : last * page].float(), page)
            low = new_low if low is None else torch.cat([low, new_low], dim=1)
            high = new_high if high is None else torch.cat([high, new_high], dim=1)
            self._bounds[layer] = (start, low, high)
        return low[:, : last - first], high[:, : last - first]

    def snapshot(self) -> dict[int, tuple[int, torch.Tensor, torch.Tensor]]:
        """The page bounds built so far (decode extends them as pages fill; the tensors are never
        modified in place, so a shallow copy keeps them)."""
        return dict(self._bounds)

    def restore(self, state: dict[int, tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        self._bounds = dict(state)

    def select(self, layer: int, query: torch.Tensor, kv: LayerKV) -> Selection:
        page = self.params.page_size
        spec = self.ctx.spec
        lay = self.layout(kv)
        first = -(-lay.sink_end // page)  # first page fully inside the middle
        last = lay.middle_end // page  # pages [first, last) are full and inside the middle
        per_head = self.params.gqa == "per_query_head" and spec.group > 1
        rows = spec.n_heads if per_head else spec.n_kv_heads
        fixed_ranges = [(0, first * page), (max(last, first) * page, kv.n)]
        fixed = torch.cat([torch.arange(a, b, device=kv.home) for a, b in fixed_ranges])
        n_pages = max(last - first, 0)
        take = min(self.ctx.budget.select // page, n_pages)
        if take == 0:
            return Selection(slots=fixed.expand(rows, -1))
        low, high = self._page_bounds(layer, kv, first, last, page)
        q = query[0, :, 0, :].to(kv.home).float().view(spec.n_kv_heads, spec.group, -1)
        scores = upper_bound_scores(q, low, high)  # [kv_heads, group, pages]
        scores = scores.reshape(rows, n_pages) if per_head else scores.sum(dim=1)
        chosen = topk_sorted(scores, take) + first  # page ids
        selected = (chosen[:, :, None] * page + torch.arange(page, device=kv.home)).reshape(rows, -1)
        slots, _ = torch.sort(torch.cat([fixed.expand(rows, -1), selected], dim=1), dim=1)
        candidates = torch.arange(first * page, last * page, device=kv.home)
        return Selection(slots=slots, selected=selected, candidates=candidates)
