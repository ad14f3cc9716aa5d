"""Every shipped KV method's parameters (``method.<key>``), declared once: type, default, help, range.

Each method class points at its dataclass (``PQCache.Params = PQCacheParams``) and reads
``self.params``; :data:`PARAMS` maps ``method=<name>`` to it. The same declarations give Hydra its
``method`` config group (:func:`kvbench.compose.register_method_configs`; there are no
``conf/method/*.yaml`` to drift), the checks of ``kvbench run`` (unknown keys, wrong types and ranges
rejected for every sweep point before anything loads) and ``kvbench list methods``.

Why one module instead of a dataclass next to each method class: a method module imports torch,
which takes 2–5 s here, and ``kvbench run`` must reject a bad ``method.*`` key in about a second
(issue 14, item 10). This module imports nothing heavy, so the CLI validates without importing torch.
A new method adds its dataclass here and its name to :data:`PARAMS`; ``register`` refuses a shipped
method whose ``Params`` is not the one listed.

Defaults are explicit numbers, not "null: the class default": a run's ``config.yaml`` then records
the value it ran with (``sink: 16``), so when a default changes later an old run keeps its meaning
and a re-run of today's defaults gets a new run directory instead of mixing settings in one.
``budget.sink`` / ``budget.local`` still override ``sink`` / ``local_fraction`` for every method.

The ``Literal`` choices repeat the primitives' tuples (``GQA_REDUCTIONS``, ``POOLINGS``, ``GQA_RULES``,
k-means ``METRICS``/``INITS``, ``ROUNDINGS``), which live in torch modules; ``tests/test_params.py``
checks they agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvbench.errors import ConfigError
from kvbench.params import Params, param

GqaReduction = Literal["sum", "mean", "max"]  # attention_scores.GQA_REDUCTIONS (eviction methods)
GqaRule = Literal["softmax_sum", "logit_sum", "max"]  # primitives.pq.GQA_RULES (retrieval scoring)
HeadGranularity = Literal["per_query_head", "shared"]
HeadSelection = Literal["query_head", "kv_head"]  # eviction under GQA (KVCache-Factory's kv_cache_granularity)
KMeansInit = Literal["random", "kmeans++"]


# ---------------------------------------------------------------------- shared
@dataclass(frozen=True)
class SinkParams(Params):
    sink: int = param(32, "attention-sink tokens, always attended, outside the budget (budget.sink overrides)", min=0)


@dataclass(frozen=True)
class MethodParams(SinkParams):
    """What a compressing method's budget split needs (``KVMethod.Params``)."""

    local_fraction: float = param(
        0.5, "share of the budget that is the recent window (budget.local overrides)", min=0, max=1
    )


@dataclass(frozen=True)
class RetrievalParams(MethodParams):
    """What every retrieval method shares: the host tier, the device block cache, dense layers."""

    offload: bool = param(True, "middle tokens live in the host tier; selected ones are fetched")
    dense_layers: tuple[int, ...] = param((), "layers that attend every token", min=0)
    cache_tokens: int = param(0, "device block cache in tokens (0: none; only with offload)", min=0)
    cache_block: int = param(128, "tokens per cache block", min=1)
    cache_blocks: int | None = param(None, "blocks admitted per step, the most selected (null: the whole cache)", min=0)
    cache_policy: Literal["lfu", "lru"] = param("lfu", "block-cache replacement rule")


# ---------------------------------------------------------------------- eviction
@dataclass(frozen=True)
class StreamingLLMParams(MethodParams):
    sink: int = param(4, "the paper's 4 initial tokens; budget.sink=32 aligns with PQCache-style methods", min=0)
    local_fraction: float = param(1.0, "the whole budget is the sliding window", min=0, max=1)


@dataclass(frozen=True)
class H2OParams(MethodParams):
    sink: int = param(32, "PQCache's baseline code: 32 sinks outside the budget", min=0)
    local_fraction: float = param(0.5, "recent = heavy hitters = half the budget", min=0, max=1)
    gqa: GqaReduction = param("sum", "accumulated scores over a KV head's query heads: sum (authors) | mean | max")
    chunk: int = param(0, "prefill query rows per chunk of the accumulated-attention pass (0: automatic)", min=0)
    chunk_elements: int = param(1 << 23, "automatic chunks: attention entries at once (2**23: 32 MiB in fp32)", min=1)
    swap_remove: bool = param(True, "decode eviction in O(1) per step (false: order-keeping remove, copies)")


