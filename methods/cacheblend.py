"""``cacheblend``: selective KV recompute over reused chunk caches (Yao et al., CacheBlend, EuroSys 2025).

Every chunk's K/V is cached once and reused, keys re-rotated to the chunk's position in the prompt;
what reuse misses is the *cross-attention* between chunks. CacheBlend recovers it by recomputing, on
every layer, the few tokens whose reused K/V deviate most from what a full prefill would give (the
"high-KV-deviation", HKVD, tokens), and reusing the rest.

**A chunk the store lacks** (``miss``). ``prefill`` (default; the paper §6: new chunks' KV "computed by
the LLM engine at runtime" and written to the store; LMCache's blender likewise computes every token it
did not retrieve and stores what it computed): the chunk's tokens are ordinary uncached rows of this
request's prefill, computed at every layer — never candidates of the HKVD selection, and ``r`` is a
share of the *reused* rows only — so a request that misses every chunk runs exactly the full prefill,
and its TTFT holds that computation and no separate precompute. After the answer (outside TTFT, as the
paper's store writes from a background thread) the K/V this request computed for the chunk — every
layer, the keys post-RoPE at its positions in this prompt — are stored under the chunk's key, which is
its tokens alone (the model and the mode ``prompt:<scope>``; no position, no context), with the entry's
start at the chunk's first position here. A later request finds it as the same chunk wherever the chunk
sits and whatever precedes it, and re-rotates the keys by the difference of positions, as for any
cached chunk. So a stored chunk carries the context of the request that first computed it (its
cross-attention to the chunks before it there), as in LMCache, not a chunk prefilled alone; the prefix
and (``suffix: last_token``) the query segment are stored the same way. The entries are this run's (one
scope per chunk store; a sweep's shared store is not used: :mod:`kvbench.methods.reuse`). ``precompute``
(kvbench's way before, the legacy value: every CacheBlend record ran it) prefills a missing chunk alone
(after BOS with ``chunk_bos``) before the request's clock, so TTFT never holds a miss's cost; a
cold-store request then costs that precompute plus the blended prefill (``prepared.precompute_s``).
Telemetry: ``prepared.precomputed_chunks`` / ``prepared.prefill_chunks`` (misses precomputed / left to
the prefill), ``prefill.missed_chunks`` and ``missed_tokens`` (computed in this prefill) and
``method.filled`` (those stored after the request, and any the store could not hold).

As run here (paper §4 and the authors' ``vllm_blend`` code; seed-cacheblend.md §1.4–1.6):

* layers ``0 .. check_layer - 1`` are prefilled in full for every row (layer 0's K/V cannot deviate:
  it depends on the token alone; the first layer whose K/V can deviate is 1, the code's single check
  layer);
* at ``check_layer`` every row's Q/K/V is computed; each token's KV deviation is the squared L2
  distance between its fresh V and its cached (reused) V, summed over heads and dimensions (the code's
  ``temp_diff``; ``deviation: k`` ranks by the post-RoPE K instead, as LMCache v1 does); the
  ``int(n_ctx · r)`` tokens with the largest deviation among the ``n_ctx`` non-query tokens stay
  active, with every query-segment token (``suffix: query``; the released QA scripts force only the
  last token, ``suffix: last_token``, and precompute the question's K/V like a chunk's, which is done
  here too, so a query row the check does not select keeps a real K/V); every row's fresh K/V is
  written at this layer; then, as the released code and LMCache do (``check_rows: selected``), only
  the selected rows go through attention, the output projection and the MLP — the query and residual
  are cut to them before attention. ``check_rows: all`` runs every row through the whole check layer
  (kvbench's behaviour before; the same selected rows' values to float rounding, more compute: every
  CacheBlend TTFT recorded before 2026-11-29 used it);
* gradual filtering (paper Fig. 9): with ``filter_ratios`` (one ratio per check layer, starting at
  ``check_layer``), the deviation at each later check layer is computed only on the rows still active,
  and the set narrows to the next ratio; the default ``[]`` derives ``[r]`` (one check, the code's
  behaviour); e.g. ``filter_ratios=[0.3,0.2,0.15]`` checks at layers 1, 2, 3;
* every later layer recomputes only the active rows: their Q/K/V, attention over all rows of the layer
  (the cached ones re-rotated) and the MLP; the other rows keep their reused K/V and have no hidden
  state beyond the last check (the residual stream shrinks — the TTFT saving);
* ``mask: exact`` (default) lets an active query at position p attend keys at positions ≤ p;
  ``mask: code`` is the released code's bottom-right-aligned mask (xFormers
  ``LowerTriangularFromBottomRightMask``), with which the i-th of m active queries attends the first
  ``n - m + i + 1`` rows, so some queries see later keys — an approximation, kept to reproduce it. It
  applies from the check layer on, as in the released code (whose check layer already attends with the
  selected queries only); with ``check_rows: all`` the check layer runs every row with the exact mask.
  Every figure in RESULTS.md was measured with ``mask: exact``;
* ``selection: random`` picks the recomputed tokens uniformly at random instead (the HKVD ablation of
  Fig. 6), seeded by ``seed``.

``recompute_ratio: 1.0`` recomputes everything and is token-identical to ``full``; ``0.0`` recomputes
only the query rows after the check layer. Pipelined loading (paper §5) is the reuse family's
(:mod:`kvbench.engine.reuse`, ``store.pipeline``).

**Loading controller** (paper §5.1, Fig. 10; ``controller: true``). Loading layer ``i + 1``'s cached
K/V hides behind recomputing layer ``i`` only while recompute takes at least as long as the load, so
the ratio can be raised for free up to where the two are equal. :class:`LoadingController` takes
measured costs (:class:`Costs`) and, per request of ``n`` tokens of which ``n_cached`` come from
caches, compares per-layer times (the paper's footnotes 5–6, both per layer, like for like):

* ``T_recompute(r) = r · n · c`` with ``c`` the per-token, per-layer prefill cost of this model on this
  machine (``Prefill(n) / (n · layers)``, a dense prefill measured once per run, the best of two);
* ``T_load(tier) = bytes_per_token_layer · n_cached / throughput(tier)``, the throughput of each tier
  measured by :func:`kvbench.kv.chunks.measure_tiers` (RAM copy; cold, possibly throttled disk read);
* the ratio ``max(r_load, r*)`` with ``T_recompute(r_load) = T_load(served tier)`` and
  ``r* = recompute_ratio`` (the paper's 15 %), capped at 1; it replaces ``recompute_ratio`` for the
  request;
* the tier: the cheapest (disk, then RAM) with ``T_recompute(r*) ≥ T_load`` — storing there adds no
  delay — or the fastest when none qualifies. This is recorded as the controller's advice: where
  entries are stored is ``store.tier``, fixed for a run so that runs compare tiers one at a time.

Costs are measured once per run, at the first request and outside its TTFT
(``prepared.controller.measure_s``); the inputs, the per-layer times and the choice are recorded with
every sample (``telemetry.prepared.controller``). The cost model is linear in tokens (attention's
quadratic part is folded into ``c`` at the profiled length) and ignores that layers before the check
layer load nothing; ``kvbench bench reuse_pipeline`` compares its per-layer predictions with the
measured ones.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from kvbench.engine.reuse import CachedSpan, ReusePrefill
from kvbench.errors import ConfigError
from kvbench.methods import register
from kvbench.methods.params import ReuseParams
from kvbench.methods.reuse import ReuseMethod
from kvbench.params import param
from kvbench.requests import Segment, segment_spans

if TYPE_CHECKING:
    from kvbench.engine.context import GenerationContext

#: the store's tiers from the cheapest to the dearest per byte held (a throttled disk is the disk tier)
TIERS_BY_COST = ("disk", "ram")


@dataclass(frozen=True)
class Costs:
    """What the loading controller knows about this model on this machine (all measured)."""

    prefill_s: float  # a dense prefill of ``tokens`` tokens, all layers
    tokens: int
    n_layers: int
    bytes_per_token_layer: int  # K + V of one token in one layer, as cached
    tier_mbps: dict[str, float]  # load throughput of each tier, MB/s

    @property
    def token_layer_s(self) -> float:
        """Recompute cost of one token in one layer (s)."""
        return self.prefill_s / (self.tokens * self.n_layers)

    def recompute_layer_s(self, ratio: float, n: int) -> float:
        return ratio * n * self.token_layer_s

    def load_layer_s(self, tier: str, n_cached: int) -> float:
        return self.bytes_per_token_layer * n_cached / (self.tier_mbps[tier] * 1e6)


class LoadingController:
    """CacheBlend's loading controller (§5.1): the recompute ratio and the storage tier (see module docs)."""

    def __init__(self, costs: Costs, r_star: float) -> None:
        self.costs = costs
        self.r_star = r_star

    def choose(self, n: int, n_cached: int, served_from: str) -> dict[str, Any]:
        c = self.costs
        load = {tier: c.load_layer_s(tier, n_cached) for tier in c.tier_mbps}
        full_layer = c.recompute_layer_s(1.0, n)
        r_load = load[served_from] / full_layer if full_layer > 0 else 0.0
        ratio = min(1.0, max(r_load, self.r_star))
        at_r_star = c.recompute_layer_s(self.r_star, n)
        no_delay = [tier for tier in TIERS_BY_COST if tier in load and load[tier] <= at_r_star]
        tier = no_delay[0] if no_delay else max(c.tier_mbps, key=lambda t: c.tier_mbps[t])
        return {
            "ratio": ratio,
            "r_load": r_load,
            "r_star": self.r_star,
            "tier": tier,
            "tier_adds_delay": not no_delay,
            "served_from": served_from,
            "n": n,
            "n_cached": n_cached,
            "recompute_layer_s": {"r_star": at_r_star, "ratio": c.recompute_layer_s(ratio, n)},
            "load_layer_s": load,
        }


