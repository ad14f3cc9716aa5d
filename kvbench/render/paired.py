"""``paired`` and ``agreement``: each run against a baseline run on the same samples (:mod:`kvbench.render`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvbench.render.frames import Section, against_baseline, select, values
from kvbench.render.text import fmt, table_section


def render_paired(exp: Any, spec: Mapping[str, Any], runs: Any, samples: Any) -> list[Section]:
    """``paired``: every run against the ``baseline`` run of its group, on their common samples."""
    import pandas as pd

    from kvbench.stats import paired

    if runs.empty or samples is None or samples.empty:
        return [Section(spec.get("title") or "paired comparison", markdown="(no finished runs yet)")]
    value = spec.get("value", "score")
    split, by = list(spec.get("split", ["model"])), list(spec.get("by", ["method", "budget"]))
    match = list(spec.get("match", []))
    frame = select(samples, spec.get("where"))
    # the row keys come from the run (samples carry the config but not the run's budget label)
    by_run = {k: dict(zip(runs["run_id"], values(runs, k))) for k in by}
    out = []
    for label, run_id, run, base in against_baseline(frame, split, spec["baseline"], match):
        a = run.set_index("id")[value].dropna()
        b = base.set_index("id")[value].dropna()
        common = [i for i in a.index if i in b.index]
        if not common:
            continue
        result = paired([float(a[i]) for i in common], [float(b[i]) for i in common])
        ci = "–" if result.ci_low is None else f"[{result.ci_low:+.2f}, {result.ci_high:+.2f}]"
        out.append(
            {
                **({"split": label} if split else {}),
                **{k: by_run[k].get(run_id, values(run, k).iloc[0]) for k in by},
                "n": result.n,
                "mean": fmt(result.mean_a, measured=True),
                "baseline": fmt(result.mean_b, measured=True),
                "Δ": f"{result.diff:+.2f}",
                "95% CI of Δ": ci,
                "p": "–" if result.p is None else f"{result.p:.3g}",
                "test": result.test
                + (f" ({result.a_only}/{result.b_only} discordant)" if result.test == "mcnemar" else ""),
            }
        )
    title = (
        spec.get("title") or f"paired against {', '.join(f'{k}={v}' for k, v in spec['baseline'].items())} ({value})"
    )
    if not out:
        return [Section(title, markdown="(no pairs: the runs share no samples with the baseline)")]
    table = pd.DataFrame(out)
    return [table_section(title, table)]


def render_agreement(exp: Any, spec: Mapping[str, Any], runs: Any, samples: Any) -> list[Section]:
    """``agreement``: see :mod:`kvbench.agreement`."""
    from kvbench.agreement import render_agreement as render

    return render(exp, spec, runs, samples)
