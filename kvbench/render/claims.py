"""``claims``: numbers the paper states in prose against ours, computed by an op (:mod:`kvbench.render`).

A claim computed from samples (``source: samples``) may name the key its two sides share
(``ours.paired: id``): the table then shows our 95 % paired bootstrap interval (:func:`claim_interval`)
and grades a one-sided claim whose bound lies inside it ``undecided`` (at this power)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvbench.render.frames import (
    RUN_LEVEL,
    Section,
    check_metric,
    column,
    groups,
    is_missing,
    long_frame,
    norm,
    rows_for,
    select,
    values,
)
from kvbench.render.paper import holds, paper_rows, paper_text, sided
from kvbench.render.text import fmt, table_section


def claim_value(frame: Any, spec: Mapping[str, Any]) -> float | None:
    """Our number for one claim (see ``claims`` in the module doc)."""
    import numpy as np

    op, metric = spec["op"], spec.get("metric", "score")
    scale = float(spec.get("scale", 1.0))

    def mean(selector: Any) -> float | None:
        rows = select(rows_for(frame, list(selector or {})), selector)
        name = column(rows, metric)
        vals = [float(v) for v in (rows[name] if name else []) if not is_missing(v)]
        return float(np.mean(vals)) if vals else None

    a = mean(spec.get("a"))
    if op == "value":
        result = a
    elif op in ("rel_gain_over_best", "gap_ratio"):
        among = select(rows_for(frame, list(spec.get("among") or {})), spec.get("among"))
        name = column(among, metric)
        best = max((float(v) for v in (among[name] if name else []) if not is_missing(v)), default=None)
        if op == "rel_gain_over_best":
            result = 100.0 * (a / best - 1.0) if a is not None and best else None
        else:
            b = mean(spec.get("b"))
            result = (a - best) / (a - b) if a is not None and b is not None and best is not None and a != b else None
    elif op == "max_diff":
        over = spec.get("over", "dataset")
        if RUN_LEVEL in frame.columns:  # over subsets: the subsets' rows, else the runs'
            frame = frame[~frame[RUN_LEVEL].astype(bool)] if over == "dataset" else frame[frame[RUN_LEVEL].astype(bool)]
        left, right = select(frame, spec.get("a")), select(frame, spec.get("b"))
        name_l, name_r = column(left, metric), column(right, metric)
        if name_l is None or name_r is None:
            return None
        a_map, b_map = _aligned(_by_key(left, over, name_l), _by_key(right, over, name_r))
        diffs = [
            float(np.mean(list(a_map[k].values()))) - float(np.mean(list(b_map[k].values())))
            for k in a_map
            if k in b_map and a_map[k] and b_map[k]
        ]
        result = max(diffs) if diffs else None
    else:
        b = mean(spec.get("b"))
        if a is None or b is None:
            return None
        if op == "ratio":
            result = a / b if b else None
        elif op == "diff":
            result = a - b
        elif op == "rel_diff":  # how far a is above b, relative to b (a deviation in %)
            result = 100.0 * (a - b) / b if b else None
        else:  # rel_gap: how far a is below b, relative to b
            result = 100.0 * (b - a) / b if b else None
    return None if result is None else result * scale


def _by_key(rows: Any, over: str, name: str, key: str | None = None) -> dict[str, dict[Any, float]]:
    """``over`` value -> {row key: value} of column ``name`` (the row's index without ``key``: one run per
    ``over`` value at run level; the sample ids with ``key``), missing values left out."""
    out: dict[str, dict[Any, float]] = {}
    keys = rows[key] if key else rows.index
    for where, k, value in zip(values(rows, over), keys, rows[name]):
        if not is_missing(value):
            out.setdefault(where, {})[k] = float(value)
    return out


def _aligned(a_map: dict[str, Any], b_map: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A side without the ``over`` key (full recompute has no recompute ratio; ``values`` gives "–") is
    one run: it meets every row of the other side."""
    if list(a_map) == [norm(None)]:
        a_map = dict.fromkeys(b_map, a_map[norm(None)])
    elif list(b_map) == [norm(None)]:
        b_map = dict.fromkeys(a_map, b_map[norm(None)])
    return a_map, b_map


def _max_diff_draws(frame: Any, spec: Mapping[str, Any], key: str, draws_of: Any) -> Any:
    """``max_diff`` recomputed on resamples of the sample ids every aligned ``over`` row shares: per
    resample, the largest difference of means a − b over the rows (``draws_of(n)``: the index draws)."""
    import numpy as np

    metric, over = spec.get("metric", "score"), spec.get("over", "dataset")
    left, right = select(frame, spec.get("a")), select(frame, spec.get("b"))
    name_l, name_r, key_l, key_r = column(left, metric), column(right, metric), column(left, key), column(right, key)
    if name_l is None or name_r is None or key_l is None or key_r is None:
        return None
    a_map, b_map = _aligned(_by_key(left, over, name_l, key_l), _by_key(right, over, name_r, key_r))
    rows = [k for k in a_map if k in b_map]
    shared = sorted(set.intersection(*(set(a_map[k]) & set(b_map[k]) for k in rows)), key=str) if rows else []
    if len(shared) < 2:
        return None
    draws = draws_of(len(shared))
    diffs = [
        np.array([a_map[k][i] for i in shared])[draws].mean(axis=1)
        - np.array([b_map[k][i] for i in shared])[draws].mean(axis=1)
        for k in rows
    ]
    return np.max(np.stack(diffs), axis=0)