@dataclass(frozen=True)
class CacheBlendParams(ReuseParams):
    recompute_ratio: float = param(
        0.15,
        "r: share of the non-query tokens recomputed after the check layer "
        "(paper 0.15; code 0.16 musique, 0.18 wikimqa)",
        min=0,
        max=1,
    )
    check_layer: int = param(1, "first check layer (layer 0's KV cannot deviate)", min=0)
    filter_ratios: tuple[float, ...] = param(
        (),
        "gradual filtering: one ratio per check layer from check_layer on, non-increasing; () = (recompute_ratio,)",
        min=0,
        max=1,
    )
    selection: Literal["hkvd", "random"] = param("hkvd", "hkvd: largest V deviation | random (Fig. 6 ablation)")
    suffix: Literal["query", "last_token"] = param(
        "query", "rows always recomputed: the whole query | the last token (the released QA scripts)"
    )
    seed: int = param(0, "random selection seed")
    check_rows: Literal["selected", "all"] = param(
        "selected",
        "check layer: Q/K/V for every row, then attention, output projection and MLP for the selected rows "
        "(the released code, LMCache) | all: every row runs the whole check layer (kvbench before 2026-11)",
        legacy="all",
    )
    deviation: Literal["v", "k"] = param(
        "v", "KV deviation that ranks tokens: v (released code, LMCache v0) | k, post-RoPE (LMCache v1)", legacy="v"
    )
    controller: bool = param(
        False,
        "loading controller (paper 5.1): r = max(r_load, recompute_ratio) from the measured "
        "recompute and load costs; recompute_ratio is then the floor r*",
    )
    miss: Literal["prefill", "precompute"] = param(
        "prefill",
        "a chunk the store lacks: prefill (computed in the request's prefill, then stored for later "
        "requests: the paper, LMCache) | precompute (prefilled alone before the request, outside TTFT: "
        "every CacheBlend run before 2026-11-30)",
        legacy="precompute",
    )

    def validate(self) -> None:
        ratios = list(self.filter_ratios)
        if any(b > a for a, b in zip(ratios, ratios[1:])):
            raise ConfigError(
                f"method.filter_ratios={ratios} must not increase", "e.g. method.filter_ratios=[0.3,0.2,0.15]"
            )
        if self.controller and ratios:
            raise ConfigError(
                "method.controller picks one recompute ratio, so it cannot follow method.filter_ratios",
                "drop method.filter_ratios, or set method.controller=false",
            )


