"""The ``tune`` render item: a method parameter tuned against a validation target, the way Cache-Craft's
α is ("minimise recomputation subject to validation quality >= a target", research/seed-cachecraft.md).

Each run of the experiment that is not the baseline is one value of ``over`` (say ``alpha``); per run:
its ``cost`` (a run-level column, e.g. ``compute_ratio``: prefill token-layers computed / n x layers) and
its ``quality`` against the baseline run on the same samples — ``rouge_l_f1``, ``jaccard`` or
``exact_pct`` of its answers against the baseline's (:mod:`kvbench.agreement`), or ``score_ratio`` (its
mean task score over the baseline's on the paired samples). The tuned value is the one of lowest cost
among those whose quality reaches ``target``, read from the quality's point estimate and said as such;
with the lower end of its 95 % interval also reported, a reader sees how sure the choice is. No value
meeting the target is a result too, and says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvbench.errors import ConfigError

QUALITIES = ("rouge_l_f1", "jaccard", "exact_pct", "score_ratio")


def check(options: Mapping[str, Any]) -> None:
    """A ``tune`` item names its baseline, the tuned key, a cost column, a quality and a target."""
    if not isinstance(options.get("baseline"), Mapping) or not options["baseline"]:
        raise ConfigError("tune: baseline must select the baseline run", "e.g. baseline: {method: full}")
    for key in ("over", "cost"):
        if not isinstance(options.get(key), str) or not options[key]:
            raise ConfigError(f"tune: {key} must name a column", "e.g. over: alpha, cost: compute_ratio")
    if options.get("quality") not in QUALITIES:
        raise ConfigError(
            f"tune: quality {options.get('quality')!r} is not one of {', '.join(QUALITIES)}", "fix quality"
        )
    target = options.get("target")
    if isinstance(target, bool) or not isinstance(target, int | float):
        raise ConfigError(f"tune: target {target!r} is not a number", "e.g. target: 0.8")


def _quality(run: Any, base: Any, quality: str) -> tuple[float, float | None, int]:
    """(mean, lower end of its 95 % bootstrap interval, paired samples) of ``run`` against ``base``."""
    import numpy as np

    from kvbench.agreement import compare
    from kvbench.stats import bootstrap_mean

    if quality == "score_ratio":
        ours = dict(zip(run["id"].astype(str), run["score"]))
        theirs = dict(zip(base["id"].astype(str), base["score"]))
        common = [i for i in ours if i in theirs and not _nan(ours[i]) and not _nan(theirs[i])]
        if not common or not sum(float(theirs[i]) for i in common):
            return math.nan, None, len(common)
        scores = np.array([[float(ours[i]), float(theirs[i])] for i in common])
        mean = float(scores[:, 0].sum() / scores[:, 1].sum())
        rng = np.random.default_rng(0)
        draws = rng.integers(0, len(scores), size=(2000, len(scores)))
        sums = scores[draws].sum(axis=1)
        ratios = sums[:, 0] / np.where(sums[:, 1] == 0, np.nan, sums[:, 1])
        return mean, float(np.nanpercentile(ratios, 2.5)), len(common)
    pairs = compare(run, base)
    if not pairs:
        return math.nan, None, 0
    field = {"rouge_l_f1": "rouge_l", "jaccard": "jaccard", "exact_pct": "exact"}[quality]
    scale = 100.0 if quality == "exact_pct" else 1.0
    values = np.array([scale * getattr(p, field) for p in pairs])
    ci = bootstrap_mean(values)
    return float(values.mean()), (ci[0] if ci else None), len(pairs)


def _nan(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def tuned(rows: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The row of lowest ``cost`` among those whose ``quality`` reaches ``target`` (ties: the first)."""
    meeting = [r for r in rows if not _nan(r["quality"]) and r["quality"] >= target and not _nan(r["cost"])]
    return min(meeting, key=lambda r: r["cost"]) if meeting else None


def render_tune(exp: Any, spec: Mapping[str, Any], runs: Any, samples: Any) -> list[Any]:
    """``tune``: per value of ``over`` its cost and quality against the baseline, and the tuned value."""
    import pandas as pd

    from kvbench.render.frames import Section, against_baseline, select, values
    from kvbench.render.text import table_section

    over, cost, quality, target = spec["over"], spec["cost"], spec["quality"], float(spec["target"])
    title = spec.get("title") or f"{over} tuned: the lowest {cost} with {quality} >= {target:g}"
    if runs.empty or samples is None or samples.empty:
        return [Section(title, markdown="(no finished runs yet)")]
    costs = dict(zip(runs["run_id"], runs[cost])) if cost in runs.columns else {}
    labels = dict(zip(runs["run_id"], values(runs, over)))
    frame = select(samples, spec.get("where"))
    rows = []
    for _, run_id, run, base in against_baseline(frame, list(spec.get("split", [])), spec["baseline"], []):
        mean, low, n = _quality(run, base, quality)
        value = costs.get(run_id, math.nan)
        rows.append({over: labels.get(run_id, "–"), "n": n, "cost": value, "quality": mean, "low": low})
    if not rows:
        return [Section(title, markdown="(no pairs: the runs share no answered samples with the baseline)")]
    rows.sort(key=lambda r: math.inf if _nan(r["cost"]) else r["cost"])
    best = tuned(rows, target)
    shown = pd.DataFrame(
        [
            {
                over: r[over],
                "n": r["n"],
                cost: f"{r['cost']:.3f}",
                quality: f"{r['quality']:.3f}",
                "95 % lower end": "–" if r["low"] is None else f"{r['low']:.3f}",
                f">= {target:g}": "yes" if not _nan(r["quality"]) and r["quality"] >= target else "no",
            }
            for r in rows
        ]
    )
    if best is None:
        verdict = f"No value of {over} reaches {quality} >= {target:g}: none is tuned at this target."
    else:
        sure = ""
        if best["low"] is not None:
            side = "above" if best["low"] >= target else "below"
            sure = f" (its 95 % lower end, {best['low']:.3f}, is {side} the target)"
        verdict = f"Tuned: {over} = {best[over]}, {cost} {best['cost']:.3f}, {quality} {best['quality']:.3f}{sure}."
    note = (
        f"{verdict} Each run against the baseline ({', '.join(f'{k}={v}' for k, v in spec['baseline'].items())}) "
        f"on the samples both answered; quality by its point estimate, cost as the run reports it."
    )
    return [table_section(title, shown, pd.DataFrame(rows).to_csv(index=False), note=note)]
