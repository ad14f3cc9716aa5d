"""``kvbench report --paired COL=VALUE``: runs compared on the same samples against a baseline run.

Its own module (a face beside :mod:`kvbench.report`): it reads runs through the report's helpers and renders
with :mod:`kvbench.render.paired` and :mod:`kvbench.agreement`, whose tables use the report's markdown, so
living in :mod:`kvbench.report` would close an import cycle (``tests/test_import_cycles.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvbench.report import COLUMNS, check_columns, filtered, parse_where, runs_frame


def paired_report(paths: Sequence[Path], baseline: str, *, where: dict[str, str] | None = None) -> str:
    """``kvbench report --paired COL=VALUE``: every run (finished or not: an unfinished run counts the
    samples it has) against the baseline run the selector picks (e.g. ``method=full``) among the runs of
    its model and task settings, on the sample ids both have — the mean difference with its 95 % paired
    bootstrap interval and test (:func:`kvbench.render.paired.render_paired`), and the agreement of the
    answers with the baseline's (exact, ROUGE-L F1, Jaccard; :func:`kvbench.agreement.render_agreement`)."""
    from kvbench.agreement import render_agreement
    from kvbench.render.paired import render_paired
    from kvbench.results import load

    selector = parse_where([baseline], flag="--paired")
    runs = load(list(paths))
    if runs.empty:
        return f"(no runs found under {', '.join(str(p) for p in paths)})"
    if where:
        kept = filtered(runs_frame(paths, every_column=True), {COLUMNS.get(k, k): v for k, v in where.items()})
        runs = runs[runs["run_id"].isin(set(kept["run_id"]))]
    check_columns(runs, [k for k in selector if k not in ("method", "model", "task")], "--paired")
    samples = load(list(paths), samples=True)
    samples = samples[samples["run_id"].isin(set(runs["run_id"]))] if not samples.empty else samples

    def differing(prefix: str) -> list[str]:
        return [c for c in sorted(runs.columns) if c.startswith(prefix) and runs[c].astype(str).nunique() > 1]

    # a run meets the baseline of the same model and task settings; rows name what sets runs apart
    match = ["config.model.name", *differing("config.task.")]
    settings = [c for c in differing("config.method.") if c != "config.method.name"]
    spec = {"baseline": selector, "split": [], "match": match, "by": ["method", *settings, *match]}
    sections = render_paired(None, spec, runs, samples) + render_agreement(None, spec, runs, samples)
    text = "\n\n".join(
        f"## {section.title}\n\n{section.markdown}" + (f"\n\n{section.note}" if section.note else "")
        for section in sections
    )
    unfinished = runs[runs["state"] != "finished"] if "state" in runs.columns else runs.iloc[0:0]
    if not unfinished.empty:  # their rows count the samples they have so far
        shown = ", ".join(
            f"{row.run_id} ({row.state}, {row.done}" + (f" of {int(row.total)})" if row.total == row.total else ")")
            for row in unfinished.itertuples()
        )
        text += f"\n\nNot finished (compared on the samples they have): {shown}"
    return text
