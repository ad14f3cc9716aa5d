"""``cachecraft``: contextual chunk-caches fixed by recomputing a planned share of their tokens
(Agarwal et al., Cache-Craft, SIGMOD 2025, arXiv 2502.15734; no official code).

**Variants.** A chunk's K/V is kept as it was computed *inside a real request*, after the chunks that
preceded it there (its prefix S_old), at its positions in that prompt. One chunk may keep several
variants, one per distinct S_old (at most ``max_variants``); each is an entry of the reuse family's
chunk store (RAM/disk tiers, layer-wise preloading by :class:`~kvbench.engine.reuse.LayerLoader`)
under the mode ``ctx:<digest of the tokens before the chunk that are no chunk, and S_old>``, and the
method keeps its statistics beside it (in memory, :class:`Variant`).

**Statistics** (Eqs. 3-4), recorded while the prefill that creates the variant runs: at every layer,
the attention probabilities of the chunk's rows summed over each earlier chunk (``inter``), over the
chunk itself (``intra``, causal) and, per token, over all earlier chunks (the inter score). ``stats``
says how (the paper does not; both give the same statistics up to float rounding, a test pins it):

* ``recompute`` (default; the recorded runs'): a second pass recomputes the rows' probabilities in
  float32, row block by row block (:func:`kvbench.engine.attention_stats.segment_mass`, never a whole
  ``heads x n x n``), after the layer's K is written — kvbench's own cost, not the method's (at
  cpu scale about half of Cache-Craft's TTFT on the stream, §7b);
* ``attention``: the prefill's own attention returns them — the values get each chunk's one-hot
  membership as extra columns (:class:`kvbench.engine.attention.SegmentColumns`), so the softmax the
  layer computes anyway also sums each row's mass per chunk, at the cost of ``8 x ceil(chunks / 8)``
  more head-dimension columns in that one kernel (model dtype: bf16 on a GPU), no second pass.

Either way the time is in TTFT and reported apart as ``stats_s`` (for ``attention`` only the host-side
reduction; on a GPU host time, not synchronised).

**Planning** (before the request's clock, like the family's lookups; ``plan_s``): for each chunk of
the new prompt with prefix S_new, every held variant gets beta, gamma, beta' = beta (1 - gamma), its
CCI and ``CFO = clamp(alpha CCI (1 - beta'), 0, 1)`` (:mod:`kvbench.methods.primitives.cachecraft`);
the variant with the highest beta' is used (ties: the lower CFO, then the newer variant). Its
``ceil(CFO |C|)`` tokens with the highest stored inter score are recomputed from layer 0 with the
rest of the chunk reused (``initial_rows`` = query + uncached rows + selected tokens; no check layer);
``method.cfo`` forces the CFO of every chunk that has a variant. A chunk with no variant is computed
in full and becomes one. The exact ``prefix`` segment is the family's exact prefix cache.

**Adaptive early termination** (``stop_layer``, off by default): at layer ``stop_layer - 1`` the
question's attention to each chunk is measured (its rows' mass per chunk, mean over the query rows,
as a share of its attention to all chunks); a partially recomputed chunk below ``focus_mass`` is
"unfocused", and its recomputed tokens leave the active set after layer ``stop_layer`` (their K/V are
fresh up to that layer; deeper layers keep the variant's). One host read at that layer.

**Eviction** (``eviction``): ``frequency`` (default) sets the store's priority to
``(uses + 1) x tokens saved at the last use (|C| (1 - CFO)) / bytes`` — expected frequency x saving per
byte — protecting the variants the current request reads; ``lru`` keeps the store's LRU (the ablation).

**Telemetry** (``telemetry.method.cachecraft``, per request): for every chunk its action (``miss``:
no variant, computed in full; ``refresh``: CFO >= ``new_variant_cfo``, computed in full as a new
variant; ``full``: every token recomputed, not stored (the chunk holds ``max_variants``); ``fix``: its
selected tokens recomputed; ``reuse``: none), beta, gamma, beta', CCI, CFO, the
variant used, the variants held, its recomputed tokens and token-layers, whether it stopped early and
whether it was stored. Computation: ``recomputed_token_layers`` (rows computed x layers, query
included), ``context_token_layers`` (the same for non-query rows), ``full_token_layers`` (n x layers),
**``redundant_token_layers``** — our definition of the paper's "redundant computation": token-layers
spent on rows of chunks this method already computed in an earlier request — and a FLOPs estimate
``recompute_flops`` / ``full_flops``: per layer ``2 P m + 4 H d sum(position + 1)`` over the m computed
rows (P: a decoder layer's parameters; the second term QK and AV over the causal keys). Each chunk's
``begin`` (its first prompt position) joins it with ``profile.deviation``'s per-chunk entries
(``telemetry.prefill.deviation.chunks``). The store's hit counts are in ``telemetry.prepared``:
``chunk_lookups`` (the prompt's chunks), ``chunk_hits`` (chunks of which a variant was held, used or
not) and ``chunk_refreshed`` (of those, the ones computed in full anyway: ``refresh`` / ``full``).

**Choices where the paper is silent (ours, each a parameter or stated here):**

* ``CFO = alpha CCI (1 - beta')`` (one reimplementation's form; the paper fits f), ``alpha = 1``;
* ``heads = mean``: per-head masses averaged over the query heads; per-token scores: mean over layers;
* S_old and S_new contain only ``chunk`` segments: the prefix and the question are not chunks (their
  tokens are part of a variant's identity, not of beta or gamma); a chunk repeated in one prompt is a
  distinct item per occurrence;
* beta of a variant with empty S_old is 1 when S_new is empty too, else ``empty_beta`` (default 0: a
  variant made first in its prompt has seen none of the new prefix);
* a chunk whose best CFO reaches ``new_variant_cfo`` (default 0.5) is recomputed in full and kept as
  a new variant while it holds fewer than ``max_variants``; at the cap it is fixed with its CFO. Only
  chunks computed in full are stored: a partially fixed chunk is not stored back (its attention is
  exact only for the recomputed rows), and chunks computed in full never stop early;
* early termination's focus is the share of the question's attention to chunks (not to the prefix),
  with an absolute threshold ``focus_mass``;
* variant statistics live in the method's memory: a variant's K/V left on disk by an earlier run is
  not used without them;
* the frequency score counts uses since the variant was made (no decay).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from kvbench.engine.attention import SegmentColumns
from kvbench.engine.attention_stats import reduce_heads, segment_mass, segment_membership
from kvbench.engine.reuse import CachedSpan, ReusePrefill, store_request_rows
from kvbench.errors import ConfigError
from kvbench.kv.chunks import ChunkKey
from kvbench.methods import register
from kvbench.methods.params import ReuseParams
from kvbench.methods.primitives import cachecraft as cc
from kvbench.methods.reuse import ReuseMethod
from kvbench.params import param
from kvbench.requests import Segment, segment_spans

if TYPE_CHECKING:
    from kvbench.engine.context import GenerationContext

#: the store mode of a variant: ``ctx:`` and the digest of its context
VARIANT_MODE = "ctx:"
#: some active rows on the device: (their indices among the active rows, their prompt positions)
Rows = tuple[torch.Tensor, torch.Tensor]


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


@dataclass
class Variant:
    """One stored variant of a chunk: its store key, statistics and use counts."""

    key: ChunkKey
    stats: cc.VariantStats
    impact: float  # CCI
    scores: np.ndarray  # per-token inter score
    nbytes: int
    uses: int = 0
    last_cfo: float = 0.0

    def priority(self) -> float:
        """Expected frequency x saving per byte (see the module docs)."""
        return (self.uses + 1) * self.stats.length * (1.0 - self.last_cfo) / max(1, self.nbytes)


@dataclass
class ChunkPlan:
    """What one chunk of the prompt does in this request."""

    index: int  # among the prompt's chunks
    begin: int
    end: int
    digest: str  # the chunk's tokens
    label: str  # its identity in S_old / S_new (digest and occurrence)
    context: tuple[str, ...]  # labels of the chunks before it
    key: ChunkKey  # the variant this request would store for it
    held: int = 0  # variants held when planned
    variant: Variant | None = None
    beta: float | None = None
    gamma: float | None = None
    beta_prime: float | None = None
    cci: float | None = None
    cfo: float | None = None
    selected: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # prompt positions
    full: bool = False  # computed in full
    store: bool = False  # kept as a new variant after the request
    stopped: bool = False  # early termination dropped its selected tokens
    stored: bool = False

    @property
    def length(self) -> int:
        return self.end - self.begin

    @property
    def action(self) -> str:
        if self.full:
            return "miss" if self.variant is None else "refresh" if self.store else "full"
        return "fix" if self.selected.size else "reuse"

    def describe(self, token_layers: int) -> dict[str, Any]:
        def rounded(x: float | None) -> float | None:
            return None if x is None else round(float(x), 6)

        return {
            "index": self.index,
            "begin": self.begin,  # (joins telemetry.prefill.deviation.chunks, keyed by begin)
            "tokens": self.length,
            "action": self.action,
            "variant": self.variant.key.mode if self.variant is not None else None,
            "variants_held": self.held,
            "beta": rounded(self.beta),
            "gamma": rounded(self.gamma),
            "beta_prime": rounded(self.beta_prime),
            "cci": rounded(self.cci),
            "cfo": rounded(self.cfo),
            "recomputed_tokens": self.length if self.full else int(self.selected.size),
            "token_layers": token_layers,
            "stopped": self.stopped,
            "stored": self.stored,
        }


@dataclass(frozen=True)
class CacheCraftParams(ReuseParams):
    """Cache-Craft's parameters (the module docstring says which choices are the paper's and which ours)."""

    chunk_bos: bool = param(False, "unused: a variant is kept as computed inside a request (must stay false)")
    alpha: float = param(1.0, "alpha of CFO = alpha * CCI * (1 - beta'), clamped to [0, 1]", min=0)
    cfo: float | None = param(None, "force every cached chunk's CFO to this value (null: computed)", min=0, max=1)
    max_variants: int = param(5, "variants kept per chunk, one per distinct chunk prefix (paper's example: 5)", min=1)
    new_variant_cfo: float = param(
        0.5,
        "a chunk whose best variant's CFO is at least this is computed in full and kept as a new "
        "variant (while it has fewer than max_variants)",
        min=0,
        max=1,
    )
    empty_beta: float = param(
        0.0, "beta of a variant made with no earlier chunk, reused after some (0/0 in Eq. 6)", min=0, max=1
    )
    heads: Literal["mean", "max", "sum"] = param(
        "mean", "how the query heads' attention is combined in the statistics: mean | max | sum"
    )
    stop_layer: int | None = param(
        None,
        "adaptive early termination: unfocused chunks' recomputed tokens stop after this layer "
        "(the question's focus is read at the layer before); null: off",
        min=1,
    )
    focus_mass: float = param(
        0.1, "early termination: a chunk is unfocused below this share of the question's chunk attention", min=0, max=1
    )
    eviction: Literal["frequency", "lru"] = param(
        "frequency", "chunk store eviction: frequency (uses x tokens saved per byte) | lru (the ablation)"
    )
    stats: Literal["recompute", "attention"] = param(
        "recompute",
        "how the statistics are gathered: recompute (a float32 pass over the new variants' rows after "
        "each layer's K is written) | attention (extra value columns in the prefill's own attention: "
        "the same softmax, no second pass, the model's dtype)",
        legacy="recompute",
    )
    stats_block: int = param(1 << 22, "statistics pass: attention entries (head x row x key) computed at once", min=1)

    def validate(self) -> None:
        if self.chunk_bos:
            raise ConfigError(
                "method cachecraft precomputes no chunk alone, so method.chunk_bos has no meaning for it",
                "drop method.chunk_bos (or set it to false)",
            )


@register
class CacheCraft(ReuseMethod):
    name = "cachecraft"
    #: a request whose chunks all miss reuses nothing (with no prefix segment): not a bug
    must_reuse = False

    Params = CacheCraftParams
    params: CacheCraftParams

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)
        self.catalogue: dict[str, list[Variant]] = {}  # chunk digest -> variants
        self._by_key: dict[str, Variant] = {}  # store digest -> variant (the eviction score's lookup)
        self._seen: set[str] = set()  # chunks computed in earlier requests
        self._protected: set[str] = set()
        self._plans: list[ChunkPlan] = []
        self._report: dict[str, Any] = {}
        self._layer_params: int | None = None
        self._reset_request()

    def _reset_request(self) -> None:
        self._mass: list[torch.Tensor] = []  # per layer [stat rows, chunks] (device)
        self._focus: torch.Tensor | None = None
        self._layer_rows: list[np.ndarray] = []  # the rows computed at each layer (prompt positions)
        self._query_mask: np.ndarray | None = None
        self._rows_of: dict[str, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self._stat: np.ndarray | None = None
        self._segments_dev: torch.Tensor | None = None
        self._columns: SegmentColumns | None = None
        self._stats_s = 0.0
        self._plan_s = 0.0

    # ------------------------------------------------------------------ planning
    def _plan(self, ctx: GenerationContext, segments: tuple[Segment, ...]) -> list[ChunkPlan]:
        plans: list[ChunkPlan] = []
        lead: list[int] = []  # tokens before the chunk that belong to no chunk
        labels: list[str] = []
        counts: dict[str, int] = {}
        model = self._fingerprint(ctx)
        for segment, (begin, end) in zip(segments, segment_spans(segments)):
            if segment.role != "chunk":
                lead += list(segment.ids)
                continue
            digest = _digest(list(segment.ids))
            label = f"{digest}#{counts.get(digest, 0)}"
            counts[digest] = counts.get(digest, 0) + 1
            context = tuple(labels)
            key = ChunkKey(model, segment.ids, VARIANT_MODE + _digest([_digest(lead), list(context)]))
            chunk = ChunkPlan(len(plans), begin, end, digest, label, context, key)
            self._choose(chunk)
            plans.append(chunk)
            labels.append(label)
        return plans

    def _held(self, digest: str) -> list[Variant]:
        """The chunk's variants whose K/V the store still holds (the others are forgotten)."""
        store = self.chunk_store()
        held = []
        for variant in self.catalogue.get(digest, []):
            if store.contains(variant.key) is not None:
                held.append(variant)
            else:
                self._by_key.pop(variant.key.digest, None)
        if held:
            self.catalogue[digest] = held
        else:
            self.catalogue.pop(digest, None)
        return held

    def _choose(self, chunk: ChunkPlan) -> None:
        """The chunk's variant, its reusability figures and the tokens it recomputes."""
        p = self.params
        held = self._held(chunk.digest)
        chunk.held = len(held)
        best: tuple[tuple[float, float, int], Variant, tuple[float, float, float, float]] | None = None
        for order, variant in enumerate(held):
            b = cc.beta(variant.stats, chunk.context, empty=p.empty_beta)
            g = cc.kendall_gamma(variant.stats.context, chunk.context)
            bp = b * (1.0 - g)
            f = float(p.cfo) if p.cfo is not None else cc.cfo(p.alpha, variant.impact, bp)
            rank = (bp, -f, order)
            if best is None or rank > best[0]:
                best = (rank, variant, (b, g, bp, f))
        can_store = len(held) < p.max_variants or any(v.key == chunk.key for v in held)
        if best is None:
            chunk.full = chunk.store = True
            return
        _, variant, (b, g, bp, f) = best
        chunk.variant = variant
        chunk.beta, chunk.gamma, chunk.beta_prime, chunk.cci, chunk.cfo = b, g, bp, variant.impact, f
        count = cc.recompute_count(f, chunk.length)
        if (f >= p.new_variant_cfo and can_store) or count >= chunk.length:
            chunk.full = True
            chunk.store = can_store
            return
        chunk.selected = chunk.begin + cc.select_tokens(variant.scores, count)

    # ------------------------------------------------------------------ before the clock
    def prepare(
        self, ctx: GenerationContext, input_ids: torch.Tensor, segments: tuple[Segment, ...] | None
    ) -> dict[str, Any]:
        segments = self._require_segments(segments)
        store = self.chunk_store()
        store.priority = self._priority if self.params.eviction == "frequency" else None
        self._reset_request()
        started = time.perf_counter()
        self._plans = self._plan(ctx, segments)
        self._plan_s = time.perf_counter() - started
        self._protected = {c.variant.key.digest for c in self._plans if c.variant is not None and not c.full}
        report = super().prepare(ctx, input_ids, segments)  # the prefix's exact cache; variants touched, promoted
        report["chunk_mode"] = "contextual"
        report["plan_s"] = self._plan_s
        # the chunk store's hit rate (kvbench.runner's chunk_hit_rate): a chunk is a hit when the store
        # held a variant of it (any S_old), whether it was reused, fixed, or computed in full anyway
        # (refresh / full: counted also as chunk_refreshed)
        report["chunk_lookups"] = len(self._plans)
        report["chunk_hits"] = sum(c.variant is not None for c in self._plans)
        report["chunk_refreshed"] = sum(c.variant is not None and c.full for c in self._plans)
        return report

    def _priority(self, digest: str) -> float:
        if digest in self._protected:
            return math.inf
        variant = self._by_key.get(digest)
        return variant.priority() if variant is not None else math.inf  # (the prefix and others' entries: last)

    def precompute(self, ctx: GenerationContext, key: ChunkKey) -> None:
        if key.mode.startswith(VARIANT_MODE):
            raise RuntimeError(f"a cachecraft variant ({key.digest}) vanished from the store before the request")
        super().precompute(ctx, key)

    def release(self) -> None:
        super().release()
        if self.store is not None:
            self.store.priority = None  # (a store shared with later runs keeps its own LRU)

    # ------------------------------------------------------------------ the plan
    def cached_segments(self, ctx: GenerationContext, segments: tuple[Segment, ...]) -> list[CachedSpan]:
        """The exact prefix and every chunk reused from a variant (in full or in part)."""
        spans = []
        for segment, (begin, end) in zip(segments, segment_spans(segments)):
            if segment.role == "prefix" and begin == 0 and end > begin:
                spans.append(CachedSpan(begin, end, self.chunk_key(ctx, segment, begin)))
        for chunk in self._plans:
            if chunk.variant is not None and not chunk.full:
                spans.append(CachedSpan(chunk.begin, chunk.end, chunk.variant.key))
        return sorted(spans, key=lambda span: span.begin)

    def initial_rows(self, plan: ReusePrefill) -> np.ndarray:
        selected = [c.selected for c in self._plans if c.selected.size]
        return np.union1d(plan.uncached, np.concatenate(selected)) if selected else plan.uncached

    def _stat_positions(self) -> np.ndarray:
        """Prompt positions of the chunks stored as new variants (their statistics are recorded)."""
        if self._stat is None:
            ranges = [np.arange(c.begin, c.end) for c in self._plans if c.store]
            self._stat = np.concatenate(ranges) if ranges else np.zeros(0, dtype=np.int64)
        return self._stat

    def _key_segments(self, plan: ReusePrefill) -> torch.Tensor:
        if self._segments_dev is None:
            labels = np.full(plan.n, -1, dtype=np.int64)
            for chunk in self._plans:
                labels[chunk.begin : chunk.end] = chunk.index
            self._segments_dev = plan.device_index(labels)
        return self._segments_dev

    def _rows(self, plan: ReusePrefill, name: str, index: np.ndarray) -> Rows:
        """(indices among the active rows, prompt positions) of ``index`` on the device, made once per set
        of active rows (no copy per layer)."""
        found = self._rows_of.get(name)
        if found is None or found[0] is not plan.rows:
            found = (plan.rows, plan.device_index(index), plan.device_index(plan.rows.positions[index]))
            self._rows_of[name] = found
        return found[1], found[2]

    def _mass_of(self, plan: ReusePrefill, layer: int, query: torch.Tensor, rows: Rows, scaling: float) -> torch.Tensor:
        """Attention mass per chunk ``[rows, chunks]`` of the active ``rows`` (indices, positions)."""
        kv = plan.ctx.store[layer]
        return segment_mass(
            query[:, rows[0]],
            rows[1],
            kv.keys,
            kv.positions[0],
            self._key_segments(plan),
            len(self._plans),
            scaling,
            heads=self.params.heads,
            block_elements=self.params.stats_block,
        )

    def _measures(self, layer: int) -> tuple[bool, bool]:
        """Whether this layer records the new variants' statistics, and the question's focus."""
        stop = self.params.stop_layer
        focus = stop is not None and layer == stop - 1 and any(c.selected.size for c in self._plans)
        return bool(self._stat_positions().size), focus

    def observe_attention(self, plan: ReusePrefill, layer: int, query: torch.Tensor, scaling: float) -> None:
        """``stats: recompute``: record the new variants' statistics, and the question's focus before the
        stop layer, from a float32 pass over the rows' attention (:func:`segment_mass`)."""
        stat, focus = self._measures(layer)
        if self.params.stats != "recompute" or not (stat or focus):
            return
        started = time.perf_counter()
        positions = plan.rows.positions
        if stat:
            rows = self._rows(plan, "stats", np.searchsorted(positions, self._stat_positions()))
            self._mass.append(self._mass_of(plan, layer, query, rows, scaling))
        if focus:
            rows = self._rows(plan, "query", np.flatnonzero(plan.query_flags[positions]))
            self._focus = self._mass_of(plan, layer, query, rows, scaling).mean(dim=0)
        self._stats_s += time.perf_counter() - started

    def attention_segments(self, plan: ReusePrefill, layer: int) -> SegmentColumns | None:
        """``stats: attention``: the chunks as segments of this layer's own attention, when it measures."""
        if self.params.stats != "attention" or not any(self._measures(layer)):
            return None
        if self._columns is None:
            self._columns = SegmentColumns(segment_membership(self._key_segments(plan), len(self._plans)))
        return self._columns

    def observe_segment_mass(self, plan: ReusePrefill, layer: int, mass: torch.Tensor) -> None:
        """``stats: attention``: the statistics from the layer's attention mass ``[active rows, heads, chunks]``."""
        started = time.perf_counter()
        stat, focus = self._measures(layer)
        positions = plan.rows.positions
        if stat:
            rows = self._rows(plan, "stats", np.searchsorted(positions, self._stat_positions()))[0]
            self._mass.append(reduce_heads(mass[rows].float().transpose(0, 1), self.params.heads))
        if focus:
            rows = self._rows(plan, "query", np.flatnonzero(plan.query_flags[positions]))[0]
            self._focus = reduce_heads(mass[rows].float().transpose(0, 1), self.params.heads).mean(dim=0)
        self._stats_s += time.perf_counter() - started

    def on_layer(self, plan: ReusePrefill, layer: int, fresh_v: torch.Tensor) -> np.ndarray | None:
        """Early termination: at ``stop_layer``, drop the selected tokens of unfocused chunks."""
        self._layer_rows.append(plan.rows.positions)
        self._query_mask = plan.query_flags
        if layer != self.params.stop_layer or self._focus is None:
            return None
        mass = self._focus.double().cpu().numpy()  # (the one host read of the termination)
        total = float(mass.sum())
        share = mass / total if total > 0 else np.zeros_like(mass)
        drop = []
        for chunk in self._plans:
            if chunk.selected.size and not chunk.full and share[chunk.index] < self.params.focus_mass:
                chunk.stopped = True
                drop.append(chunk.selected)
        if not drop:
            return None
        return np.flatnonzero(~np.isin(plan.rows.positions, np.concatenate(drop)))

    # ------------------------------------------------------------------ after the request
    def after_request(self, ctx: GenerationContext, segments: tuple[Segment, ...] | None) -> None:
        if not self._plans:
            return
        stored = self._store_variants(ctx)
        for chunk in self._plans:
            if chunk.variant is not None and not chunk.full:
                chunk.variant.uses += 1
                chunk.variant.last_cfo = float(chunk.cfo or 0.0)
        self._report = self._account(ctx, stored)
        self._seen.update(chunk.digest for chunk in self._plans)
        self._protected = set()

    def _store_variants(self, ctx: GenerationContext) -> int:
        """Keep every chunk computed in full as a variant for its prefix, with its statistics (the rows
        this request computed, stored by the engine's :func:`~kvbench.engine.reuse.store_request_rows`)."""
        chunks = [c for c in self._plans if c.store]
        if not chunks or len(self._mass) != ctx.spec.n_layers:
            return 0
        mass = torch.stack(self._mass).double().cpu().numpy()  # [layers, stat rows, chunks]
        store = self.chunk_store()
        offset, stored = 0, 0
        for chunk in chunks:
            rows = mass[:, offset : offset + chunk.length]
            offset += chunk.length
            sizes = [c.length for c in self._plans[: chunk.index]]
            stats = cc.VariantStats.from_mass(rows, chunk.index, chunk.context, sizes)
            entry = store_request_rows(ctx, store, chunk.key, chunk.begin, chunk.end)
            if entry is None:
                continue
            variant = Variant(chunk.key, stats, cc.cci(stats), cc.token_scores(stats), entry.nbytes())
            others = [v for v in self.catalogue.get(chunk.digest, []) if v.key != chunk.key]
            self.catalogue[chunk.digest] = [*others, variant]
            self._by_key[chunk.key.digest] = variant
            chunk.stored = True
            stored += 1
        return stored

    def _decoder_params(self, ctx: GenerationContext) -> int:
        if self._layer_params is None:
            layers = getattr(getattr(ctx.model, "model", None), "layers", None)
            self._layer_params = sum(p.numel() for p in layers[0].parameters()) if layers else 0
        return self._layer_params

    def _account(self, ctx: GenerationContext, stored: int) -> dict[str, Any]:
        """The request's per-chunk figures and its computation (see the module docs)."""
        queries = self._query_mask if self._query_mask is not None else np.zeros(0, dtype=bool)
        n = len(queries)
        chunk_of = np.full(n, -1, dtype=np.int64)
        for chunk in self._plans:
            chunk_of[chunk.begin : chunk.end] = chunk.index
        redundant_flags = np.isin(chunk_of, [c.index for c in self._plans if c.digest in self._seen])
        spec, big = ctx.spec, self._decoder_params(ctx)
        per_chunk = np.zeros(len(self._plans), dtype=np.int64)
        computed = context = redundant = 0
        flops = 0.0
        for rows in self._layer_rows:
            inside = chunk_of[rows]
            per_chunk += np.bincount(inside[inside >= 0], minlength=len(self._plans))
            computed += len(rows)
            context += int((~queries[rows]).sum())
            redundant += int(redundant_flags[rows].sum())
            flops += 2.0 * big * len(rows) + 4.0 * spec.n_heads * spec.head_dim * float((rows + 1).sum())
        layers = spec.n_layers
        full_flops = layers * (2.0 * big * n + 4.0 * spec.n_heads * spec.head_dim * n * (n + 1) / 2)
        return {
            "chunks": [c.describe(int(per_chunk[c.index])) for c in self._plans],
            "eviction": self.params.eviction,
            "plan_s": self._plan_s,
            "stats_s": self._stats_s,
            "variants_stored": stored,
            "variants_held": sum(len(v) for v in self.catalogue.values()),
            "stopped_chunks": sum(c.stopped for c in self._plans),
            "recomputed_token_layers": computed,
            "context_token_layers": context,
            "redundant_token_layers": redundant,
            "full_token_layers": n * layers,
            "recompute_flops": flops,
            "full_flops": full_flops,
        }

    def telemetry(self) -> dict[str, Any]:
        return {**super().telemetry(), "cachecraft": self._report}
