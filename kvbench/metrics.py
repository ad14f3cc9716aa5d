"""A run's figures from its sample records: ``metrics.json`` and the per-request quantities behind it.

:func:`summarise` is what the runner writes as ``metrics.json`` after every sample, and what
:mod:`kvbench.results` recomputes from ``samples.jsonl`` when the two disagree or shards merge: one
definition of every figure, imported by both (neither imports the other for it).
"""

from __future__ import annotations

from typing import Any

from kvbench.budget import BudgetConfig

#: telemetry keys whose mean over a run's samples ``metrics.json`` reports
TELEMETRY_MEANS = (
    "ttft_s",
    "tt2t_s",
    "tpot_s",
    "tpot_p50_s",
    "tpot_p90_s",
    "prefill_s",
    "decode_s",
    "recall",
    "kv_bytes_ratio",
    "kv_bytes_after_prefill",
    "kv_bytes_full",
    "bytes_h2d",
    "bytes_h2d_fetch",
    "bytes_h2d_index",
    "bytes_h2d_cache_fill",
    "bytes_h2d_index_per_step",
    "bytes_h2d_kv_per_step",
    "select_s",
    "fetch_s",
    "compute_s",
    "prompt_tokens",
    "new_tokens",
    "prefill_shared",
)


def summarise(task: Any, method: Any, budget: BudgetConfig, records: list[dict[str, Any]]) -> dict[str, Any]:
    """metrics.json: the task's aggregate, telemetry means, and what was compared."""
    import numpy as np

    metrics = task.aggregate(records)
    metrics["score_ci95"] = bootstrap_ci([r["score"] for r in records])
    for key in TELEMETRY_MEANS:
        values = [r["telemetry"].get(key) for r in records if r.get("telemetry", {}).get(key) is not None]
        metrics[key] = float(np.mean(values)) if values else None
    ratios = [prefill_compute_ratio(r) for r in records if not (r.get("meta") or {}).get("warmup")]
    known = [x for x in ratios if x is not None]
    metrics["compute_ratio"] = float(np.mean(known)) if known and len(known) == len(ratios) else None
    hits = sum(r["telemetry"].get("cache_hits", 0) for r in records)
    lookups = sum(r["telemetry"].get("cache_lookups", 0) for r in records)
    metrics["hit_rate"] = hits / lookups if lookups else None
    metrics["chunk_hit_rate"] = chunk_hit_rate(records)
    attended = [
        np.mean([a for a in r["telemetry"].get("attended_per_layer", []) if a is not None])
        for r in records
        if any(a is not None for a in r["telemetry"].get("attended_per_layer", []))
    ]
    metrics["attended_tokens"] = float(np.mean(attended)) if attended else None
    metrics["method"] = method.describe()
    metrics["budget"] = {
        **{k: getattr(budget, k) for k in budget.__dataclass_fields__},
        "label": method.budget_label(budget),
    }
    metrics["protocol"] = task.protocol()
    return metrics


def chunk_hit_rate(records: list[dict[str, Any]]) -> float | None:
    """The chunk store's hit rate of a reuse method (``chunk_hit_rate`` in metrics.json; not ``hit_rate``,
    the offloading methods' block-cache hits): chunks found in the store / chunks looked up, summed over
    the run's requests, a stream's warm-up requests left out (as ``compute_ratio``). Each request's
    ``telemetry.prepared.chunk_lookups`` / ``chunk_hits`` (``methods/reuse.py``'s ``chunk_lookups``):
    the prompt's chunk segments, and those whose cache the store held before the request — a chunk's
    own entry (CacheBlend, full reuse, Random-Recomp, Prefill-H2O), a stored prompt prefix containing
    it whole (prefix caching, Set-Cache), any variant of it (Cache-Craft, even one it then recomputes
    in full). ``None`` for methods without a chunk store (no request reports lookups)."""
    hits = lookups = 0
    for record in records:
        if (record.get("meta") or {}).get("warmup"):
            continue
        prepared = (record.get("telemetry") or {}).get("prepared") or {}
        if prepared.get("chunk_lookups") is not None:
            lookups += int(prepared["chunk_lookups"])
            hits += int(prepared.get("chunk_hits") or 0)
    return hits / lookups if lookups else None


def prefill_compute_ratio(record: dict[str, Any]) -> float | None:
    """The prefill computation of one request as a share of a dense prefill's (``compute_ratio`` in
    metrics.json: the mean over a run's requests, a stream's warm-up requests left out).

    One definition for every method: token-layers computed = rows computed through a layer (their Q/K/V
    computed), summed over the layers, plus, for each chunk cache precomputed *for this request* before
    its clock (a reuse method's ``miss: precompute``), its rows x layers; divided by ``n x L`` (prompt
    tokens x layers). A dense prefill (no reuse plan: full recompute, the eviction and retrieval methods)
    computes ``n x L``: exactly 1. A reuse plan's chunks missed and computed in the prefill (CacheBlend's
    ``miss: prefill``, Cache-Craft's new variants) are rows it computed, so they count; cached rows
    installed from the store do not. Prefix caching at a full hit computes its uncached rows only.
    ``None`` when a reuse record lacks the counts (records written before they existed)."""
    telemetry = record.get("telemetry") or {}
    if not telemetry:
        return None
    plan = telemetry.get("prefill")
    if not isinstance(plan, dict) or plan.get("recompute_ratio") is None:
        return 1.0  # a dense prefill
    n, layers = plan.get("tokens"), plan.get("layers")
    computed = plan.get("computed_token_layers")
    precomputed = (telemetry.get("prepared") or {}).get("precomputed_tokens")
    if not n or not layers or computed is None:
        return None
    if precomputed is None:
        if (telemetry.get("prepared") or {}).get("precomputed_chunks"):
            return None  # chunks precomputed for it, of unknown size
        precomputed = 0
    return (computed + precomputed * layers) / (n * layers)


def bootstrap_ci(scores: list[float], resamples: int = 2000, seed: int = 0) -> list[float] | None:
    """95% bootstrap interval of the mean sample score (percentile method); None below 2 scored samples
    (samples scored None, which have no gold answer, are left out)."""
    import numpy as np

    scores = [s for s in scores if s is not None]
    if len(scores) < 2:
        return None
    rng = np.random.default_rng(seed)
    values = np.asarray(scores, dtype=float)
    means = values[rng.integers(0, len(values), size=(resamples, len(values)))].mean(axis=1)
    return [round(float(np.percentile(means, 2.5)), 2), round(float(np.percentile(means, 97.5)), 2)]
