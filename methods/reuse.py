"""What every reuse method shares: chunk caches, their precomputation, and a layer-by-layer prefill
that installs cached K/V and recomputes a chosen set of rows.

A reuse method (CacheBlend, full KV reuse, prefix caching) builds a prompt's prefill cache mostly from
K/V computed earlier. The prompt arrives as ordered segments (:mod:`kvbench.requests`): an exact
``prefix``, reusable ``chunk`` s and the ``query``. Before the request's clock starts,
:meth:`ReuseMethod.prepare` makes sure every cache the method will read exists in the chunk store
(:mod:`kvbench.kv.chunks`), computing missing ones with a dense prefill — the store would hold them
from earlier requests; this time is recorded apart (``prepared.precompute_s``), never in TTFT. Inside
the clock, :class:`ReusePrefill` runs the per-layer plan:

* before layer ``i``: read layer ``i`` of every cached segment from its tier, re-rotate its keys from
  the positions it was computed at to its positions in this prompt (the model's own RoPE), and write
  the rows into the store at their slots — unless every row of the layer is recomputed anyway;
* the layer runs on the *active* rows; their fresh K/V overwrite the cached rows; attention of the
  active queries over every row of the layer with an exact causal mask on positions
  (``mask: code`` reproduces CacheBlend's released bottom-right-aligned mask);
* the method may measure deviations and shrink the active set (CacheBlend's check layers).

**Pipelined loading** (CacheBlend §5, Fig. 10; ``store.pipeline``, default true). Installing layer
``i``'s cached rows needs that layer's K/V from the chunk store's tier. With the pipeline on, a
:class:`LayerLoader` reads them on one worker thread — disk → host memory (``os.preadv``, GIL
released; a throttled read sleeps), then on a GPU host → device on a side CUDA stream — for layer
``i + 1`` while the main thread installs and computes layer ``i``; the main thread waits only for
what is not loaded yet when it needs it. With it off, every layer is read on the main thread just
before it runs. Telemetry (``telemetry.prefill``): ``load_s`` (time spent reading and copying, on
whichever thread), ``load_wait_s`` (main-thread time blocked on loads), ``load_hidden_s`` =
``load_s - load_wait_s`` (load time that overlapped compute), ``recompute_s`` (the layers' own time:
Q/K/V, attention, MLP of the active rows, selection included), ``rerotate_s`` and ``write_s`` (installing
cached rows), and ``load_per_layer_s`` / ``recompute_per_layer_s``. On a CPU the loader competes with
compute for the same cores (a cold read costs little CPU; decoding safetensors none), which is measured,
not assumed away: ``kvbench bench reuse_pipeline`` runs both settings side by side.

Family rules: no token budget (``budget.*`` is recorded as unused); prompts must carry segments (a
task without chunks is refused with one line); models whose RoPE cannot be moved by a delta are
refused; and the silent-failure guard fails a run that was asked to recompute a fraction r < 1 but
recomputed every row after its check layers, or that reused nothing.

Chunk prefill modes (``chunk_bos``): ``true`` precomputes each chunk after the tokenizer's BOS (at
positions 1..n, the BOS row dropped), as CacheBlend's scripts do; ``false`` precomputes it alone at
0..n-1. A tokenizer without a BOS token (Qwen2.5) always precomputes alone; the mode used is recorded.
The ``prefix`` segment is an exact prefix: cached at its real positions, it is exact by causality.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvbench.engine import attention
from kvbench.engine.prefill import PrefillPlan
from kvbench.engine.rope import apply_rotation, check_rerotatable, rotation
from kvbench.errors import CompressionNotApplied, ConfigError
from kvbench.kv.chunks import ChunkKey, ChunkKV, ChunkReader, ChunkStore, model_fingerprint
from kvbench.methods.base import KVMethod
from kvbench.methods.params import ReuseParams
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


class ReuseMethod(KVMethod):
    """Base of the reuse family (see the module docs)."""

    family = "reuse"
    needs_budget = False
    extends_with_many_tokens = True
    #: the runner attaches a chunk store built from the ``store.*`` config (see :meth:`attach_store`)
    uses_chunk_store: ClassVar[bool] = True
    #: the run fails when the method reused no cached token (full reuse and CacheBlend always reuse)
    must_reuse: ClassVar[bool] = True

    Params = ReuseParams
    params: ReuseParams

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)
        self.store: ChunkStore | None = None

    def budget_label(self, budget: Any) -> str:
        return "no budget (reuse)"

    # ------------------------------------------------------------------ chunk caches
    def attach_store(self, store: ChunkStore) -> None:
        """Use ``store`` for chunk caches (the runner shares one per run; tests may pass their own)."""
        self.store = store

    def _store(self) -> ChunkStore:
        if self.store is None:
            self.store = ChunkStore()
        return self.store

    def _bos(self, ctx: GenerationContext) -> int | None:
        bos = getattr(ctx.loaded.tokenizer, "bos_token_id", None)
        return int(bos) if (self.params.chunk_bos and bos is not None) else None

    def chunk_key(self, ctx: GenerationContext, segment: Segment, begin: int) -> ChunkKey:
        """How ``segment`` (starting at prompt position ``begin``) is cached: an exact prefix when it is
        the prompt's ``prefix`` segment at position 0, else a chunk prefilled alone (or after BOS)."""
        model = self._fingerprint(ctx)
        if segment.role == "prefix" and begin == 0:
            return ChunkKey(model, segment.ids, "prefix")
        return ChunkKey(model, segment.ids, "bos" if self._bos(ctx) is not None else "alone")

    def _fingerprint(self, ctx: GenerationContext) -> str:
        cached = getattr(ctx.loaded, "_kvbench_fingerprint", None)
        if cached is None:
            cached = model_fingerprint(ctx.loaded)
            # a memo kept on the loaded model (it lives exactly as long as the weights it describes)
            ctx.loaded._kvbench_fingerprint = cached  # type: ignore[attr-defined]
        return cached

    def precompute(self, ctx: GenerationContext, key: ChunkKey) -> None:
        """Compute and store the cache ``key`` describes (a dense prefill; outside any measured time)."""
        from kvbench.engine.generate import prefill_kv

        ids = list(key.ids)
        start = 0
        if key.mode == "bos":
            bos = self._bos(ctx)
            assert bos is not None
            ids, start = [bos] + ids, 1
        keys, values = prefill_kv(ctx.loaded, ids)
        entry = ChunkKV([k[:, start:].contiguous() for k in keys], [v[:, start:].contiguous() for v in values], start)
        self._store().put(key, entry)

    def cached_segments(self, ctx: GenerationContext, segments: tuple[Segment, ...]) -> list[CachedSpan]:
        """The spans this method takes from caches (default: the prefix and every chunk)."""
        spans = []
        for segment, (begin, end) in zip(segments, segment_spans(segments)):
            if segment.role != "query" and end > begin:
                spans.append(CachedSpan(begin, end, self.chunk_key(ctx, segment, begin)))
        return spans

    def _require_segments(self, segments: tuple[Segment, ...] | None) -> tuple[Segment, ...]:
        if not segments or not any(s.role == "chunk" for s in segments):
            raise ConfigError(
                f"method {self.name} reuses chunk caches, but this task's prompts are not split into chunks",
                "use a chunked task such as task=rag, or a non-reuse method",
            )
        return segments

    def prepare(
        self, ctx: GenerationContext, input_ids: torch.Tensor, segments: tuple[Segment, ...] | None
    ) -> dict[str, Any]:
        segments = self._require_segments(segments)
        check_rerotatable(ctx.model)
        store = self._store()
        started = time.perf_counter()
        computed = promoted = 0
        spans = self.cached_segments(ctx, segments)
        for span in spans:  # first the hits, so that what this request stores cannot evict them
            store.touch(span.key)
        for span in spans:
            if store.promote(span.key):
                promoted += 1
            elif store.contains(span.key) is None:
                self.precompute(ctx, span.key)
                computed += 1
        lost = [span for span in spans if store.contains(span.key) is None]
        if lost:
            tier = store.config.tier
            size = "ram_gb" if tier == "ram" else "disk_gb"
            raise ConfigError(
                f"store.{size}={getattr(store.config, size)} cannot hold one request's {len(spans)} chunk caches "
                f"({len(lost)} did not fit in the {tier} tier)",
                f"raise store.{size}",
            )
        spent = time.perf_counter() - started
        store.precompute_s += spent
        store.precomputed += computed
        report = {
            "precompute_s": spent,
            "precomputed_chunks": computed,
            "promoted_chunks": promoted,
            "chunk_mode": "bos" if self._bos(ctx) is not None else "alone",
        }
        self._reference = None
        if ctx.profile.deviation:
            from kvbench.engine.generate import prefill_kv

            started = time.perf_counter()
            rows = _query_rows(segments)
            self._reference = prefill_kv(ctx.loaded, input_ids.tolist(), query_rows=rows)
            report["reference_s"] = time.perf_counter() - started
        return report

    # ------------------------------------------------------------------ the plan
    def prefill_plan(
        self, ctx: GenerationContext, input_ids: torch.Tensor, segments: tuple[Segment, ...] | None
    ) -> PrefillPlan:
        segments = self._require_segments(segments)
        return ReusePrefill(ctx, self, input_ids, segments)

    def initial_rows(self, plan: ReusePrefill) -> torch.Tensor:
        """Positions of the rows computed at layer 0 (default: the query rows and every uncached row)."""
        return plan.uncached

    def cache_layers(self, plan: ReusePrefill) -> range:
        """The layers whose cached rows are expected to be installed, in order (what the pipelined
        loader prefetches; default: every layer). A wrong guess costs a wasted or a waited-for load,
        never a wrong result: :meth:`needs_cache_at` decides."""
        return range(plan.ctx.spec.n_layers)

    def needs_cache_at(self, plan: ReusePrefill, layer: int) -> bool:
        """Whether cached rows are installed before ``layer`` (default: unless every row is recomputed)."""
        return plan.active.numel() < plan.n

    def on_layer(self, plan: ReusePrefill, layer: int, fresh_v: torch.Tensor) -> torch.Tensor | None:
        """Called at each layer with the active rows' fresh V (``[kv_heads, t, d]``) before they overwrite
        the cached rows; return indices into the active rows that stay active after this layer, or None."""
        return None

    def expects_reuse(self) -> bool:
        """Whether this configuration must reuse at least one cached row (the guard below)."""
        return self.must_reuse

    def telemetry(self) -> dict[str, Any]:
        """The chunk store's configuration and cumulative per-tier figures (hits, bytes, measured MB/s)."""
        return {"store": self._store().summary()}

    def check_after_prefill(self, ctx: GenerationContext) -> None:
        report = ctx.telemetry.prefill_plan
        if report and self.expects_reuse() and report.get("reused_tokens", 0) == 0:
            raise CompressionNotApplied(
                f"method {self.name} was asked to reuse cached K/V but recomputed every token",
                "this is a bug in the method; report it with the run's config.yaml",
            )