@dataclass(frozen=True)
class SnapKVParams(SinkParams):
    """No ``local_fraction``: the kept window is ``min(window, budget)`` (``budget.local`` overrides)."""

    sink: int = param(32, "the PQCache-table methods' 32 sinks (budget.sink=0: SnapKV's own)", min=0)
    window: int = param(32, "observation window = kept recent window (the authors' LongBench configs: 32)", min=1)
    kernel: int = param(7, "pooling kernel, odd (the authors' LongBench configs: 7; code default 5)", min=1)
    pooling: Literal["avg", "max"] = param(
        "max", "vote pooling (the authors' LongBench configs: max; code default avg)"
    )
    granularity: HeadSelection = param(
        "query_head",
        "query_head: every query head keeps its own tokens, K/V stored per query head (the authors' "
        "code) | kv_head: one set per KV head from votes reduced by method.gqa",
    )
    gqa: GqaReduction = param("sum", "granularity=kv_head: votes over a KV head's query heads: sum | mean | max")

    def validate(self) -> None:
        if self.kernel > 1 and self.kernel % 2 == 0:
            raise ConfigError(
                f"the pooling kernel must be odd, got method.kernel={self.kernel}",
                f"use method.kernel={self.kernel + 1} or {self.kernel - 1}",
            )


@dataclass(frozen=True)
class PyramidKVParams(SnapKVParams):
    window: int = param(8, "observation window = kept recent window (the authors' KVCache-Factory: 8)", min=1)
    kernel: int = param(7, "pooling kernel, odd (KVCache-Factory: 7)", min=1)
    pooling: Literal["avg", "max"] = param("max", "vote pooling (KVCache-Factory: max)")
    beta: float = param(20.0, "pyramid steepness: the top layer keeps C/beta, the bottom 2C - C/beta")
    rounding: Literal["exact", "authors"] = param(
        "authors",
        "authors: KVCache-Factory's floored step (up to (L-2)/2 more per layer than uniform) | "
        "exact: layers sum to L x C, the same KV as uniform (preset pyramidkv_equal)",
    )
    short_prompt_uniform: bool = param(True, "prompts shorter than 2C keep the uniform budget (authors' code)")

    def validate(self) -> None:
        super().validate()
        if self.beta <= 0:
            raise ConfigError(f"method.beta must be positive, got {self.beta}", "use e.g. method.beta=20")


# ---------------------------------------------------------------------- retrieval
@dataclass(frozen=True)
class OracleParams(RetrievalParams):
    gqa: GqaRule = param("softmax_sum", "group rule on exact scores: softmax_sum (PQCache's) | logit_sum | max")
    per_query_head: bool = param(False, "every query head picks its own tokens")
    offload: bool = param(False, "the Oracle reads every key, so its cache stays on the device")


@dataclass(frozen=True)
class SparQParams(RetrievalParams):
    r: int | None = param(None, "query components fetched; null: round(budget.comm_ratio * head_dim), >= 1", min=1)
    cache_blocks: int | None = param(32, "blocks admitted per step, the most selected (null: the whole cache)", min=0)


@dataclass(frozen=True)
class InfLLMParams(RetrievalParams):
    sink: int = param(32, "n_init: initial tokens always attended, outside the budget", min=0)
    block_size: int = param(128, "tokens per memory block", min=1)
    reps: int | None = param(
        None, "representatives per block; null: round(budget.comm_ratio * block_size), >= 1", min=1
    )
    cache_tokens: int = param(4096, "device block cache in tokens: 32 blocks (PQCache's setting)", min=0)
    cache_blocks: int | None = param(32, "blocks admitted per step, the most selected (null: the whole cache)", min=0)
    cache_policy: Literal["lfu", "lru"] = param("lru", "block-cache replacement rule (InfLLM: LRU)")


@dataclass(frozen=True)
class QuestParams(RetrievalParams):
    sink: int = param(0, "Quest keeps no sinks; 16 is ClusterKV's own setting (method.sink=16 to align with it)", min=0)
    local_fraction: float = param(0.0, "no window inside the budget: pages compete for all of it", min=0, max=1)
    dense_layers: tuple[int, ...] = param((0, 1), "layers that attend every token (Quest/ClusterKV: 0-1)", min=0)
    cache_blocks: int | None = param(32, "blocks admitted per step, the most selected (null: the whole cache)", min=0)
    page_size: int = param(16, "tokens per page", min=1)
    min_pages: int = param(3, "pages attended at least: max(min_pages, budget // page_size) (Quest's code: 3)", min=1)
    gqa: HeadGranularity = param("per_query_head", "each query head ranks pages | shared: one ranking per KV head")


