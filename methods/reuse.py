"""The reuse family's policy: chunk caches, their precomputation, and what a reuse method decides.

A reuse method (CacheBlend, full KV reuse, prefix caching) builds a prompt's prefill cache mostly from
K/V computed earlier. The prompt arrives as ordered segments (:mod:`kvbench.requests`): an exact
``prefix``, reusable ``chunk`` s and the ``query``. Before the request's clock starts,
:meth:`ReuseMethod.prepare` makes sure every cache the method will read exists in the chunk store
(:mod:`kvbench.kv.chunks`), computing missing ones with a dense prefill — the store would hold them
from earlier requests; this time is recorded apart (``prepared.precompute_s``), never in TTFT. Inside
the clock the engine's reuse prefill (:class:`~kvbench.engine.reuse.ReusePrefill`) installs cached
rows and recomputes the active ones layer by layer; a method only answers its questions
(:class:`~kvbench.engine.reuse.ReusePolicy`): which rows start active (:meth:`ReuseMethod.initial_rows`),
at which layers cached rows are installed (:meth:`ReuseMethod.needs_cache_at`, :meth:`ReuseMethod.cache_layers`),
and which rows stay active after a layer (:meth:`ReuseMethod.on_layer`, CacheBlend's check layers).

Family rules: no token budget (``budget.*`` is recorded as unused); prompts must carry segments (a
task without chunks is refused with one line); models whose RoPE cannot be moved by a delta are
refused; and the silent-failure guard fails a run that was asked to recompute a fraction r < 1 but
recomputed every row after its check layers, or that reused nothing.

Chunk prefill modes (``chunk_bos``): ``true`` precomputes each chunk after the tokenizer's BOS (at
positions 1..n, the BOS row dropped), as CacheBlend's scripts do; ``false`` precomputes it alone at
0..n-1. A tokenizer without a BOS token always precomputes alone; the mode used is recorded
(``prepared.chunk_mode``). The packaged Qwen2.5-Coder tokenizers do name one, ``<|endoftext|>``
(``bos_token`` in their tokenizer_config.json, though Qwen's chat template never emits it), so every
Qwen record shows ``chunk_mode: bos``: Qwen chunks were precomputed after ``<|endoftext|>``, not alone.
The ``prefix`` segment is an exact prefix: cached at its real positions, it is exact by causality.

**Misses computed in the prefill** (:attr:`ReuseMethod.fills_store`; CacheBlend's ``miss: prefill``, the
paper's §6 and LMCache's way). Nothing is precomputed: a span the store lacks is computed inside the
request's prefill as uncached rows (every layer, after the chunks before it, at its positions in this
prompt; the engine's reuse prefill drops it from the cached spans), so the TTFT of a miss holds that
computation and no separate precompute (``prepared.precompute_s`` is only the lookups). After the
answer, outside any measured time (CacheBlend writes new caches from a background thread), the K/V the
request computed for those spans are written to the store (:meth:`ReusePrefill.fill_store`) and later
requests reuse them like any entry, re-rotated to their positions. Their keys (mode ``prompt:<scope>``)
are this run's: the scope is one per chunk store, and such a method takes a store of its own instead
of a sweep's shared one (:meth:`ReuseMethod.attach_store`), so a run never reads entries another run
computed in its own prompts (whose values depend on that run's requests and settings); on disk they are
files like any other entry, evicted least recently used under ``store.disk_gb``. ``chunk_bos`` has no
effect then (``prepared.chunk_mode: prompt``).
"""

from __future__ import annotations

import time
import uuid
import weakref
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from kvbench.engine.prefill import PrefillPlan
from kvbench.engine.protocol import KVMethod
from kvbench.engine.reuse import CachedSpan, ReusePrefill, query_rows
from kvbench.engine.rope import check_rerotatable
from kvbench.errors import CompressionNotApplied, ConfigError
from kvbench.kv.chunks import ChunkKey, ChunkKV, ChunkStore, model_fingerprint
from kvbench.methods.params import ReuseParams
from kvbench.requests import Segment, segment_spans

if TYPE_CHECKING:
    from kvbench.engine.context import GenerationContext

#: the key mode of an entry computed inside a request's prefill: ``prompt:`` and its chunk store's scope
PROMPT_MODE = "prompt:"
#: one scope per chunk store (see the module docs): entries computed in prompts are found through it only
_SCOPES: weakref.WeakKeyDictionary[ChunkStore, str] = weakref.WeakKeyDictionary()


