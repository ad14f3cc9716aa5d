"""Quest's decode-time selection as it was before the static decode step, kept as an independent reference.

:class:`LegacyQuest` is the pre-conversion decode code of :class:`~kvbench.methods.quest.Quest`, verbatim:
a host-side layout read from ``kv.n`` at every step, page bounds kept per layer and extended with
``torch.cat`` as pages fill (``_page_bounds``, with its shallow ``snapshot``/``restore``), ``topk_sorted``
over the full pages' upper bounds and the newest, partial page appended (with the bound and score
functions, also verbatim). It runs on the dynamic per-layer step (``static_decode = False``);
``tests/test_static_quest.py`` checks that the static method attends exactly the same positions, generates
the same tokens and counts the same bytes.
"""

from __future__ import annotations

import torch

from kvbench.engine.protocol import Selection
from kvbench.kv.store import LayerKV
from kvbench.methods.quest import Quest, page_bounds, upper_bound_scores  # (unchanged helpers)
from kvbench.methods.selection import compose, topk_sorted


class LegacyQuest(Quest):
    name = "_legacy_quest"
    static_decode = False

    def start(self, ctx) -> None:
        super().start(ctx)
        self._bounds: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}  # layer -> (first slot, low, high)

    def before_step(self, ctx) -> None:
        """(The static method's page bookkeeping does not run for the reference.)"""

    def decode_key(self) -> tuple[bool, ...]:
        return ()

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