#: PQCache's ``method.protocol``: the k-means iteration cap of the authors' script it names, which
#: ``method.kmeans_iters=null`` takes (``run_llama.sh``/``run_mistral.sh`` set ``MAX_ITER=0``, adaptive,
#: for every quality table; ``test_nah.py`` fixes 10). A run records ``protocol`` and ``kmeans_iters``
#: in its config.yaml, and the schedule it resolved to in every sample's telemetry.
PQCACHE_PROTOCOL_ITERS: dict[str, int | str] = {"pqcache": "adaptive", "pqcache_niah": 10}


@dataclass(frozen=True)
class PQCacheParams(RetrievalParams):
    sink: int = param(32, "the authors' code: 32 sinks outside the budget", min=0)
    local_fraction: float = param(0.5, "local = top-k = half the budget", min=0, max=1)
    cache_tokens: int = param(4096, "device block cache in tokens (the authors' 4096)", min=0)
    cache_blocks: int | None = param(32, "blocks admitted per step, the most selected (the authors' 32)", min=0)
    m: int | None = param(
        None, "PQ sub-spaces; null (with b): from budget.comm_ratio (2x6 at 1/128, 4x8 at 1/64)", min=1
    )
    b: int | None = param(None, "bits per code: 2**b centroids per sub-space; set with m", min=1, max=16)
    protocol: Literal["pqcache", "pqcache_niah"] = param(
        "pqcache",
        "the authors' script whose k-means schedule kmeans_iters=null takes: pqcache (their quality "
        "scripts, run_llama.sh/run_mistral.sh: adaptive) | pqcache_niah (their test_nah.py: 10 iterations)",
    )
    kmeans_iters: int | Literal["adaptive"] | None = param(
        None,
        "k-means iteration cap, or adaptive (the paper's cost model, fitted per machine on the k-means it "
        "governs); null: the protocol's (pqcache: adaptive, pqcache_niah: 10)",
        min=1,
    )
    kmeans_rules: Literal["sklearn", "fixed"] = param(
        "sklearn",
        "sklearn (the authors' scikit-learn KMeans): stop at tol 1e-4 or unchanged labels, an empty "
        "cluster takes the farthest point | fixed: exactly kmeans_iters updates, an empty cluster keeps its centroid",
    )
    kmeans_device: Literal["cpu", "model"] = param(
        "cpu",
        "cpu: host copies of the keys, clustered by CPU workers (the paper's Alg. 1) | model: batched "
        "k-means on the model's device (on a GPU, on its own stream)",
    )
    metric: Literal["l2", "ip", "cosine"] = param("l2", "k-means metric: l2 (authors' default) | ip | cosine")
    init: KMeansInit = param("random", "random points shared by all groups (authors') | kmeans++")
    gqa: GqaRule = param("softmax_sum", "group rule on approximate scores: softmax_sum (authors') | logit_sum | max")
    seed: int = param(4321, "k-means initialisation seed (the authors')")
    overlap: bool = param(True, "cluster on the workers while later layers compute (false: inside the prefill)")
    workers: int = param(
        1,
        "k-means worker threads of this method instance; a layer's KV heads x sub-spaces "
        "are split among them (the authors run h_kv*m processes)",
        min=1,
        max=512,
    )

    def validate(self) -> None:
        if (self.m is None) != (self.b is None):
            given, missing = ("m", "b") if self.m is not None else ("b", "m")
            raise ConfigError(
                f"method.{given}={getattr(self, given)} without method.{missing} (alone, it would be "
                "replaced by the comm_ratio default)",
                "set both, e.g. method.m=2 method.b=6, or neither",
            )


@dataclass(frozen=True)
class ClusterKVParams(RetrievalParams):
    sink: int = param(16, "always attended, never clustered, outside the budget", min=0)
    local_fraction: float = param(0.0, "no window: unclustered recent tokens are attended on top", min=0, max=1)
    dense_layers: tuple[int, ...] = param((0, 1), "layers that attend every token (ClusterKV: 0-1)", min=0)
    clusters: int | None = param(
        None, "prefill clusters; null: round((L - sink) / 80) (paper); authors' code: 400", min=1
    )
    kmeans_iters: int = param(20, "k-means iteration cap", min=1)
    until_stable: bool = param(True, "stop once no label changes (paper: until convergence)")
    metric: Literal["cosine", "l2", "ip"] = param("cosine", "k-means metric: cosine (paper) | l2 | ip")
    seed: int = param(42, "k-means initialisation seed")
    init: KMeansInit = param("random", "random key vectors (paper) | kmeans++ (the authors' accuracy code)")
    recluster_every: int = param(320, "decode tokens per incremental clustering", min=1)
    new_clusters: int = param(4, "clusters per recluster_every new tokens (paper; efficiency code: 8)", min=1)
    gqa: HeadGranularity = param("per_query_head", "each query head ranks clusters | shared: one ranking per KV head")
    cache_steps: int = param(1, "R: clusters selected in the last R steps count as device-resident", min=0)


