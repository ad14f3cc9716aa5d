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

**The static decode step** (:mod:`kvbench.engine.decode`): the same pages, slots and order as the
earlier host-driven select (``tests/legacy_quest.py``), with shapes fixed by the layer's bucket.

* **bounds in place** — every selecting layer keeps its page bounds in one preallocated fp32 buffer
  ``[kv_heads, pages, 2, d]`` (``[..., 0, :]`` the minimum, ``[..., 1, :]`` the maximum; ``+inf``/``-inf``
  where no key has been folded in) with room for every page of the layer's capacity.
  :meth:`Quest.before_step` builds them on the host (``amin``/``amax`` of the held keys) only when they do
  not hold every slot before the current one: the first selective step, a rollback to before it, a grown
  buffer; a steady step builds nothing. Inside the step ``select`` folds the *current* token's key into
  its page with two ``scatter_reduce_`` (``amin``/``amax``) at the device index ``kv.current`` (one op
  fewer than the slot that has just become a middle slot, and the same bounds: the current token's page
  is past the middle's full pages, so no score reads it before the page is full and every key of it has
  been folded in). Minimum and maximum are exact, so every full page's bounds are bit for bit the
  earlier ``amin``/``amax`` of its keys.
* **scores** — every page of the bucket is scored with the earlier expression (the two products, their
  maximum and the sum over ``d``, as one product with the pair axis: bit-identical per page,
  ``tests/test_static_quest.py``). ``method.scoring=gemv`` computes the same per-coordinate terms as
  ``q⁺·high + q⁻·low`` (``max(q·M, q·m)`` is ``q·M`` for ``q ≥ 0`` and ``q·m`` for ``q < 0``, exactly),
  two batched matrix products that read each bound once and write only the ``[rows, pages]`` scores,
  where the default materialises a ``[heads, pages, 2, d]`` float32 product (at 32k tokens of the 7B MHA
  shape about 2 GB a step written and read again); it sums over ``d`` in another order, so its scores
  are equal to the default's up to rounding, not bit for bit, and it is not the default. The newest page
  gets ``+inf`` while it holds middle slots (it is always attended), the pages past the middle's end
  ``-inf``; when the middle is a whole number of pages there is no partial page and every budget page is
  a full one, as before.
