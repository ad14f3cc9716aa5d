"""``chunk_scores``: do Cache-Craft's reusability scores predict how far a reused chunk is from a full
prefill? (Cache-Craft's experiment 3; :mod:`kvbench.render`)::

    - chunk_scores: {by: [method, cfo], deviation: [reused_v, blended_v]}

Reads every request of each run (``samples.jsonl``) that ran with ``profile.deviation``: each reused
chunk's scores from ``telemetry.method.cachecraft.chunks`` (the chunks whose action is ``reuse`` or
``fix``: a variant was read; a chunk computed in full has no reused K/V) joined on their first prompt
position ``begin`` with ``telemetry.prefill.deviation.chunks`` (:func:`kvbench.engine.reuse_deviation.deviation`):

* ``reused_v`` — the chunk's V as reused (the variant's, before any recompute) against the
  reference dense prefill: squared L2 over heads and dimensions, mean over the chunk's tokens and over
  every layer — the deviation the scores should predict;
* ``blended_v`` — the same V after the method's recompute — what the fix left.

For each run and deviation, the Spearman rank correlation over all its reused chunks (every request
of the stream, warm-up included: the warm-up only fills the store) against ``cci``, ``1 - beta'``,
``cci x (1 - beta')`` (CFO before alpha and the clamp) and the ``cfo`` used (constant, so no
correlation, when ``method.cfo`` forces it), with a 95 % percentile bootstrap interval over the chunks
and a two-sided permutation p-value (exact over every permutation up to 8 chunks, else
``resamples`` random ones; :func:`spearman`). Chunks recur in a stream, so the chunks are not
independent draws: the interval and p-value are conditional on the stream. A scatter of the deviation
against ``cci x (1 - beta')`` (one colour per run) is drawn for the first deviation.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.render.frames import Section, groups, select, values
from kvbench.render.text import table_section

#: the scores correlated with the deviation: column -> label
SCORES = {
    "cci": "CCI",
    "one_minus_beta_prime": "1 - beta'",
    "cci_x_one_minus_beta_prime": "CCI x (1 - beta')",
    "cfo": "CFO used",
}
DEVIATIONS = ("reused_v", "blended_v")
#: up to this many chunks the permutation p-value is exact (8! = 40,320 orders)
EXACT_UP_TO = 8


def ranks(x: Sequence[float] | np.ndarray) -> np.ndarray:
    """1-based ranks of ``x``, ties given their average rank."""
    data = np.asarray(x, dtype=float)
    order = np.argsort(data, kind="stable")
    _, first, inverse, counts = np.unique(data[order], return_index=True, return_inverse=True, return_counts=True)
    out = np.empty(len(data), dtype=float)
    out[order] = (first + (counts - 1) / 2 + 1)[inverse]
    return out


def _rho(rx: np.ndarray, ry: np.ndarray) -> float | None:
    """Pearson correlation of two rank vectors (None when either is constant)."""
    a, b = rx - rx.mean(), ry - ry.mean()
    denominator = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    return float((a * b).sum()) / denominator if denominator > 1e-12 else None


def spearman(x: Sequence[float], y: Sequence[float], resamples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Spearman's rank correlation of paired ``x``, ``y`` (average ranks for ties) with a 95 % percentile
    bootstrap interval over the pairs and a two-sided permutation p-value (the share of orders of ``y``
    whose |rho| reaches the observed one: every order up to :data:`EXACT_UP_TO` pairs, ``test: exact``;
    else ``resamples`` random orders plus the observed one, ``test: permutation``). ``rho`` is None
    below 2 pairs or when either side is constant (then no interval and no p-value)."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    n = len(xs)
    out: dict[str, Any] = {"n": n, "rho": None, "ci": None, "p": None, "test": None}
    if n < 2 or len(ys) != n:
        return out
    rx, ry = ranks(xs), ranks(ys)
    rho = _rho(rx, ry)
    if rho is None:
        return out
    out["rho"] = rho
    rng = np.random.default_rng(seed)
    boot = []
    for _ in range(resamples):
        pick = rng.integers(0, n, size=n)
        value = _rho(ranks(xs[pick]), ranks(ys[pick]))
        if value is not None:
            boot.append(value)
    if boot:
        out["ci"] = [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))]
    observed = abs(rho) - 1e-12
    if n <= EXACT_UP_TO:
        count = total = 0
        for order in itertools.permutations(range(n)):
            total += 1
            count += abs(_rho(rx, ry[list(order)]) or 0.0) >= observed
        out["p"], out["test"] = count / total, "exact"
    else:
        count = sum(abs(_rho(rx, rng.permutation(ry)) or 0.0) >= observed for _ in range(resamples))
        out["p"], out["test"] = (count + 1) / (resamples + 1), "permutation"
    return out


def chunk_rows(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per reused chunk of ``records`` (a run's requests): its request id, ``begin``, tokens,
    action, scores (:data:`SCORES`) and deviations (:data:`DEVIATIONS`). Requests without
    ``profile.deviation`` or without Cache-Craft's per-chunk telemetry give none."""
    rows = []
    for record in records:
        telemetry = record.get("telemetry") or {}
        deviation = (telemetry.get("prefill") or {}).get("deviation") or {}
        measured = {c["begin"]: c for c in deviation.get("chunks") or []}
        craft = ((telemetry.get("method") or {}).get("cachecraft") or {}).get("chunks") or []
        for chunk in craft:
            if chunk.get("action") not in ("reuse", "fix") or chunk.get("begin") not in measured:
                continue
            dev = measured[chunk["begin"]]
            cci, beta_prime = chunk.get("cci"), chunk.get("beta_prime")
            rows.append(
                {
                    "id": record.get("id"),
                    "begin": chunk["begin"],
                    "tokens": chunk.get("tokens"),
                    "action": chunk["action"],
                    "cci": cci,
                    "one_minus_beta_prime": None if beta_prime is None else 1.0 - beta_prime,
                    "cci_x_one_minus_beta_prime": None
                    if cci is None or beta_prime is None
                    else cci * (1.0 - beta_prime),
                    "cfo": chunk.get("cfo"),
                    **{name: dev.get(name) for name in DEVIATIONS},
                }
            )
    return rows