# ---------------------------------------------------------------------- reuse
@dataclass(frozen=True)
class ReuseParams(Params):
    """What every reuse method shares: how chunk caches are precomputed and the prefill's mask."""

    chunk_bos: bool = param(True, "precompute each chunk after the tokenizer's BOS (CacheBlend's code), else alone")
    mask: Literal["exact", "code"] = param(
        "exact", "causal mask of recomputed rows: exact (by position) | code (the released bottom-right-aligned mask)"
    )


@dataclass(frozen=True)
class FullReuseParams(ReuseParams):
    pass


@dataclass(frozen=True)
class PrefixCacheParams(ReuseParams):
    warm: Literal["first_chunk", "prefix", "none"] = param(
        "first_chunk", "what earlier requests left cached: prefix + first chunk | the prefix | nothing"
    )
    store_prompts: bool = param(False, "store each prompt up to its last chunk after the request (request streams)")


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


#: ``method=<name>`` → its parameters. ``full`` has none: it attends everything, so a sink or a
#: window share would be a setting it silently ignores.
PARAMS: dict[str, type[Params]] = {
    "full": Params,
    "streamingllm": StreamingLLMParams,
    "h2o": H2OParams,
    "snapkv": SnapKVParams,
    "pyramidkv": PyramidKVParams,
    "oracle": OracleParams,
    "sparq": SparQParams,
    "infllm": InfLLMParams,
    "quest": QuestParams,
    "pqcache": PQCacheParams,
    "clusterkv": ClusterKVParams,
    "full_reuse": FullReuseParams,
    "prefix_cache": PrefixCacheParams,
    "cacheblend": CacheBlendParams,
}


# ---------------------------------------------------------------------- cachecraft (appended)
@dataclass(frozen=True)
class CacheCraftParams(ReuseParams):
    """Cache-Craft (``methods/cachecraft.py``; its docstring says which choices are the paper's and which ours)."""

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
    stats_block: int = param(1 << 22, "statistics pass: attention entries (head x row x key) computed at once", min=1)

    def validate(self) -> None:
        if self.chunk_bos:
            raise ConfigError(
                "method cachecraft precomputes no chunk alone, so method.chunk_bos has no meaning for it",
                "drop method.chunk_bos (or set it to false)",
            )


PARAMS["cachecraft"] = CacheCraftParams


# ---------------------------------------------------------------------- random (appended)
@dataclass(frozen=True)
class RandomParams(MethodParams):
    """The random-eviction control (``methods/random_eviction.py``; kvpress's ``RandomPress``)."""

    sink: int = param(0, "no sinks by default (RandomPress); budget.sink adds them", min=0)
    local_fraction: float = param(0.0, "no recent window by default: the whole budget is drawn", min=0, max=1)
    seed: int = param(0, "seed of the draw (with the layer index)", min=0)


PARAMS["random_eviction"] = RandomParams


# ---------------------------------------------------------------------- Cache-Craft's baselines (appended)
@dataclass(frozen=True)
class ChunkRecomputeParams(ReuseParams):
    """Full reuse plus a planned share of every chunk's tokens recomputed from layer 0 (no check layer):
    Cache-Craft's Random-Recomp and Prefill-H2O baselines (``methods/random_recomp.py``, ``methods/prefill_h2o.py``)."""

    recompute_ratio: float = param(
        0.15,
        "share of each chunk's tokens recomputed from layer 0: ceil(ratio x |C|) per chunk (0.15 as cacheblend)",
        min=0,
        max=1,
    )


@dataclass(frozen=True)
class RandomRecompParams(ChunkRecomputeParams):
    seed: int = param(0, "random selection seed (with the chunk's tokens: a chunk gets the same draw in every request)")


@dataclass(frozen=True)
class PrefillH2OParams(ChunkRecomputeParams):
    heads: Literal["mean", "max", "sum"] = param(
        "mean", "how the query heads' received-attention column sums are combined: mean | max | sum"
    )
    stats_block: int = param(1 << 22, "score pass: attention entries (head x row x key) computed at once", min=1)


@dataclass(frozen=True)
class SetCacheParams(PrefixCacheParams):
    store_prompts: bool = param(
        True, "store each served (reordered) prompt up to its last chunk after the request: what later requests hit"
    )


PARAMS["random_recomp"] = RandomRecompParams
PARAMS["prefill_h2o"] = PrefillH2OParams
PARAMS["set_cache"] = SetCacheParams