def claim_interval(frame: Any, spec: Mapping[str, Any], resamples: int = 2000, seed: int = 0) -> list[float] | None:
    """95 % paired bootstrap interval of a claim computed from samples (``paired: <key>`` in ``ours``: the
    per-sample key both sides share, e.g. ``id``, so each side's sample of a request is resampled with the
    other's): the op (``rel_gap``, ``rel_diff``, ``ratio``, ``diff``; ``max_diff``: the largest difference over the
    aligned ``over`` rows, on the ids they all share) recomputed on the means of each resample of the
    keys both sides have (percentile method). ``None`` without ``paired``, for another op, or below two
    shared keys."""
    import numpy as np

    op, key = spec["op"], spec.get("paired")
    if not key or op not in ("rel_gap", "rel_diff", "ratio", "diff", "max_diff"):
        return None
    metric = spec.get("metric", "score")
    if op == "max_diff":
        rng = np.random.default_rng(seed)
        stats = _max_diff_draws(frame, spec, key, lambda n: rng.integers(0, n, size=(resamples, n)))
        if stats is None:
            return None
        low, high = np.percentile(stats * float(spec.get("scale", 1.0)), [2.5, 97.5])
        return [float(low), float(high)]

    def by_key(selector: Any) -> dict[Any, float]:
        rows = select(frame, selector)
        name, keys = column(rows, metric), column(rows, key)
        if name is None or keys is None:
            return {}
        return {k: float(v) for k, v in zip(rows[keys], rows[name]) if not is_missing(v)}

    a, b = by_key(spec.get("a")), by_key(spec.get("b"))
    shared = sorted(set(a) & set(b), key=str)
    if len(shared) < 2:
        return None
    av, bv = np.array([a[k] for k in shared]), np.array([b[k] for k in shared])
    draws = np.random.default_rng(seed).integers(0, len(shared), size=(resamples, len(shared)))
    ma, mb = av[draws].mean(axis=1), bv[draws].mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        if op == "ratio":
            stats = ma / mb
        elif op == "diff":
            stats = ma - mb
        else:
            stats = 100.0 * ((ma - mb) if op == "rel_diff" else (mb - ma)) / mb
    stats = stats[np.isfinite(stats)] * float(spec.get("scale", 1.0))
    if not len(stats):
        return None
    low, high = np.percentile(stats, [2.5, 97.5])
    return [float(low), float(high)]


def render_claims(
    exp: Any, spec: Mapping[str, Any], runs: Any, bench_rows: Any = None, samples: Any = None
) -> list[Section]:
    """``claims``: see the module doc (``source: samples`` computes from per-sample columns)."""
    import pandas as pd

    art, paper = paper_rows(exp, spec.get("compare"))
    if bench_rows is not None:
        frame = bench_rows
    elif spec.get("source") == "samples":
        frame = select(samples, spec.get("where")) if samples is not None and not samples.empty else pd.DataFrame()
    else:
        frame = select(long_frame(runs), spec.get("where")) if not runs.empty else pd.DataFrame()
    split = list(spec.get("split", ["model"] if bench_rows is None else []))
    if not frame.empty:
        for claim in spec.get("rows") or []:
            check_metric(frame, claim["ours"].get("metric", "score"))
    paired = any((claim.get("ours") or {}).get("paired") for claim in spec.get("rows") or [])
    out = []
    for label, group in groups(frame, split) if not frame.empty else [("", frame)]:
        for claim in spec.get("rows") or []:
            keys = {k: v for k, v in claim.items() if k not in ("ours", "sided")}
            match = paper
            for key, wanted in keys.items():
                if key in match.columns:
                    match = match[match[key].map(norm) == norm(wanted)]
            row = match.iloc[0].to_dict() if len(match) else None
            if row is not None and claim.get("sided"):  # the experiment grades it otherwise (its notes say why)
                row["sided"] = claim["sided"]
            ours = claim_value(group, claim["ours"]) if not group.empty else None
            interval = claim_interval(group, claim["ours"]) if not group.empty else None
            out.append(
                {
                    **({"split": label} if split else {}),
                    **{k: norm(v) for k, v in keys.items()},
                    "ours": fmt(ours, 3),
                    **(
                        {"95% CI": f"[{fmt(interval[0], 3)}, {fmt(interval[1], 3)}]" if interval else "–"}
                        if paired
                        else {}
                    ),
                    "paper": paper_text(row, 3) if row else "–",
                    "unit": (row or {}).get("unit") or "",
                    "sided": (sided(row) or "–").replace("_", " "),
                    "holds": holds(ours, row, interval),
                    "quote": (row or {}).get("quote") or "",
                }
            )
    table = pd.DataFrame(out)
    if table.empty:
        return [Section(spec.get("title") or "claims", markdown="(no claims)")]
    shown = table.drop(columns=["quote"])
    return [
        table_section(spec.get("title") or "the paper's stated numbers against ours", shown, table.to_csv(index=False))
    ]