def _records(run: Mapping[str, Any]) -> list[dict[str, Any]]:
    from kvbench.results import RunDir

    dirs = run.get("shard_dirs")
    paths = dirs if isinstance(dirs, list) else [run["run_dir"]]
    return [record for path in paths for record in RunDir(Path(path)).records()]


def render_chunk_scores(exp: Any, spec: Mapping[str, Any], runs: Any, out_dir: Path, stem: str) -> list[Section]:
    """``chunk_scores``: see the module doc."""
    import pandas as pd

    title = spec.get("title") or "reused chunks: Spearman rank correlation of the deviation with the scores"
    if runs.empty:
        return [Section(title, markdown="(no finished runs yet)")]
    by = list(spec.get("by", ["method"]))
    deviations = list(spec.get("deviation") or DEVIATIONS)
    resamples = int(spec.get("resamples", 2000))
    table, points, raw = [], [], []
    for _, group in groups(select(runs, spec.get("where")), list(spec.get("split", []))):
        keys = {k: values(group, k) for k in by}
        for index, run in group.iterrows():
            label = " · ".join(f"{k}={keys[k][index]}" for k in by)
            chunks = chunk_rows(_records(run))
            raw += [{**{k: keys[k][index] for k in by}, **row} for row in chunks]
            for deviation in deviations:
                for score, name in SCORES.items():
                    pairs = [
                        (row[score], row[deviation])
                        for row in chunks
                        if row[score] is not None and row[deviation] is not None
                    ]
                    result = spearman([a for a, _ in pairs], [b for _, b in pairs], resamples=resamples)
                    table.append(
                        {
                            **{k: keys[k][index] for k in by},
                            "deviation": deviation,
                            "score": name,
                            "chunks": result["n"],
                            "rho": "–" if result["rho"] is None else f"{result['rho']:+.3f}",
                            "95% CI": "–"
                            if result["ci"] is None
                            else f"[{result['ci'][0]:+.2f}, {result['ci'][1]:+.2f}]",
                            "p": "–" if result["p"] is None else f"{result['p']:.3g}",
                            "test": result["test"] or "–",
                        }
                    )
            points.append(
                (
                    label,
                    [r["cci_x_one_minus_beta_prime"] for r in chunks],
                    [r[deviations[0]] for r in chunks],
                )
            )
    if not table:
        return [Section(title, markdown="(no runs)")]
    frame = pd.DataFrame(table)
    figures = []
    if any(xs for _, xs, _ in points):
        figures.append(_scatter(points, out_dir / f"{stem}.png", deviations[0]))
    note = None if raw else "no reused chunk with a measured deviation (profile.deviation off, or no variant reused)"
    return [
        table_section(title, frame, pd.DataFrame(raw).to_csv(index=False) if raw else None, note=note, figures=figures)
    ]


def _scatter(points: list[tuple[str, list[Any], list[Any]]], path: Path, deviation: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for label, xs, ys in points:
        kept = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
        if kept:
            ax.scatter([x for x, _ in kept], [y for _, y in kept], s=14, alpha=0.7, label=label)
    ax.set_xlabel("CCI x (1 - beta')")
    ax.set_ylabel(f"{deviation}: mean squared L2 per token and layer")
    ax.set_title("reused chunks: deviation from a full prefill vs Cache-Craft's score", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
