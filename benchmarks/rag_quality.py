"""The reuse-family quality table of benchmarks/RESULTS.md: every rag run against ``full`` on the same samples.

    python benchmarks/rag_quality.py RUNS_DIR [RUNS_DIR ...]   # markdown on stdout

For each (model, dataset) and each run of the reuse family or ``full`` on it: the mean score (F1 for
musique/wikimqa) with its 95 % bootstrap CI, the paired difference to ``full`` on the samples both
finished (bootstrap CI of the mean difference and the paired permutation p-value, kvbench.stats), how
often the method's answer is character-identical to full's, and the mean TTFT. Only the samples every
method of the group finished are used, so the rows compare the same questions. The shards of a run
(``task.shard=s/N``: benchmarks/rag_quality.sh runs the sweep question by question) merge into it.
Reading never modifies the runs.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from kvbench.results import RunDir
from kvbench.runner import bootstrap_ci
from kvbench.stats import paired


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


def main(folders: list[str]) -> None:
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
    for (model, dataset), runs in sorted(groups.items()):
        if "full" not in runs:
            continue
        common = sorted(set.intersection(*(set(r) for r in runs.values())))
        print(f"\n### {model}, {dataset}: {len(common)} questions (the first ones every method finished)\n")
        print("| method | F1 [95% CI] | F1 - full [95% CI], p | answer = full's | TTFT (s) |")
        print("|---|---|---|---|---|")
        full = [runs["full"][i] for i in common]
        for label in sorted(runs, key=_order):
            rows = [runs[label][i] for i in common]
            scores = [r["score"] for r in rows]
            ci = bootstrap_ci(scores)
            ci_text = f"[{ci[0]:.1f}, {ci[1]:.1f}]" if ci else ""
            same = np.mean([r["prediction"].strip() == f["prediction"].strip() for r, f in zip(rows, full)])
            ttft = np.mean([r["telemetry"]["ttft_s"] for r in rows])
            if label == "full":
                delta = "—"
            else:
                p = paired(scores, [f["score"] for f in full])
                bounds = f"[{p.ci_low:+.1f}, {p.ci_high:+.1f}]" if p.ci_low is not None else ""
                delta = f"{p.diff:+.1f} {bounds}, p={p.p:.2g}"
            print(f"| {label} | {np.mean(scores):.1f} {ci_text} | {delta} | {same:.0%} | {ttft:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["results/runs"])