* **the pick** — ``max(min_pages, B // page_size)`` pages by :func:`_top_ascending`: ``topk_sorted``'s
  rule (ties to the lower page, NaN as ``-inf``) by a stable sort, 3 ops instead of
  :func:`~kvbench.methods.selection.topk_keyed`'s 12 for the same pages. Pages become slots through a
  constant ``[pages, page_size]`` table; the partial page's slots from the middle's end on are padding
  (``Selection.valid`` false), pointed at the current token, which the selection attends anyway and the
  host tier never fetches, so bytes and hits are counted as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from kvbench.engine.protocol import Selection
from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.params import HeadGranularity, RetrievalParams
from kvbench.methods.retrieval import RetrievalMethod
from kvbench.params import param

if TYPE_CHECKING:
    from kvbench.engine.context import GenerationContext


def page_bounds(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise ``(min, max)`` of consecutive pages: ``keys`` ``[h, pages * page_size, d]`` → ``[h, pages, d]``."""
    h, n, d = keys.shape
    pages = keys.reshape(h, n // page_size, page_size, d)
    return pages.amin(dim=2), pages.amax(dim=2)


def upper_bound_scores(query: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """``Σ_c max(q_c·high_c, q_c·low_c)``: ``query`` ``[h, g, d]``, bounds ``[h, p, d]`` → ``[h, g, p]``."""
    q = query[:, :, None, :]
    return torch.maximum(q * high[:, None], q * low[:, None]).sum(dim=-1)


def page_scores(query: torch.Tensor, bounds: torch.Tensor, scoring: str = "products") -> torch.Tensor:
    """Every page's upper bound ``Σ_d max(q_d·M_d, q_d·m_d)``: ``query`` ``[h, g, d]`` (float32), ``bounds``
    ``[h, pages, 2, d]`` (minimum, maximum) → ``[h, g, pages]``. ``products``: the products, their maximum
    and the sum (the earlier expression, bit for bit); ``gemv``: ``q⁺·M + q⁻·m`` as two batched matrix
    products, the same terms summed in another order (a page with ±inf bounds scores NaN or ±inf: the
    caller masks the pages without keys)."""
    h, pages, _, d = bounds.shape
    if scoring == "gemv":
        high, low = bounds[:, :, 1].transpose(1, 2), bounds[:, :, 0].transpose(1, 2)  # [h, d, pages] views
        return torch.baddbmm(torch.bmm(query.clamp_min(0), high), query.clamp_max(0), low)
    products = query.view(h, query.shape[1], 1, 1, d) * bounds.view(h, 1, pages, 2, d)  # [h, g, pages, 2, d]
    return products.amax(dim=3).sum(dim=-1)


@dataclass(frozen=True)
class PageTables:
    """Constants of a layer geometry's page grid: ``pages`` pages of ``page_size`` slots from slot ``sink``."""

    limits: torch.Tensor  # [2, pages]: one past each page's last slot, and its first slot + 1 (vs the middle's end)
    slots: torch.Tensor  # [pages, page_size] the slots of every page
    page_of: torch.Tensor  # [sink + pages * page_size] the page of every slot (0 for the sinks)
    attended: torch.Tensor  # [1, sink + local + 1] true: the validity of the sinks and the local window


def page_tables(sink: int, local: int, page_size: int, pages: int, device: torch.device) -> PageTables:
    first = sink + torch.arange(pages, device=device) * page_size
    slots = torch.arange(sink + pages * page_size, device=device)
    return PageTables(
        limits=torch.stack([first + page_size, first + 1]),
        slots=first[:, None] + torch.arange(page_size, device=device),
        page_of=((slots - sink).clamp_min(0) // page_size),
        attended=torch.ones(1, sink + local + 1, dtype=torch.bool, device=device),
    )


@dataclass(frozen=True)
class QuestParams(RetrievalParams):
    sink: int = param(0, "Quest keeps no sinks; 16 is ClusterKV's own setting (method.sink=16 to align with it)", min=0)
    local_fraction: float = param(0.0, "no window inside the budget: pages compete for all of it", min=0, max=1)
    dense_layers: tuple[int, ...] = param((0, 1), "layers that attend every token (Quest/ClusterKV: 0-1)", min=0)
    cache_blocks: int | None = param(32, "blocks admitted per step, the most selected (null: the whole cache)", min=0)
    page_size: int = param(16, "tokens per page", min=1)
    min_pages: int = param(3, "pages attended at least: max(min_pages, budget // page_size) (Quest's code: 3)", min=1)
    gqa: HeadGranularity = param("per_query_head", "each query head ranks pages | shared: one ranking per KV head")
    scoring: Literal["products", "gemv"] = param(
        "products",
        "page scores: products (sum over d of max(q*max, q*min), bit for bit as kvbench always scored) | gemv "
        "(q+ . max + q- . min as two matrix products: the same terms summed in another order, no "
        "[heads, pages, 2, d] temporary)",
        legacy="products",
    )


@register
class Quest(RetrievalMethod):
    name = "quest"
    Params = QuestParams
    params: QuestParams

    static_decode = True

    def start(self, ctx: GenerationContext) -> None:
        super().start(ctx)
        self._bounds: dict[int, torch.Tensor] = {}  # layer -> [kv_heads, pages, 2, d]: (min, max) of each page
        self._built = -1  # the bounds hold the keys of slots [sink, built) of every selecting layer
        self._pages = 0  # ... in room for this many pages
        self._tables: PageTables | None = None

    # ------------------------------------------------------------------ the regime
    def budget_pages(self) -> int:
        """``max(min_pages, select // page_size)`` pages (none for a budget without selected tokens)."""
        select = self.ctx.budget.select
        return max(self.params.min_pages, select // self.params.page_size) if select > 0 else 0

    def attend_limit(self, ctx: GenerationContext, layer: int) -> int:
        """Whole pages: the sinks, the window, ``budget_pages()`` pages and the current token."""
        return ctx.budget.sink + ctx.budget.local + self.budget_pages() * self.params.page_size + 1

    def covers(self, kv: LayerKV) -> bool:
        """Whether the budget's tokens or pages cover every middle token (the dense step)."""
        return self.layout(kv).middle <= max(self.ctx.budget.select, self.budget_pages() * self.params.page_size)

    # ------------------------------------------------------------------ host side: the bounds
    def before_step(self, ctx: GenerationContext) -> None:
        """Make the page bounds of every selecting layer hold the keys of every slot before the current one
        (the step folds the current one in), building them on the host only when they do not (the first
        selective step, a rollback, a grown buffer): a steady step only counts."""
        kv = self.compressing_kv()
        if self.budget_pages() == 0 or self.covers(kv):
            return
        sink = ctx.budget.sink
        pages = -(-(kv.capacity - sink) // self.params.page_size)
        if self._built != kv.n - 1 or self._pages < pages:
            dense = set(self.dense_layers)
            for layer, held in enumerate(ctx.store.layers):
                if layer not in dense:
                    self._bounds[layer] = self._build(held, sink, kv.n - 1, pages)
            self._pages = pages
        if self._tables is None or self._tables.slots.shape[0] < self._pages:
            self._tables = page_tables(sink, ctx.budget.local, self.params.page_size, self._pages, kv.device)
        self._built = kv.n

    def _build(self, kv: LayerKV, sink: int, end: int, pages: int) -> torch.Tensor:
        """``[kv_heads, pages, 2, d]`` bounds of the held keys of slots ``[sink, end)`` (the full pages and
        the partial one), ``+inf``/``-inf`` in the pages no key reached."""
        page = self.params.page_size
        bounds = torch.empty(kv.n_kv_heads, pages, 2, kv.head_dim, dtype=torch.float32, device=kv.device)
        bounds[:, :, 0].fill_(float("inf"))
        bounds[:, :, 1].fill_(float("-inf"))
        full = (end - sink) // page
        if full > 0:
            low, high = page_bounds(kv.keys[:, sink : sink + full * page].to(kv.device).float(), page)
            bounds[:, :full, 0], bounds[:, :full, 1] = low, high
        if sink + full * page < end:
            keys = kv.keys[:, sink + full * page : end].to(kv.device).float()
            bounds[:, full, 0], bounds[:, full, 1] = keys.amin(dim=1), keys.amax(dim=1)
        return bounds

    def snapshot(self) -> tuple[dict[int, torch.Tensor], int, int]:
        """The page bounds (copies: decode updates them in place), the slots they hold and their room."""
        return {layer: b.clone() for layer, b in self._bounds.items()}, self._built, self._pages

    def restore(self, state: tuple[dict[int, torch.Tensor], int, int]) -> None:
        bounds, self._built, self._pages = state
        self._bounds = {layer: b.clone() for layer, b in bounds.items()}

    # ------------------------------------------------------------------ the device step
    def select(self, layer: int, query: torch.Tensor, kv: LayerKV) -> Selection | None:
        """The budget's pages by their upper bounds, the newest (partial) page always among them (static
        step: every page of the bucket scored, the ones past the middle masked; module docstring)."""
        if self.covers(kv):
            return None
        spec, budget = self.ctx.spec, self.ctx.budget
        rows = spec.n_heads if self.params.gqa == "per_query_head" and spec.group > 1 else spec.n_kv_heads
        assert kv.current is not None  # (bound by the decoder)
        end = kv.current if budget.local == 0 else kv.current - budget.local  # [1]: the middle is [sink, end)
        taken = self.budget_pages()
        if taken == 0:  # sinks, the local window and the current token only
            return self.static_layout(kv).compose(kv.iota(0).expand(rows, 0), end)
        tables = self._tables
        assert tables is not None  # (made by before_step)
        bounds = self._fold(kv, self._bounds[layer], tables)
        pages = -(-(kv.bucket_end - budget.sink) // self.params.page_size)  # the pages of the bucket
        scores = self._scores(query, bounds[:, :pages], rows)
        past = tables.limits[:, :pages] > end  # [2, pages]: not full; past the middle's end
        scores = scores.masked_fill(past[0], float("inf")).masked_fill(past[1], float("-inf"))
        chosen = _top_ascending(scores, taken)
        return self._compose(kv, tables, tables.slots.index_select(0, chosen.view(-1)).view(rows, -1), end)

    def _compose(self, kv: LayerKV, tables: PageTables, slots: torch.Tensor, end: torch.Tensor) -> Selection:
        """Sinks, the chosen pages' ``slots`` (``[rows, k]``, ascending) and the local window with the current
        token; the pages' slots from the middle's ``end`` on are padding (invalid, on the current token)."""
        sink, local = self.ctx.budget.sink, self.ctx.budget.local
        current = kv.current
        assert current is not None
        rows = slots.shape[0]
        valid = slots < end
        window = current.expand(rows, 1) if local == 0 else (end + kv.iota(local + 1)).expand(rows, -1)
        parts = [kv.iota(sink).expand(rows, -1)] if sink else []
        parts += [torch.minimum(slots, current), window]
        fixed = tables.attended.expand(rows, -1)
        valid = torch.cat([fixed[:, :sink], valid, fixed[:, sink:]], dim=1)
        return Selection(slots=torch.cat(parts, dim=1), selected=parts[-2], valid=valid)

    def _fold(self, kv: LayerKV, bounds: torch.Tensor, tables: PageTables) -> torch.Tensor:
        """Fold the current token's key into its page's bounds, in place (its page is past the middle's
        full pages, so no score reads it before the page is full and every key of it folded)."""
        current = kv.current
        assert current is not None
        keys, _ = kv.bucket()
        key = keys.index_select(1, current if kv.home == kv.device else current.to(kv.home))  # [kv_heads, 1, d]
        key = key if key.device == bounds.device else key.to(bounds.device)
        key = key if key.dtype == torch.float32 else key.float()
        index = tables.page_of.index_select(0, current).view(1, 1, 1).expand(key.shape)
        bounds[:, :, 0].scatter_reduce_(1, index, key, "amin")
        bounds[:, :, 1].scatter_reduce_(1, index, key, "amax")
        return bounds

    def _scores(self, query: torch.Tensor, bounds: torch.Tensor, rows: int) -> torch.Tensor:
        """:func:`page_scores` (``method.scoring``) of every page of ``bounds`` (``[kv_heads, pages, 2, d]``) per
        selection row; ``products`` is :func:`upper_bound_scores` bit for bit per page, without its copies."""
        spec = self.ctx.spec
        h, pages, _, d = bounds.shape
        q = query[0, :, 0, :]
        q = q if q.device == bounds.device else q.to(bounds.device)
        q = q if q.dtype == torch.float32 else q.float()
        scores = page_scores(q.view(h, spec.group, d), bounds, self.params.scoring)  # [h, group, pages]
        return scores.view(rows, pages) if rows == spec.n_heads else scores.sum(dim=1)


def _top_ascending(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest ``scores`` per row, ascending: ``topk_sorted``'s pick (NaN counts as ``-inf``, equal
    values go to the lower index), by a stable descending sort and a sort of the ``k`` indices: 3 ops where
    :func:`~kvbench.methods.selection.topk_keyed` issues 12, for the same indices. A CUDA sort orders float
    keys by their bits (``-0.0`` before ``+0.0``), so there ``-0.0`` is made ``+0.0`` first; a CPU sort
    compares them as equal."""
    ordered = torch.nan_to_num(scores, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    if ordered.device.type != "cpu":
        ordered = ordered + 0.0
    top = torch.sort(ordered, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.sort(top, dim=-1).values