@register
class CacheBlend(ReuseMethod):
    name = "cacheblend"

    Params = CacheBlendParams
    params: CacheBlendParams

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)
        p = self.params
        self.ratios = [float(r) for r in p.filter_ratios] or [p.recompute_ratio]
        #: the loading controller's measured inputs (set before the first request to inject them)
        self.costs: Costs | None = None
        self._measure_s = 0.0

    # ------------------------------------------------------------------ loading controller
    def prepare(
        self, ctx: GenerationContext, input_ids: torch.Tensor, segments: tuple[Segment, ...] | None
    ) -> dict[str, Any]:
        report = super().prepare(ctx, input_ids, segments)
        if not self.params.controller:
            return report
        assert segments is not None
        n = int(input_ids.numel())
        spans = self.cached_segments(ctx, segments)
        store = self.chunk_store()
        # what is loaded: the held spans (with miss: prefill, the missed ones are computed instead)
        n_cached = sum(span.end - span.begin for span in spans if store.contains(span.key) is not None)
        if self.costs is None:
            started = time.perf_counter()
            chunk_tokens = sum(span.end - span.begin for span in spans) // max(1, len(spans))
            self.costs = measure_costs(ctx, input_ids, store.config, chunk_tokens=max(1, chunk_tokens))
            self._measure_s = time.perf_counter() - started
        choice = LoadingController(self.costs, self.params.recompute_ratio).choose(n, n_cached, store.config.tier)
        self.ratios = [choice["ratio"]]
        report["controller"] = {
            **choice,
            "costs": {**asdict(self.costs), "token_layer_s": self.costs.token_layer_s},
            "measure_s": self._measure_s,
        }
        return report

    @property
    def check_layers(self) -> dict[int, float]:
        return {self.params.check_layer + i: r for i, r in enumerate(self.ratios)}

    def expects_reuse(self) -> bool:
        return self.ratios[-1] < 1.0

    def cached_segments(self, ctx: GenerationContext, segments: tuple[Segment, ...]) -> list[CachedSpan]:
        """The prefix and every chunk; with ``suffix: last_token`` the query segment too, cached like a
        chunk (the released QA scripts precompute the question's K/V as they do the documents'), so that
        a query row the check layer does not select keeps a real K/V, as every other reused row does."""
        spans = super().cached_segments(ctx, segments)
        if self.params.suffix != "last_token":
            return spans
        for segment, (begin, end) in zip(segments, segment_spans(segments)):
            if segment.role == "query" and end > begin:
                spans.append(CachedSpan(begin, end, self.chunk_key(ctx, segment, begin)))
        return sorted(spans, key=lambda span: span.begin)

    def initial_rows(self, plan: ReusePrefill) -> np.ndarray:
        return np.arange(plan.n)

    def cache_layers(self, plan: ReusePrefill) -> range:
        """Cached rows are installed from the first check layer on (the layers before it run in full)."""
        return range(min(self.check_layers), plan.ctx.spec.n_layers)

    def needs_cache_at(self, plan: ReusePrefill, layer: int) -> bool:
        return layer in self.check_layers or plan.rows.count < plan.n

    def on_layer(self, plan: ReusePrefill, layer: int, fresh_v: torch.Tensor) -> torch.Tensor | np.ndarray | None:
        """At a check layer, the rows that stay active: the forced ones (the query, or the last token) and
        the ``k`` candidates with the largest KV deviation. ``k`` and both index lists are planned on the
        host from the request; the deviations, their top-k and the kept rows stay on the device, and the
        plan reads the kept rows back once (:meth:`ReusePrefill._shrink`)."""
        ratio = self.check_layers.get(layer)
        if ratio is None or not plan.spans:  # (nothing cached: every span missed, all rows are computed)
            return None
        if self.params.suffix == "last_token":
            always = np.arange(plan.n) == plan.n - 1
        else:
            always = plan.query_flags
        # rows of a span the store missed (miss: prefill) have no cached K/V: they stay active at every
        # layer, and r counts the reused rows only (LMCache's blender: every row it did not retrieve, plus
        # r of the retrieved ones); with no miss this is the released code's count
        missed = ~plan.cached_flags & ~always
        n_ctx = plan.n - int(always.sum()) - int(missed.sum())
        positions = plan.rows.positions
        forced_flags = always[positions] | missed[positions]
        forced = np.flatnonzero(forced_flags)
        candidates = np.flatnonzero(~forced_flags)
        k = min(int(n_ctx * ratio), len(candidates))
        if self.params.selection == "random":
            generator = torch.Generator().manual_seed(self.params.seed + layer)
            drawn = torch.randperm(len(candidates), generator=generator)[:k].tolist()  # (host: no device read)
            return np.sort(np.concatenate([candidates[drawn], forced]))
        if self.params.deviation == "k":
            fresh, cached = plan.fresh_keys(layer), plan.cached_keys(layer)
        else:
            fresh, cached = fresh_v, plan.cached_values(layer)
        assert cached is not None
        deviation = (fresh.float() - cached.float()).pow(2).sum(dim=(0, 2))
        plan.deviations[layer] = deviation
        among = plan.device_index(candidates)
        chosen = among[torch.topk(deviation[among], k).indices] if k else among[:0]
        keep = torch.cat([chosen, plan.device_index(forced)])
        return torch.sort(keep).values


