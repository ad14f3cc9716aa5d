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

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvbench.engine import attention
from kvbench.engine.prefill import PrefillPlan
from kvbench.engine.rope import check_rerotatable, rerotate
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
            ctx.loaded._kvbench_fingerprint = cached
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

    def prepare(self, ctx: GenerationContext, input_ids: torch.Tensor, segments: tuple[Segment, ...] | None) -> dict[str, Any]:
        segments = self._require_segments(segments)
        check_rerotatable(ctx.model)
        store = self._store()
        started = time.perf_counter()
        computed = 0
        for span in self.cached_segments(ctx, segments):
            if store.contains(span.key) is None:
                self.precompute(ctx, span.key)
                computed += 1
        spent = time.perf_counter() - started
        store.precompute_s += spent
        store.precomputed += computed
        return {"precompute_s": spent, "precomputed_chunks": computed, "chunk_mode": "bos" if self._bos(ctx) is not None else "alone"}

    # ------------------------------------------------------------------ the plan
    def prefill_plan(self, ctx: GenerationContext, input_ids: torch.Tensor, segments: tuple[Segment, ...] | None) -> PrefillPlan:
        segments = self._require_segments(segments)
        return ReusePrefill(ctx, self, input_ids, segments)

    def initial_rows(self, plan: ReusePrefill) -> torch.Tensor:
        """Positions of the rows computed at layer 0 (default: the query rows and every uncached row)."""
        return plan.uncached

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

    def check_after_prefill(self, ctx: GenerationContext) -> None:
        report = ctx.telemetry.prefill_plan
        if report and self.expects_reuse() and report.get("reused_tokens", 0) == 0:
            raise CompressionNotApplied(
                f"method {self.name} was asked to reuse cached K/V but recomputed every token",
                "this is a bug in the method; report it with the run's config.yaml",
            )


class ReusePrefill(PrefillPlan):
    """The per-layer plan of a reuse method: install cached rows, recompute the active ones."""

    def __init__(self, ctx: GenerationContext, method: ReuseMethod, input_ids: torch.Tensor, segments: tuple[Segment, ...]) -> None:
        n = int(input_ids.numel())
        self.method = method
        self.n = n
        self.segments = segments
        self.spans = method.cached_segments(ctx, segments)
        store = method._store()
        self.timing = {"load_s": 0.0, "rerotate_s": 0.0, "select_s": 0.0}
        started = time.perf_counter()
        for span in self.spans:
            span.reader = store.open(span.key)
            if span.reader is None:
                raise RuntimeError(f"chunk cache {span.key.digest} vanished from the store between prepare and prefill")
        self.timing["load_s"] += time.perf_counter() - started
        cached = torch.zeros(n, dtype=torch.bool)
        for span in self.spans:
            cached[span.begin : span.end] = True
        self.cached_mask = cached
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

    # ------------------------------------------------------------------ per layer
    def before_layer(self, layer: int) -> None:
        self._keep = None
        self.recomputed.append(int(self.active.numel()))
        if self.method.needs_cache_at(self, layer):
            self._install(layer)

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

    def _install(self, layer: int) -> None:
        kv = self.ctx.store[layer]
        model = self.ctx.model
        for span in self.spans:
            assert span.reader is not None
            started = time.perf_counter()
            k, v = span.reader.layer(layer)
            k, v = k[:, span.rows], v[:, span.rows]
            loaded = time.perf_counter()
            if span.delta:
                k = rerotate(model, k, span.delta)
            rotated = time.perf_counter()
            positions = torch.arange(span.begin, span.end)
            kv.write(positions, k, v, positions)
            done = time.perf_counter()
            self.timing["load_s"] += (loaded - started) + (done - rotated)
            self.timing["rerotate_s"] += rotated - loaded
        self.installed_layers += 1

    def attend(
        self, layer: int, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        kv = self.ctx.store[layer]
        active = self.active
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
        out[:, rows.to(query.device)] = attention.with_past(q, kv.keys, kv.values, kv.positions, query_positions, scaling)
        return out

    def after_layer(self, layer: int) -> torch.Tensor | None:
        return self._keep

    def telemetry(self) -> dict[str, Any]:
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
        }
