"""The parameters KV methods share (``method.<key>``): the bases a method's ``Params`` derives from.

A method declares its own parameters in its own module, next to its policy (``PQCacheParams`` in
``methods/pqcache.py``, ``PQCache.Params = PQCacheParams``), each field once: type, default, help, range.
:data:`kvbench.methods.PARAMS` maps ``method=<name>`` to them, read from the modules' sources by
:mod:`kvbench.declarations` without importing torch, so ``kvbench run`` rejects a bad ``method.*`` key
in about a second. The same declarations give Hydra its ``method`` config group
(:func:`kvbench.compose.register_method_configs`; there are no ``conf/method/*.yaml`` to drift), the
checks of ``kvbench run`` (unknown keys, wrong types and ranges, for every sweep point before anything
loads) and ``kvbench list methods``. This module imports nothing heavy: a declaration may derive from
its classes and use its ``Literal`` choices.

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


# ---------------------------------------------------------------------- retrieval


# ---------------------------------------------------------------------- reuse
@dataclass(frozen=True)
class ReuseParams(Params):
    """What every reuse method shares: how chunk caches are precomputed and the prefill's mask."""

    chunk_bos: bool = param(True, "precompute each chunk after the tokenizer's BOS (CacheBlend's code), else alone")
    mask: Literal["exact", "code"] = param(
        "exact", "causal mask of recomputed rows: exact (by position) | code (the released bottom-right-aligned mask)"
    )


# ---------------------------------------------------------------------- cachecraft (appended)


# ---------------------------------------------------------------------- random (appended)


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


def family_of(params: type) -> str:
    """A method's family from its parameter declaration (its class's ``family``, without importing it):
    ``reuse``, ``retrieval``, ``eviction`` (compressing: the bases with a sink) or ``dense``."""
    for base, name in ((ReuseParams, "reuse"), (RetrievalParams, "retrieval"), (SinkParams, "eviction")):
        if issubclass(params, base):
            return name
    return "dense"