def prompt_scope(store: ChunkStore) -> str:
    """The scope of the entries computed in prompts that ``store`` holds (made at first use)."""
    scope = _SCOPES.get(store)
    if scope is None:
        scope = _SCOPES[store] = uuid.uuid4().hex[:16]
    return scope


def chunk_lookups(segments: tuple[Segment, ...], found: list[CachedSpan]) -> dict[str, int]:
    """``{"chunk_lookups": the prompt's chunk segments, "chunk_hits": those lying whole inside a span whose
    cache the store held before the request}`` (one definition for the reuse family: a chunk's own
    entry, or a stored prompt prefix that contains it whole (prefix caching, Set-Cache); a chunk only
    partly inside the matched prefix, precomputed for the request, left to the prefill as a miss, or
    recomputed in full without a lookup counts as a miss). The prefix and query segments are not chunks."""
    lookups = hits = 0
    for segment, (begin, end) in zip(segments, segment_spans(segments)):
        if segment.role != "chunk" or end == begin:
            continue
        lookups += 1
        hits += any(span.begin <= begin and end <= span.end for span in found)
    return {"chunk_lookups": lookups, "chunk_hits": hits}


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
        #: the running request's reuse prefill (kept until :meth:`release` for :meth:`after_request`)
        self.plan: ReusePrefill | None = None
        self._filled: dict[str, int] | None = None
        #: ``profile.deviation``: the full prefill's K, V and query rows' Q (made in :meth:`prepare`)
        self.reference: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None = None

    @property
    def bottom_right_mask(self) -> bool:
        """CacheBlend's released mask for the recomputed rows (``mask: code``)."""
        return getattr(self.params, "mask", "exact") == "code"

    @property
    def cut_at_attention(self) -> bool:
        """Whether a shrinking layer computes its attention, output projection and MLP for the rows that
        continue only (CacheBlend's ``check_rows: selected``; no shrink in the other reuse methods)."""
        return getattr(self.params, "check_rows", "all") == "selected"

    @property
    def fills_store(self) -> bool:
        """Whether a chunk the store lacks is computed in the request's prefill and stored after it
        (CacheBlend's ``miss: prefill``) instead of precomputed alone before the request (the default)."""
        return getattr(self.params, "miss", "precompute") == "prefill"

    def budget_label(self, budget: Any) -> str:
        return "no budget (reuse)"

    # ------------------------------------------------------------------ chunk caches
    def attach_store(self, store: ChunkStore) -> None:
        """Use ``store`` for chunk caches (the runner attaches one per run; tests may pass their own). The
        runner gives a method that :attr:`fills_store` a store of its own, never a sweep's shared one
        (:func:`kvbench.runner.sharing`): sharing saves precomputation, which it does not do, and would let
        this run read entries computed in another run's prompts."""
        self.store = store

    def chunk_store(self) -> ChunkStore:
        if self.store is None:
            self.store = ChunkStore()
        return self.store

    def _bos(self, ctx: GenerationContext) -> int | None:
        bos = getattr(ctx.loaded.tokenizer, "bos_token_id", None)
        return int(bos) if (self.params.chunk_bos and bos is not None) else None

    def chunk_key(self, ctx: GenerationContext, segment: Segment, begin: int) -> ChunkKey:
        """How ``segment`` (starting at prompt position ``begin``) is cached: an exact prefix when it is
        the prompt's ``prefix`` segment at position 0, else a chunk prefilled alone (or after BOS); with
        :attr:`fills_store`, any segment as some earlier request of this run computed it (its tokens
        alone identify it: no position, no context)."""
        model = self._fingerprint(ctx)
        if self.fills_store:  # (this run's entries, computed inside its prompts: see the module docs)
            return ChunkKey(model, segment.ids, PROMPT_MODE + prompt_scope(self.chunk_store()))
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
        self.chunk_store().put(key, entry)

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
        self._filled = None
        store = self.chunk_store()
        started = time.perf_counter()
        computed = computed_tokens = promoted = missed = missed_tokens = 0
        spans = self.cached_segments(ctx, segments)
        for span in spans:  # first the hits, so that what this request stores cannot evict them
            store.touch(span.key)
        found = [span for span in spans if store.contains(span.key) is not None]  # before any precompute
        for span in spans:
            if store.promote(span.key):
                promoted += 1
            elif store.contains(span.key) is None:
                if self.fills_store:  # computed in the prefill, stored after the request
                    missed += 1
                    missed_tokens += span.end - span.begin
                else:
                    self.precompute(ctx, span.key)
                    computed += 1
                    computed_tokens += span.end - span.begin
        lost = [] if self.fills_store else [span for span in spans if store.contains(span.key) is None]
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
            "miss": "prefill" if self.fills_store else "precompute",
            # misses precomputed alone before the clock / left to the prefill (computed inside TTFT)
            "precomputed_chunks": computed,
            "precomputed_tokens": computed_tokens,  # their rows in this prompt (kvbench.runner's compute_ratio)
            "prefill_chunks": missed,
            "prefill_tokens": missed_tokens,
            "promoted_chunks": promoted,
            # the chunk store's hit rate (kvbench.runner's chunk_hit_rate): the prompt's chunk segments,
            # and those a cache found in the store before this request covers whole
            **chunk_lookups(segments, found),
            "chunk_mode": "prompt" if self.fills_store else "bos" if self._bos(ctx) is not None else "alone",
        }
        self.reference = None
        if ctx.profile.deviation:
            from kvbench.engine.generate import prefill_kv

            started = time.perf_counter()
            rows = query_rows(segments)
            self.reference = prefill_kv(ctx.loaded, input_ids.tolist(), query_rows=rows)
            report["reference_s"] = time.perf_counter() - started
        return report

    # ------------------------------------------------------------------ the plan
    def prefill_plan(
        self, ctx: GenerationContext, input_ids: torch.Tensor, segments: tuple[Segment, ...] | None
    ) -> PrefillPlan:
        segments = self._require_segments(segments)
        self.plan = ReusePrefill(ctx, self, input_ids, segments)
        return self.plan

    def after_request(self, ctx: GenerationContext, segments: tuple[Segment, ...] | None) -> None:
        """With :attr:`fills_store`: write the K/V this request computed for the spans the store lacked
        (outside any measured time; see the module docs)."""
        self._filled = None
        if self.fills_store and self.plan is not None:
            self._filled = self.plan.fill_store()

    def release(self) -> None:
        super().release()
        self.plan = None

    def initial_rows(self, plan: ReusePrefill) -> np.ndarray | list[int] | torch.Tensor:
        """Positions of the rows computed at layer 0, host ints (default: the query rows and every uncached
        row)."""
        return plan.uncached

    def cache_layers(self, plan: ReusePrefill) -> range:
        """The layers whose cached rows are expected to be installed, in order (what the pipelined
        loader prefetches; default: every layer). A wrong guess costs a wasted or a waited-for load,
        never a wrong result: :meth:`needs_cache_at` decides."""
        return range(plan.ctx.spec.n_layers)

    def needs_cache_at(self, plan: ReusePrefill, layer: int) -> bool:
        """Whether cached rows are installed before ``layer`` (default: unless every row is recomputed)."""
        return plan.rows.count < plan.n

    def on_layer(
        self, plan: ReusePrefill, layer: int, fresh_v: torch.Tensor
    ) -> torch.Tensor | np.ndarray | list[int] | None:
        """Called at each layer with the active rows' fresh V (``[kv_heads, t, d]``) before they overwrite
        the cached rows; return indices into the active rows (``plan.rows``) that stay active after this
        layer — host ints, or a tensor, which the plan reads once (a device tensor: the shrink's one host
        read) — or None."""
        return None

    def expects_reuse(self) -> bool:
        """Whether this configuration must reuse at least one cached row (the guard below)."""
        return self.must_reuse

    def telemetry(self) -> dict[str, Any]:
        """The chunk store's configuration and cumulative per-tier figures (hits, bytes, measured MB/s)."""
        report: dict[str, Any] = {"store": self.chunk_store().summary()}
        if self._filled is not None:  # chunks this request computed in its prefill and stored after it
            report["filled"] = self._filled
        return report

    def check_after_prefill(self, ctx: GenerationContext) -> None:
        report = ctx.telemetry.prefill_plan
        if report and report.get("missed_chunks") and not report.get("chunks"):
            return  # every span missed and was computed in the prefill (a full miss): nothing to reuse
        if report and self.expects_reuse() and report.get("reused_tokens", 0) == 0:
            raise CompressionNotApplied(
                f"method {self.name} was asked to reuse cached K/V but recomputed every token",
                "this is a bug in the method; report it with the run's config.yaml",
            )
