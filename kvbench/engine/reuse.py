"""The reuse prefill: a layer-by-layer plan that installs cached K/V and recomputes a chosen set of rows.

A reuse method (CacheBlend, full KV reuse, prefix caching: ``methods/reuse.py`` and its subclasses)
keeps only its policy — which rows to recompute, at which layers cached rows are installed, what to do
after a layer (:class:`ReusePolicy`); the mechanism is here, in the engine, as the prefill plans of
every method are (:mod:`kvbench.engine.prefill`). Inside the request's clock, :class:`ReusePrefill`
runs the per-layer plan:

* before the first layer, on the host: which rows are cached, which are computed, their slots and the
  attention layout of the computed rows (kernel, key counts, masks), planned once for each set of
  active rows (:class:`ActiveRows`) — the layers then issue no host read but the one each shrink
  decided on the device costs (see :class:`ReusePrefill`);
* before layer ``i``: read layer ``i`` of every cached segment from its tier, re-rotate its keys from
  the positions it was computed at to its positions in this prompt (the model's own RoPE), and write
  the rows into the store at their slots — unless every row of the layer is recomputed anyway;
* the layer runs on the *active* rows; their fresh K/V overwrite the cached rows; attention of the
  active queries over every row of the layer with an exact causal mask on positions (a policy's
  ``bottom_right_mask`` reproduces CacheBlend's released bottom-right-aligned mask);
* the policy may measure deviations and shrink the active set (CacheBlend's check layers).

**Misses computed in the request** (a policy whose ``fills_store`` is true: CacheBlend's ``miss:
prefill``, the paper's §6 and LMCache's way). A span whose cache the store does not hold is not
precomputed: the plan drops it from the cached spans (:attr:`ReusePrefill.missed`), so its rows are
uncached rows, computed at every layer like the query's (the policy must keep them active; the plan
checks it), after the chunks before them and at their positions in this prompt. After the request,
:meth:`ReusePrefill.fill_store` writes each missed span's rows of this request's K/V to the store
(:func:`store_request_rows`: keys post-RoPE at their positions here, ``start`` = the span's first
position, so a later request re-rotates them by its own offset like any entry) under the span's key.
Cache-Craft stores the chunks it computed in full the same way (its variants).

**Pipelined loading** (CacheBlend §5, Fig. 10; ``store.pipeline``, default true). Installing layer
``i``'s cached rows needs that layer's K/V from the chunk store's tier. With the pipeline on, a
:class:`LayerLoader` reads them on one worker thread — disk → host memory (``os.preadv``, GIL
released; a throttled read sleeps; a RAM-tier chunk is in host memory already, pinned on a GPU
machine), then on a GPU host → device, asynchronously on a side CUDA stream — for layer
``i + 1`` while the main thread installs and computes layer ``i``; the main thread waits only for
what is not loaded yet when it needs it. With it off, every layer is read on the main thread just
before it runs. Telemetry (``telemetry.prefill``): ``load_s`` (time spent reading and copying, on
whichever thread), ``load_wait_s`` (main-thread time blocked on loads), ``load_hidden_s`` =
``load_s - load_wait_s`` (load time that overlapped compute), ``recompute_s`` (the layers' own time:
Q/K/V, attention, MLP of the active rows, selection included), ``rerotate_s`` and ``write_s`` (installing
cached rows), ``load_per_layer_s`` / ``recompute_per_layer_s``, and ``attention_layouts`` (attention
layouts, masks included, made for the request: one per set of active rows that attends a subset).
On a CPU the loader competes with compute for the same cores (a cold read costs little CPU; decoding
safetensors none), which is measured, not assumed away: ``kvbench bench reuse_pipeline`` runs both
settings side by side.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from kvbench.engine import attention, reuse_deviation
from kvbench.engine.prefill import PrefillPlan
from kvbench.engine.rope import apply_rotation, rotation
from kvbench.kv.chunks import ChunkKey, ChunkKV, ChunkReader, ChunkStore
from kvbench.requests import Segment, segment_spans

if TYPE_CHECKING:
    from kvbench.engine.context import GenerationContext


@dataclass
class CachedSpan:
    """A span of the prompt ``[begin, end)`` whose K/V come from a stored cache."""

    begin: int
    end: int
    key: ChunkKey
    reader: ChunkReader | None = None
    rows: slice = field(default_factory=lambda: slice(None))  # rows of the stored entry that fill the span

    @property
    def delta(self) -> int:
        assert self.reader is not None
        start = self.reader.start + (self.rows.start or 0)
        return self.begin - start


class ReusePolicy(Protocol):
    """What :class:`ReusePrefill` asks of a reuse method (``methods/reuse.py::ReuseMethod`` implements it).

    Three hooks are optional and looked up by name, for a policy that measures attention; a policy
    without them costs nothing:

    * ``observe_attention(plan, layer, query, scaling)``, called at every layer once the active rows'
      fresh K/V are written (the layer's K is then complete), with the active rows' post-RoPE queries
      ``[heads, t, d]`` — to recompute what it needs (:func:`kvbench.engine.attention_stats.segment_mass`);
    * ``attention_segments(plan, layer)`` returning an :class:`~kvbench.engine.attention.SegmentColumns`
      (or None), and ``observe_segment_mass(plan, layer, mass)``: the layer's attention itself also
      computes every active row's attention mass per segment of keys, handed over as ``mass``
      ``[active rows, heads, segments]`` (model dtype; zeros for rows that do not attend at that layer).
    """

    #: ``profile.deviation``: the full prefill's K, V and query rows' Q, for the deviation figures
    reference: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None

    @property
    def bottom_right_mask(self) -> bool:
        """CacheBlend's released bottom-right-aligned mask for the recomputed rows (``mask: code``)."""
        ...

    @property
    def cut_at_attention(self) -> bool:
        """Whether a layer that shrinks the active rows runs attention, output projection and MLP for
        the rows that continue only (CacheBlend's ``check_rows: selected``), rather than for every row."""
        ...

    @property
    def fills_store(self) -> bool:
        """Whether a span the store lacks is computed in this prefill and stored after the request
        (CacheBlend's ``miss: prefill``) rather than precomputed before it (false: a missing entry is an
        error here). Looked up with a default of false."""
        ...

    def chunk_store(self) -> ChunkStore: ...

    def cached_segments(self, ctx: GenerationContext, segments: tuple[Segment, ...]) -> list[CachedSpan]: ...

    def initial_rows(self, plan: ReusePrefill) -> np.ndarray | list[int] | torch.Tensor: ...

    def cache_layers(self, plan: ReusePrefill) -> Iterable[int]: ...

    def needs_cache_at(self, plan: ReusePrefill, layer: int) -> bool: ...

    def on_layer(
        self, plan: ReusePrefill, layer: int, fresh_v: torch.Tensor
    ) -> torch.Tensor | np.ndarray | list[int] | None: ...


class LayerLoader:
    """Reads one layer of every cached span at a time, on a worker thread when ``pipelined``.

    :meth:`prefetch` starts loading a layer (on the worker; without the pipeline it does nothing),
    :meth:`take` returns a layer's (K, V) per span — waiting for a prefetch in flight, or reading it
    right there — and :meth:`discard` drops a layer that turned out not to be needed. On CUDA the
    worker reads into pinned memory (a disk read; a RAM-tier entry is held pinned) and copies to the
    device asynchronously on its own stream; :meth:`take` makes the compute stream wait for that copy
    (an event), so the copy overlaps the previous layer's kernels. On a CPU both tiers hand over host
    tensors and nothing is copied.
    ``load_s`` sums the time spent loading (worker or main thread), ``wait_s`` the main thread's time
    blocked in :meth:`take`; ``per_layer_s`` is the load time of each layer.
    """

    def __init__(self, spans: list[CachedSpan], device: torch.device, n_layers: int, *, pipelined: bool) -> None:
        self.spans = spans
        self.device = device
        self.pipelined = pipelined and bool(spans)
        self.cuda = device.type == "cuda"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-loader") if self.pipelined else None
        self._stream = torch.cuda.Stream(device) if (self.pipelined and self.cuda) else None
        self._pending: dict[int, Future] = {}
        self.load_s = 0.0
        self.wait_s = 0.0
        self.per_layer_s = [0.0] * n_layers

    def _load(self, layer: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], Any]:
        started = time.perf_counter()
        rows, event = [], None
        for span in self.spans:
            assert span.reader is not None
            k, v = span.reader.layer(layer, pin=self.cuda)
            rows.append((k, v))
        if self.cuda:
            with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
                rows = [(k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True)) for k, v in rows]
                if self._stream is not None:
                    event = torch.cuda.Event()
                    event.record(self._stream)
        spent = time.perf_counter() - started
        self.per_layer_s[layer] += spent
        self.load_s += spent
        return rows, event

    def prefetch(self, layer: int) -> None:
        if self._pool is not None and layer not in self._pending:
            self._pending[layer] = self._pool.submit(self._load, layer)

    def take(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        started = time.perf_counter()
        future = self._pending.pop(layer, None)
        rows, event = future.result() if future is not None else self._load(layer)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
            for k, v in rows:  # the side stream's memory is in use on the compute stream now
                k.record_stream(torch.cuda.current_stream(self.device))
                v.record_stream(torch.cuda.current_stream(self.device))
        self.wait_s += time.perf_counter() - started
        return rows

    def discard(self, layer: int) -> None:
        future = self._pending.pop(layer, None)
        if future is not None:
            future.result()

    def close(self) -> None:
        """Finish or drop loads in flight and stop the worker (idempotent)."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def query_rows(segments: tuple[Segment, ...]) -> torch.Tensor:
    return torch.cat(
        [torch.arange(b, e) for seg, (b, e) in zip(segments, segment_spans(segments)) if seg.role == "query"]
        or [torch.zeros(0, dtype=torch.long)]
    )


def store_request_rows(
    ctx: GenerationContext, store: ChunkStore, key: ChunkKey, begin: int, end: int
) -> ChunkKV | None:
    """Put rows ``[begin, end)`` of this request's K/V into ``store`` under ``key`` and return the entry, or
    None when the store did not keep it (larger than its tier).

    The rows are every layer's K/V as this request's prefill left them in its KV store (call it after
    the prefill, e.g. from ``after_request``): keys post-RoPE at their positions in this prompt, so the
    entry's ``start`` is ``begin`` and a later request re-rotates them by its own offset. The rows must
    have been computed at every layer in this request (an uncached span; CacheBlend's missed chunks,
    Cache-Craft's new variants); they carry the context they were computed in."""
    layers = ctx.store.layers
    entry = ChunkKV(
        [kv.keys[:, begin:end].clone() for kv in layers],
        [kv.values[:, begin:end].clone() for kv in layers],
        begin,
    )
    store.put(key, entry)
    return entry if store.contains(key) is not None else None


class ActiveRows:
    """One set of a reuse prefill's active rows (from the start, or from a shrink to the next one),
    planned once on the host and used by every layer it lasts.

    ``positions`` are the rows' prompt positions (host ints, an int64 numpy array in the engine's row
    order); ``host`` the same as a CPU tensor — the slots and positions
    :meth:`~kvbench.kv.store.LayerKV.write` reads on the host, pinned on CUDA so that its copies to the
    device are asynchronous; ``device`` the same on the compute device (on a CPU, ``host`` itself).
    What the layers index with (the rows' order, the query rows among them, the cached rows among
    them) and the attention layouts of these rows (:func:`~kvbench.engine.attention.past_layout`, their
    masks included) are made at their first use and kept until the set changes.
    """

    def __init__(self, plan: ReusePrefill, positions: np.ndarray) -> None:
        self.plan = plan
        self.positions = positions
        self.count = len(positions)
        # every slot 0..n-1 is written at each layer these rows compute (the cached rows installed, these
        # rows fresh) and a slot holds its own position: the attention then plans its keys as positions
        # 0..n-1 without reading them (the rows are distinct, so counting the uncached ones suffices)
        self.in_order = int((~plan.cached_flags[positions]).sum()) == len(plan.uncached)
        self.host = plan._host_ints(positions)
        self.device = plan._on_device(self.host)
        self.layouts: dict[str, attention.PastLayout] = {}
        self.keep: np.ndarray | None = None  # indices into the previous set that gave this one
        self._order: torch.Tensor | None = None
        self._queries: torch.Tensor | None = None
        self._covered: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def order(self) -> torch.Tensor:
        """``arange(count)`` on the device (every active row, in order)."""
        if self._order is None:
            self._order = self.plan._on_device(self.plan._host_ints(np.arange(self.count)))
        return self._order

    @property
    def queries(self) -> torch.Tensor:
        """Indices of the query-segment rows among these rows (device)."""
        if self._queries is None:
            self._queries = self.plan.device_index(np.flatnonzero(self.plan.query_flags[self.positions]))
        return self._queries

    @property
    def covered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices among these rows, prompt positions) of the rows a cache covers (device)."""
        if self._covered is None:
            index = np.flatnonzero(self.plan.cached_flags[self.positions])
            both = self.plan._on_device(self.plan._host_ints(np.stack([index, self.positions[index]])))
            self._covered = (both[0], both[1])
        return self._covered


class ReusePrefill(PrefillPlan):
    """The per-layer plan of a reuse method: install cached rows, recompute the active ones.

    **On the host, once per set of active rows.** Everything the layers index with is planned from the
    request on the host before the first layer (:class:`ActiveRows`): the active rows' slots and
    positions as CPU tensors for :meth:`~kvbench.kv.store.LayerKV.write` (which reads them on the
    host), the same on the device for the engine and the gathers, the cached rows' slots and the
    re-rotation deltas, and the attention layout of the active rows — which kernel, which keys each
    block of rows reads, and its additive mask, made on the device once
    (:func:`~kvbench.engine.attention.past_layout`) and passed to every layer. The set changes only
    where the method shrinks it (CacheBlend's check layers); the new one is planned then. So a layer
    issues no host read: the only one in a prefill is, at each shrink decided on the device
    (CacheBlend's HKVD selection), one read of the chosen rows (``Tensor.tolist``), which the new set's
    slots (host, for the write) and block bounds (for the attention's key counts) are made from.
    """

    def __init__(
        self, ctx: GenerationContext, method: ReusePolicy, input_ids: torch.Tensor, segments: tuple[Segment, ...]
    ) -> None:
        n = int(input_ids.numel())
        self.method = method
        #: CacheBlend's check layer as its released code runs it: only the rows that continue go through
        #: attention, the output projection and the MLP (the policy's ``cut_at_attention``)
        self.cuts_in_layer = bool(getattr(method, "cut_at_attention", False))
        #: the policy's optional ``observe_attention(plan, layer, query, scaling)`` (see :class:`ReusePolicy`)
        self._observe = getattr(method, "observe_attention", None)
        #: the policy's optional ``attention_segments(plan, layer)`` / ``observe_segment_mass(plan, layer, mass)``
        self._segments_of = getattr(method, "attention_segments", None)
        self._observe_mass = getattr(method, "observe_segment_mass", None)
        self.n = n
        self.segments = segments
        self.device = torch.device(ctx.spec.device)
        self._pin = self.device.type == "cuda"
        self.spans = method.cached_segments(ctx, segments)
        store = method.chunk_store()
        self.timing = {
            "load_s": 0.0,
            "load_wait_s": 0.0,
            "rerotate_s": 0.0,
            "write_s": 0.0,
            "select_s": 0.0,
            "recompute_s": 0.0,
        }
        self._open_spans(method, store)
        self._plan_layout(n, segments)
        initial = method.initial_rows(self)
        initial = initial.tolist() if isinstance(initial, torch.Tensor) else initial
        self.rows = ActiveRows(self, np.asarray(initial, dtype=np.int64))
        #: rows computed at every layer so far (host flags; a shrink clears the rows it drops)
        self.throughout = np.zeros(n, dtype=bool)
        self.throughout[self.rows.positions] = True
        self._next: ActiveRows | None = None
        self.layouts_built = 0
        ids = input_ids[self.rows.host.to(input_ids.device)]
        if self._pin and ids.device.type == "cpu":
            ids = ids.pin_memory()
        super().__init__(ctx, self._on_device(ids), self.rows.device)
        self.recomputed: list[int] = []  # rows whose Q/K/V each layer computed
        self.through: list[int] = []  # rows that ran each layer's attention, output projection and MLP
        self.installed_layers = 0
        self._keep: torch.Tensor | None = None
        self._fresh_keys: torch.Tensor | None = None  # the running layer's fresh keys (see fresh_keys)
        self._fresh_layer = -1
        self.deviations: dict[int, torch.Tensor] = {}  # check layer -> KV deviation of its active rows (device)
        # profile.deviation: the full prefill's K, V, Q
        self.reference: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None = method.reference
        self._queries: dict[int, torch.Tensor] = {}  # profile.deviation: the query rows' queries per layer
        n_layers = ctx.spec.n_layers
        self.recompute_per_layer = [0.0] * n_layers
        self._layer_started = 0.0
        self.cache_layers = (
            [layer for layer in method.cache_layers(self) if 0 <= layer < n_layers] if self.spans else []
        )
        self.loader = LayerLoader(self.spans, self.device, n_layers, pipelined=bool(store.config.pipeline))
        if self.cache_layers:
            self.loader.prefetch(self.cache_layers[0])

    def _open_spans(self, method: ReusePolicy, store: ChunkStore) -> None:
        """Open every cached span's reader in ``store``, setting aside the spans it lacks (timed as loading)."""
        started = time.perf_counter()
        fills = bool(getattr(method, "fills_store", False))
        #: spans the store lacked, computed in this prefill (``fills_store``) and stored by :meth:`fill_store`
        self.missed: list[CachedSpan] = []
        for span in self.spans:
            span.reader = store.open(span.key)
            if span.reader is None:
                if not fills:
                    raise RuntimeError(
                        f"chunk cache {span.key.digest} vanished from the store between prepare and prefill"
                    )
                self.missed.append(span)
        if self.missed:
            self.spans = [span for span in self.spans if span.reader is not None]
        self._store = store
        opened = time.perf_counter() - started
        self.timing["load_s"] += opened
        self.timing["load_wait_s"] += opened

    def _plan_layout(self, n: int, segments: tuple[Segment, ...]) -> None:
        """Plan the request's layout on the host: cached and query rows, cached slots, re-rotation deltas."""
        # the request's layout, on the host (numpy: planning reads no tensor)
        self.cached_flags, self.query_flags = cached_flags, query_flags = self._flags(n, segments)
        self.cached_mask = torch.from_numpy(cached_flags)
        self.query_mask = torch.from_numpy(query_flags)
        spans = [(span.begin, span.end) for span in self.spans]
        empty = np.zeros(0, dtype=np.int64)
        self.cached_slots = self._host_ints(np.concatenate([np.arange(b, e) for b, e in spans] or [empty]))
        self._deltas = np.concatenate(
            [np.full(span.end - span.begin, span.delta, dtype=np.int64) for span in self.spans] or [empty]
        )
        self._rotation: tuple[torch.Tensor, torch.Tensor] | tuple[()] | None = None
        self.uncached = np.flatnonzero(~cached_flags)
        self.n_context = n - int(query_flags.sum())  # the non-query rows

    # ------------------------------------------------------------------ host → device
    def _flags(self, n: int, segments: tuple[Segment, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(rows a cached span covers, rows of the query segment): host booleans ``[n]``."""
        cached = np.zeros(n, dtype=bool)
        for span in self.spans:
            cached[span.begin : span.end] = True
        query = np.zeros(n, dtype=bool)
        for segment, (begin, end) in zip(segments, segment_spans(segments)):
            if segment.role == "query":
                query[begin:end] = True
        return cached, query

    def _host_ints(self, values: np.ndarray | list[int]) -> torch.Tensor:
        """Host ints as an int64 CPU tensor (pinned on CUDA, for asynchronous copies)."""
        host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        return host.pin_memory() if self._pin else host

    def _on_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the compute device: itself on a CPU, else an asynchronous copy (pinned source)."""
        return host if self.device.type == "cpu" else host.to(self.device, non_blocking=True)

    def device_index(self, values: np.ndarray | list[int]) -> torch.Tensor:
        """Host ints (indices a method computed on the host) as an int64 tensor on the compute device."""
        return self._on_device(self._host_ints(values))

    # ------------------------------------------------------------------ per layer
    def before_layer(self, layer: int) -> None:
        self._keep = None
        self.recomputed.append(self.rows.count)
        needed = bool(self.spans) and self.method.needs_cache_at(self, layer)  # (every span missed: none)
        rows = None
        if needed:
            rows = self.loader.take(layer)
        else:
            self.loader.discard(layer)
        later = [i for i in self.cache_layers if i > layer]
        if later:
            self.loader.prefetch(later[0])  # loads while this layer installs and computes
        if needed:
            assert rows is not None
            self._install(layer, rows)
        self._layer_started = time.perf_counter()

    def cached_values(self, layer: int) -> torch.Tensor | None:
        """The installed (cached) V of the active rows at ``layer`` (``[kv_heads, t, d]``; zeros for rows
        no cache covers, such as the query), or None when nothing is installed; valid until the layer's
        fresh rows overwrite them."""
        kv = self.ctx.store[layer]
        return self._cached_rows(kv.values) if kv.n else None

    def cached_keys(self, layer: int) -> torch.Tensor | None:
        """The installed keys of the active rows at ``layer``, re-rotated to their positions in this prompt
        (post-RoPE, as :meth:`fresh_keys`); as :meth:`cached_values` otherwise."""
        kv = self.ctx.store[layer]
        return self._cached_rows(kv.keys) if kv.n else None

    def fresh_keys(self, layer: int) -> torch.Tensor:
        """The active rows' fresh post-RoPE keys at the running layer (``[kv_heads, t, d]``; valid while a
        policy's ``on_layer`` runs)."""
        assert self._fresh_keys is not None and self._fresh_layer == layer
        return self._fresh_keys

    def _cached_rows(self, held: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(held.shape[0], self.rows.count, held.shape[-1], dtype=held.dtype, device=held.device)
        index, positions = self.rows.covered
        out[:, index.to(held.device)] = held[:, positions.to(held.device)]
        return out

    def _install(self, layer: int, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write layer ``layer``'s cached rows (``rows``: the loader's K, V per span) into the store: the
        spans' keys re-rotated together by each row's delta (one rotation computed for all layers), one
        write."""
        kv = self.ctx.store[layer]
        started = time.perf_counter()
        keys = torch.cat([k[:, span.rows] for (k, _), span in zip(rows, self.spans)], dim=1)
        values = torch.cat([v[:, span.rows] for (_, v), span in zip(rows, self.spans)], dim=1)
        gathered = time.perf_counter()
        if self._rotation is None:
            moved = bool((self._deltas != 0).any())
            deltas = self._on_device(self._host_ints(self._deltas)) if moved else None
            self._rotation = rotation(self.ctx.model, deltas, keys.device) if deltas is not None else ()
        if self._rotation:
            keys = apply_rotation(self.ctx.model, keys, *self._rotation)
        rotated = time.perf_counter()
        kv.write(self.cached_slots, keys, values, self.cached_slots)
        self.timing["write_s"] += (gathered - started) + (time.perf_counter() - rotated)
        self.timing["rerotate_s"] += rotated - gathered
        self.installed_layers += 1

    def _shrink(self, keep: torch.Tensor | np.ndarray | list[int]) -> ActiveRows:
        """The active rows after ``keep`` (indices into the current ones; a device tensor is read here,
        once: the shrink's one host read)."""
        chosen = np.asarray(keep.tolist() if isinstance(keep, torch.Tensor) else keep, dtype=np.int64)
        dropped = np.ones(self.rows.count, dtype=bool)
        dropped[chosen] = False
        self.throughout[self.rows.positions[dropped]] = False
        rows = ActiveRows(self, self.rows.positions[chosen])
        if isinstance(keep, torch.Tensor) and keep.device.type == self.device.type:
            self._keep = keep
        else:
            self._keep = self._on_device(self._host_ints(chosen))
        rows.keep = chosen
        return rows

    def _layout(self, rows: ActiveRows, name: str, positions: np.ndarray, query: torch.Tensor) -> attention.PastLayout:
        """The attention layout of query rows at ``positions`` over the layer's ``n`` keys, kept on ``rows``
        under ``name`` (made at its first use: once per set of active rows)."""
        found = rows.layouts.get(name)
        if found is None:
            found = rows.layouts[name] = attention.past_layout(
                self.n, positions, dtype=query.dtype, device=query.device
            )
            self.layouts_built += 1
        return found

    def attend(
        self,
        layer: int,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        kv = self.ctx.store[layer]
        active = self.rows
        if self.reference is not None:
            self._queries[layer] = query[0][:, active.queries].clone()
        started = time.perf_counter()
        self._fresh_keys, self._fresh_layer = key[0], layer
        keep = self.method.on_layer(self, layer, value[0])
        self._fresh_keys = None
        self._next = self._shrink(keep) if keep is not None else None
        self.timing["select_s"] += time.perf_counter() - started
        if kv.n == 0:
            kv.append(key[0], value[0], active.host)
        else:
            kv.write(active.host, key[0], value[0], active.host)
        kv.check_written(layer)  # every key this layer attends is a cached or a computed row
        if self._observe is not None:  # the layer's K now complete: the policy may measure attention
            self._observe(self, layer, query[0], scaling)
        columns = self._segments_of(self, layer) if self._segments_of is not None else None
        if columns is None:
            return self._attention(layer, module, query, key, value, scaling, None)
        # the policy's statistics from this attention's own softmax (attention.SegmentColumns)
        wide = self._attention(layer, module, columns.query(query), key, value, scaling, columns)
        out, mass = columns.split(wide, value.shape[-1])
        assert self._observe_mass is not None
        self._observe_mass(self, layer, mass[0])  # [active rows, heads, segments]; zero for rows not attending
        return out

    def _attention(
        self,
        layer: int,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        columns: attention.SegmentColumns | None,
    ) -> torch.Tensor:
        """The active rows' attention at ``layer`` (``key``/``value``: the fresh rows'; the layer's complete
        K/V are in the store), ``[1, active rows, H, width]``, zeros for the rows that do not attend;
        with ``columns`` the keys and values are widened (``query`` already is)."""
        kv, active, nxt = self.ctx.store[layer], self.rows, self._next
        cut = nxt is not None and self.cuts_in_layer
        if active.count == self.n and not cut:
            # Every row is fresh, in order: the dense kernel of `full` (rows dropped after it are unused).
            if columns is not None:
                key, value = columns.kv(key, value)
            return attention.dense(module, query, key, value, scaling)
        keys, values = (kv.keys, kv.values) if columns is None else columns.kv(kv.keys, kv.values)
        m = active.count
        code = self.method.bottom_right_mask
        if nxt is None:
            rows = active.order
            positions = np.arange(self.n - m, self.n) if code else active.positions
            layout_of, name = active, "code" if code else "exact"
        elif cut:
            # only the rows that continue attend, as they will at the next layers (the released code's
            # short query: exact positions, or the bottom-right mask over these rows)
            assert self._keep is not None and nxt.keep is not None
            rows = self._keep
            positions = np.arange(self.n - nxt.count, self.n) if code else nxt.positions
            layout_of, name = nxt, "code" if code else "exact"
        else:
            assert self._keep is not None and nxt.keep is not None
            rows = self._keep
            positions = self.n - m + nxt.keep if code else nxt.positions
            # exact: these rows are the next set's, whose layout the later layers reuse; code: this layer's own
            layout_of, name = (nxt, "exact") if not code else (active, f"code@{layer}")
        out = torch.zeros(1, m, query.shape[1], values.shape[-1], dtype=query.dtype, device=query.device)
        q = query[:, :, rows]
        if active.in_order:
            layout = self._layout(layout_of, name, positions, query)
            out[:, rows] = attention.with_past(q, keys, values, kv.positions[0], active.host, scaling, layout=layout)
        else:
            # the active rows are not every uncached row: the positions are read where they are
            where = self._on_device(self._host_ints(positions))
            out[:, rows] = attention.with_past(q, keys, values, kv.positions[0], where, scaling)
        return out

    def rows_after_attention(self) -> torch.Tensor | None:
        """The rows the running layer's policy kept (a shrink at this layer), which alone go on through
        the output projection and the MLP when the plan cuts in the layer."""
        return self._keep if self._next is not None else None

    def after_layer(self, layer: int) -> torch.Tensor | None:
        spent = time.perf_counter() - self._layer_started
        self.recompute_per_layer[layer] += spent
        self.timing["recompute_s"] += spent
        # rows that ran the layer's attention, output projection and MLP (a layer that cut in itself ran
        # only the ones that continue through them; the others' Q/K/V only)
        self.through.append(self._next.count if self._next is not None and self.cuts_in_layer else self.rows.count)
        if self._next is not None:
            self.rows, self._next = self._next, None
        return self._keep

    def telemetry(self) -> dict[str, Any]:
        self.loader.close()
        self.timing["load_s"] += self.loader.load_s
        self.timing["load_wait_s"] += self.loader.wait_s
        deviation = reuse_deviation.deviation(self) if self.reference is not None else None
        for span in self.spans:
            if span.reader is not None:
                span.reader.close()
        tiers: dict[str, int] = {}
        for span in self.spans:
            if span.reader is not None:
                tiers[span.reader.tier] = tiers.get(span.reader.tier, 0) + 1
        return {
            "tokens": self.n,
            # rows whose K/V at the last layer come from a cache
            "reused_tokens": self.n - self.recomputed[-1] if self.recomputed else 0,
            "recompute_per_layer": [r / self.n for r in self.recomputed],
            "recompute_ratio": sum(self.recomputed) / (self.n * len(self.recomputed)) if self.recomputed else None,
            # the same as a count: rows whose Q/K/V a layer computed, summed over layers (kvbench.runner's
            # compute_ratio adds the chunks precomputed for the request)
            "computed_token_layers": sum(self.recomputed),
            "layers": len(self.recomputed),
            # the same share counting only rows through attention, output projection and MLP (less than
            # recompute_ratio by the rows a check layer computed Q/K/V for and then cut)
            "through_ratio": sum(self.through) / (self.n * len(self.through)) if self.through else None,
            "chunks": len(self.spans),
            # spans the store lacked, computed in this prefill (``fills_store``) and their rows
            "missed_chunks": len(self.missed),
            "missed_tokens": sum(span.end - span.begin for span in self.missed),
            "chunk_tiers": tiers,
            **self.timing,
            "load_hidden_s": max(0.0, self.timing["load_s"] - self.timing["load_wait_s"]),
            "pipelined": self.loader.pipelined,
            "load_per_layer_s": [round(x, 6) for x in self.loader.per_layer_s],
            "recompute_per_layer_s": [round(x, 6) for x in self.recompute_per_layer],
            "attention_layouts": self.layouts_built,
            **({"deviation": deviation} if deviation is not None else {}),
        }

    # ------------------------------------------------------------------ after the request
    def fill_store(self) -> dict[str, int]:
        """Store every missed span's rows of this request's K/V under the span's key (after the request,
        outside its TTFT; see the module docs): ``{"stored": chunks kept, "not_stored": chunks the store
        could not hold}``. Raises when a missed row was not computed at every layer (a policy that
        dropped it would store reused or never-written K/V as if it were this request's)."""
        stored = not_stored = 0
        for span in self.missed:
            if not self.throughout[span.begin : span.end].all():
                raise RuntimeError(
                    f"rows {span.begin}..{span.end - 1} missed the store but were not computed at every layer: "
                    "a policy that fills the store must keep a missed span's rows active"
                )
            if store_request_rows(self.ctx, self._store, span.key, span.begin, span.end) is not None:
                stored += 1
            else:
                not_stored += 1
        self.missed = []
        return {"stored": stored, "not_stored": not_stored}
