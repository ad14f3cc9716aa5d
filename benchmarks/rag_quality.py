"""The reuse-family quality table of benchmarks/RESULTS.md: every rag run against ``full`` on the same samples.

    python benchmarks/rag_quality.py RUNS_DIR [RUNS_DIR ...] [--figure FILE.png]   # markdown on stdout

For each (model, dataset) and each run of the reuse family or ``full`` on it: the mean score (F1 for
musique/wikimqa) with its 95 % bootstrap CI, the paired difference to ``full`` on the samples both
finished (bootstrap CI of the mean difference and the paired permutation p-value, kvbench.stats; the
exact McNemar test, named in the cell, where every score of both is 0 or 100), how
often the method's answer is character-identical to full's, and the mean TTFT. Only the samples every
method of the group finished are used, so the rows compare the same questions. The shards of a run
(``task.shard=s/N``: benchmarks/rag_quality.sh runs the sweep question by question) merge into it.
``--figure`` draws the same numbers: one panel per (model, dataset), CacheBlend's F1 against its
recompute ratio with the other methods as horizontal lines (full with its CI band), each CacheBlend
point labelled with how often its answer equals full's. Reading never modifies the runs.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvbench.metrics import bootstrap_ci
from kvbench.results import RunDir
from kvbench.stats import paired


@dataclass
class Row:
    """One method on one (model, dataset), over the questions every method of the group finished."""

    label: str
    f1: float
    ci: list[float] | None
    delta: str  # F1 - full [CI], p  ("—" for full)
    same: float  # share of answers character-identical to full's
    ttft: float


def _label(config: dict) -> str:
    method = config["method"]
    name = method["name"]
    if name == "cacheblend":
        return f"cacheblend@{method['recompute_ratio']:g}"
    return name


def _order(label: str) -> tuple:
    names = ["full", "prefix_cache", "full_reuse", "cacheblend"]
    base, _, ratio = label.partition("@")
    return (names.index(base) if base in names else 9, float(ratio or 0))


def collect(folders: list[str]) -> dict[tuple[str, str], dict[str, dict[str, dict]]]:
    """(model, dataset) -> method label -> sample id -> record, the shards of a run merged."""
    groups: dict[tuple[str, str], dict[str, dict[str, dict]]] = defaultdict(dict)
    for folder in folders:
        for path in sorted(Path(folder).iterdir()):
            if not (path / "config.yaml").exists():
                continue
            run = RunDir(path)
            config = run.config()
            if config["task"]["name"] != "rag":
                continue
            records = {r["id"]: r for r in run.records()}
            # shards of one run (task.shard=i/n) and runs of one method at different task.limit hold
            # disjoint or identical questions: their records merge
            groups[config["model"]["name"], config["task"]["dataset"]].setdefault(_label(config), {}).update(records)
    return groups


def summarise(runs: dict[str, dict[str, dict]]) -> tuple[int, list[Row]]:
    """(questions compared, one row per method) of one (model, dataset) group that has ``full``."""
    common = sorted(set.intersection(*(set(r) for r in runs.values())))
    full = [runs["full"][i] for i in common]
    rows = []
    for label in sorted(runs, key=_order):
        records = [runs[label][i] for i in common]
        scores = [r["score"] for r in records]
        same = float(np.mean([r["prediction"].strip() == f["prediction"].strip() for r, f in zip(records, full)]))
        if label == "full":
            delta = "—"
        else:
            p = paired(scores, [f["score"] for f in full])
            bounds = f"[{p.ci_low:+.1f}, {p.ci_high:+.1f}]" if p.ci_low is not None else ""
            test = "" if p.test == "permutation" else f" ({p.test})"  # all-0/100 scores: exact McNemar
            delta = f"{p.diff:+.1f} {bounds}, p={p.p:.2g}{test}"
        ttft = float(np.mean([r["telemetry"]["ttft_s"] for r in records]))
        rows.append(Row(label, float(np.mean(scores)), bootstrap_ci(scores), delta, same, ttft))
    return len(common), rows


def table(model: str, dataset: str, n: int, rows: list[Row]) -> str:
    lines = [
        f"\n### {model}, {dataset}: {n} questions (the first ones every method finished)\n",
        "| method | F1 [95% CI] | F1 - full [95% CI], p | answer = full's | TTFT (s) |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        ci_text = f"[{row.ci[0]:.1f}, {row.ci[1]:.1f}]" if row.ci else ""
        lines.append(f"| {row.label} | {row.f1:.1f} {ci_text} | {row.delta} | {row.same:.0%} | {row.ttft:.2f} |")
    return "\n".join(lines)


def figure(summaries: list[tuple[str, str, int, list[Row]]], path: Path) -> Path:
    """One panel per (model, dataset): CacheBlend's F1 (95 % CI bars) against its recompute ratio, the
    other methods as horizontal lines (full with its CI band)."""
    from kvbench.plots import Panel, Series, series_panels

    styles = {"full": ("#222222", "-"), "prefix_cache": ("#1f77b4", ":"), "full_reuse": ("#d62728", "--")}
    panels = []
    for model, dataset, n, rows in summaries:
        series = []
        for row in rows:
            if row.label in styles:
                color, style = styles[row.label]
                band = {"low": [row.ci[0]], "high": [row.ci[1]]} if row.label == "full" and row.ci else {}
                series.append(Series(row.label, [0.0], [row.f1], kind="hline", color=color, linestyle=style, **band))
        blend = [r for r in rows if r.label.startswith("cacheblend@")]
        if blend:
            series.append(
                Series(
                    "cacheblend",
                    [float(r.label.partition("@")[2]) for r in blend],
                    [r.f1 for r in blend],
                    low=[r.ci[0] if r.ci else r.f1 for r in blend],
                    high=[r.ci[1] if r.ci else r.f1 for r in blend],
                    notes=[f"={r.same:.0%}" for r in blend],
                    color="#2ca02c",
                )
            )
        panels.append(
            Panel(
                f"{model}, {dataset} ({n} questions)",
                "CacheBlend recompute ratio",
                "F1 (0-100)",
                series,
                xpercent=True,
                xlim=(0, 0.58),  # room for the label of the 50 % point
                ylim=(0, None),
            )
        )
    return series_panels(
        panels,
        path,
        title="Reuse family on CacheBlend's RAG inputs: F1 against full recompute",
        caption=(
            "F1: CacheBlend's scorer (SQuAD normalisation, first line, F1 over the model tokenizer's ids, max over "
            "gold answers), mean over the questions every method finished; bars and the band: 95 % bootstrap CI. "
            "=N% beside a CacheBlend point: share of its answers character-identical to full recompute's. A line "
            "hidden under full's has full's F1 (prefix_cache's, when its answers are full's)."
        ),
        columns=2,
    )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", default=["results/runs"])
    parser.add_argument("--figure", type=Path, help="also draw the table as a figure (PNG)")
    args = parser.parse_args(argv)
    summaries = []
    for (model, dataset), runs in sorted(collect(args.folders).items()):
        if "full" not in runs:
            continue
        n, rows = summarise(runs)
        print(table(model, dataset, n, rows))
        summaries.append((model, dataset, n, rows))
    if args.figure and summaries:
        figure(summaries, args.figure)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