def measure_costs(ctx: GenerationContext, input_ids: torch.Tensor, store_config: Any, *, chunk_tokens: int) -> Costs:
    """The controller's inputs on this machine: a dense prefill of ``input_ids`` (the best of two) and
    each tier's throughput for chunks of ``chunk_tokens`` tokens shaped like this model's."""
    from kvbench.engine.generate import prefill_kv
    from kvbench.kv.chunks import measure_tiers

    ids = input_ids.tolist()
    best = float("inf")
    for _ in range(2):
        started = time.perf_counter()
        prefill_kv(ctx.loaded, ids)
        best = min(best, time.perf_counter() - started)
    spec = ctx.spec
    dtype = next(ctx.model.parameters()).dtype
    element = torch.empty(0, dtype=dtype).element_size()
    tiers = measure_tiers(
        store_config,
        kv_heads=spec.n_kv_heads,
        tokens=chunk_tokens,
        head_dim=spec.head_dim,
        layers=min(4, spec.n_layers),
        dtype=dtype,
        device=spec.device,
    )
    return Costs(
        prefill_s=best,
        tokens=len(ids),
        n_layers=spec.n_layers,
        bytes_per_token_layer=2 * spec.n_kv_heads * spec.head_dim * element,
        tier_mbps={tier: row["mbps"] for tier, row in tiers.items()},
    )