class LayerLoader:
    """Reads one layer of every cached span at a time, on a worker thread when ``pipelined``.

    :meth:`prefetch` starts loading a layer (on the worker; without the pipeline it does nothing),
    :meth:`take` returns a layer's (K, V) per span — waiting for a prefetch in flight, or reading it
    right there — and :meth:`discard` drops a layer that turned out not to be needed. On CUDA the
    worker reads into pinned memory and copies to the device on its own stream; :meth:`take` makes the
    compute stream wait for that copy (an event), so the copy overlaps the previous layer's kernels.
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


def _query_rows(segments: tuple[Segment, ...]) -> torch.Tensor:
    return torch.cat(
        [torch.arange(b, e) for seg, (b, e) in zip(segments, segment_spans(segments)) if seg.role == "query"]
        or [torch.zeros(0, dtype=torch.long)]
    )


class ReusePrefill(PrefillPlan):
    """The per-layer plan of a reuse method: install cached rows, recompute the active ones."""

    def __init__(
        self, ctx: GenerationContext, method: ReuseMethod, input_ids: torch.Tensor, segments: tuple[Segment, ...]
    ) -> None:
        n = int(input_ids.numel())
        self.method = method
        self.n = n
        self.segments = segments
        self.spans = method.cached_segments(ctx, segments)
        store = method._store()
        self.timing = {
            "load_s": 0.0,
            "load_wait_s": 0.0,
            "rerotate_s": 0.0,
            "write_s": 0.0,
            "select_s": 0.0,
            "recompute_s": 0.0,
        }
        started = time.perf_counter()
        for span in self.spans:
            span.reader = store.open(span.key)
            if span.reader is None:
                raise RuntimeError(f"chunk cache {span.key.digest} vanished from the store between prepare and prefill")
        opened = time.perf_counter() - started
        self.timing["load_s"] += opened
        self.timing["load_wait_s"] += opened
        cached = torch.zeros(n, dtype=torch.bool)
        for span in self.spans:
            cached[span.begin : span.end] = True
        self.cached_mask = cached
        self.cached_slots = torch.cat(
            [torch.arange(span.begin, span.end) for span in self.spans] or [torch.zeros(0, dtype=torch.long)]
        )
        self._rotation: tuple[torch.Tensor, torch.Tensor] | tuple[()] | None = None
        self.uncached = torch.nonzero(~cached).flatten()
        spans = segment_spans(segments)
        query = torch.zeros(n, dtype=torch.bool)
        for segment, (begin, end) in zip(segments, spans):
            if segment.role == "query":
                query[begin:end] = True
        self.query_mask = query
        rows = method.initial_rows(self)
        super().__init__(ctx, input_ids[rows], rows)
        self.recomputed: list[int] = []
        self.installed_layers = 0
        self._keep: torch.Tensor | None = None
        self.deviations: dict[int, torch.Tensor] = {}  # check layer -> KV deviation of its active rows
        # profile.deviation: the full prefill's K, V, Q
        self.reference: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None = getattr(
            method, "_reference", None
        )
        self._queries: dict[int, torch.Tensor] = {}  # profile.deviation: the query rows' queries per layer
        n_layers = ctx.spec.n_layers
        self.recompute_per_layer = [0.0] * n_layers
        self._layer_started = 0.0
        self.cache_layers = (
            [layer for layer in method.cache_layers(self) if 0 <= layer < n_layers] if self.spans else []
        )
        self.loader = LayerLoader(
            self.spans, torch.device(ctx.spec.device), n_layers, pipelined=bool(store.config.pipeline)
        )
        if self.cache_layers:
            self.loader.prefetch(self.cache_layers[0])

    # ------------------------------------------------------------------ per layer
    def before_layer(self, layer: int) -> None:
        self._keep = None
        self.recomputed.append(int(self.active.numel()))
        needed = self.method.needs_cache_at(self, layer)
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
        if kv.n == 0:
            return None
        out = torch.zeros(kv.n_kv_heads, self.active.numel(), kv.head_dim, dtype=kv.dtype, device=kv.home)
        covered = self.cached_mask[self.active]
        out[:, covered.to(kv.home)] = kv.values[:, self.active[covered].to(kv.home)]
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
            deltas = torch.cat([torch.full((span.end - span.begin,), span.delta) for span in self.spans])
            self._rotation = rotation(self.ctx.model, deltas, keys.device) if bool((deltas != 0).any()) else ()
        if self._rotation:
            keys = apply_rotation(self.ctx.model, keys, *self._rotation)
        rotated = time.perf_counter()
        kv.write(self.cached_slots, keys, values, self.cached_slots)
        self.timing["write_s"] += (gathered - started) + (time.perf_counter() - rotated)
        self.timing["rerotate_s"] += rotated - gathered
        self.installed_layers += 1

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
        active = self.active
        if self.reference is not None:
            self._queries[layer] = query[0][:, self.query_mask[active].to(query.device)].clone()
        started = time.perf_counter()
        self._keep = self.method.on_layer(self, layer, value[0])
        self.timing["select_s"] += time.perf_counter() - started
        if kv.n == 0:
            kv.append(key[0], value[0], active)
        else:
            kv.write(active, key[0], value[0], active)
        if active.numel() == self.n:
            # Every row is fresh, in order: the dense kernel of `full` (rows dropped after it are unused).
            return attention.dense(module, query, key, value, scaling)
        keep = self._keep
        rows = torch.arange(active.numel()) if keep is None else keep
        out = torch.zeros(1, active.numel(), query.shape[1], value.shape[-1], dtype=query.dtype, device=query.device)
        q = query[:, :, rows.to(query.device)]
        if self.method.params.mask == "code":
            m = active.numel()
            query_positions = torch.arange(self.n - m, self.n)[rows]
        else:
            query_positions = active[rows]
        out[:, rows.to(query.device)] = attention.with_past(
            q, kv.keys, kv.values, kv.positions[0], query_positions, scaling
        )
        return out

    def after_layer(self, layer: int) -> torch.Tensor | None:
        spent = time.perf_counter() - self._layer_started
        self.recompute_per_layer[layer] += spent
        self.timing["recompute_s"] += spent
        return self._keep

    def telemetry(self) -> dict[str, Any]:
        self.loader.close()
        self.timing["load_s"] += self.loader.load_s
        self.timing["load_wait_s"] += self.loader.wait_s
        deviation = self._deviation() if self.reference is not None else None
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
            "chunks": len(self.spans),
            "chunk_tiers": tiers,
            **self.timing,
            "load_hidden_s": max(0.0, self.timing["load_s"] - self.timing["load_wait_s"]),
            "pipelined": self.loader.pipelined,
            "load_per_layer_s": [round(x, 6) for x in self.loader.per_layer_s],
            "recompute_per_layer_s": [round(x, 6) for x in self.recompute_per_layer],
            **({"deviation": deviation} if deviation is not None else {}),
        }

    # ------------------------------------------------------------------ profile.deviation
    def _deviation(self) -> dict[str, Any]:
        """How far reuse is from a full prefill (CacheBlend Figs. 6–8), computed after the prefill.

        * ``reused_kv``: per layer, the KV deviation of every cached token *as reused* (re-rotated,
          before any recompute) from the full prefill's — squared L2 of V summed over heads and
          dimensions, the quantity CacheBlend selects by — as a 101-point quantile curve, its mean, and
          the share of the total carried by the top 15 % of tokens (Fig. 7);
        * ``spearman``: rank correlation of those per-token deviations between consecutive layers (Fig. 8);
        * ``attention``: per layer, the Frobenius norm of the difference between the query rows'
          attention (softmax over every prompt key, causal by position) in this prefill and in the full
          one, averaged over heads, and its mean over layers (Fig. 6's y axis);
        * ``blended_kv``: per layer, the mean KV deviation of all tokens after this method's recompute.
        """
        assert self.reference is not None  # (called only with profile.deviation)
        keys_f, values_f, queries_f = self.reference
        # per-token deviations are computed where the KV lives and read on the host (curves, ranks)
        device = keys_f[0].device if keys_f else torch.device("cpu")
        cached = torch.nonzero(self.cached_mask).flatten().cpu()
        curves, means, top15, per_layer = [], [], [], []
        blended, attention_dev = [], []
        scale = self.ctx.spec.head_dim**-0.5
        positions = torch.arange(self.n, device=device)
        query_positions = positions[self.query_mask.to(device)]
        for layer in range(len(keys_f)):
            dev = torch.zeros(self.n, device=device)
            for span in self.spans:
                assert span.reader is not None
                _, v = span.reader.layer(layer)
                v = v[:, span.rows].to(device).float()
                dev[span.begin : span.end] = (
                    (v - values_f[layer][:, span.begin : span.end].float()).pow(2).sum(dim=(0, 2))
                )
            tokens = dev.cpu()[cached]
            per_layer.append(tokens)
            ordered = torch.sort(tokens).values
            curves.append(
                [round(float(x), 6) for x in torch.quantile(ordered, torch.linspace(0, 1, 101))]
                if tokens.numel()
                else []
            )
            means.append(float(tokens.mean()) if tokens.numel() else 0.0)
            k = max(1, int(0.15 * tokens.numel()))
            total = float(tokens.sum())
            top15.append(float(ordered[-k:].sum()) / total if total > 0 else 0.0)
            kv = self.ctx.store[layer]
            blend_k, blend_v = kv.keys[:, : self.n].to(device).float(), kv.values[:, : self.n].to(device).float()
            blended.append(
                float(
                    (
                        (blend_v - values_f[layer].float()).pow(2).sum(dim=(0, 2))
                        + (blend_k - keys_f[layer].float()).pow(2).sum(dim=(0, 2))
                    ).mean()
                )
            )
            q_b, q_f = self._queries.get(layer), queries_f[layer]
            if q_b is not None and q_b.shape[1]:
                a_b = _attention(q_b.float(), blend_k, query_positions, positions, scale)
                a_f = _attention(q_f.float(), keys_f[layer].float(), query_positions, positions, scale)
                attention_dev.append(float((a_b - a_f).flatten(1).norm(dim=1).mean()))
        spearman = [_spearman(a, b) for a, b in zip(per_layer, per_layer[1:])]
        return {
            "metric": "V squared L2 summed over heads and dims (reused_kv); K+V (blended_kv)",
            "reused_kv_quantiles": curves,
            "reused_kv_mean": means,
            "reused_kv_top15_share": top15,
            "spearman": spearman,
            "blended_kv_mean": blended,
            "attention": attention_dev,
            "attention_mean": float(sum(attention_dev) / len(attention_dev)) if attention_dev else None,
        }


def _attention(
    q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention ``[heads, rows, keys]`` of queries ``[heads, rows, d]`` over keys ``[kv_heads, n, d]``
    (query head h reads KV head h // group), causal by position."""
    group = q.shape[0] // k.shape[0]
    logits = torch.einsum("hrd,hnd->hrn", q, k.repeat_interleave(group, dim=0)) * scale
    logits = logits.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.softmax(logits, dim=-1)


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks of ``x`` with ties given their average rank (as Spearman's coefficient defines them)."""
    values, order = torch.sort(x)
    _, inverse, counts = torch.unique_consecutive(values, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    average = ends - (counts.double() - 1) / 2  # 1-based average rank of each group of equal values
    ranks = torch.empty(x.numel(), dtype=torch.float64)
    ranks[order] = average[inverse]
    return ranks


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Spearman rank correlation of two equally long vectors (average ranks for ties; None when either
    is constant, e.g. layer 0, whose KV cannot deviate)."""
    if a.numel() < 2:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / denominator if denominator > 1e-12 else None
