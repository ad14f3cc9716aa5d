#!/usr/bin/env bash
# The reuse family's quality sweep (RESULTS §7, "Quality (F1) on musique and wikimqa"), question by
# question: with task.limit=N, task.shard=s/N computes question s alone, so the loop over s leaves every
# method with the same first questions answered whenever it stops (a plain `-m` sweep runs one method
# over all N questions before the next starts). Finished shards are skipped; an interrupted one resumes.
# Both sweeps of a shard (full, prefix_cache, full_reuse; cacheblend at four ratios) run in one process,
# as `kvbench run -m` twice: the model loads once and each chunk is precomputed once per dataset (the
# runs of a sweep share chunk caches). Then benchmarks/rag_quality.py merges the shards into the table
# (F1, bootstrap CIs, paired deltas) and its figure.
#   bash benchmarks/rag_quality.sh [model ...]      default: qwen25_05b smollm2_135m
#   N=50 (questions per dataset), KVBENCH_OUT=results/runs, KVBENCH_RAG_DATA=../shared/data/cacheblend,
#   START=0 (first question to visit: skipping a finished one still costs ~10 s of start-up per model)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
OUT="${KVBENCH_OUT:-results/runs}"
N="${N:-50}"
START="${START:-0}"
DATA="${KVBENCH_RAG_DATA:-../shared/data/cacheblend}"
MODELS=("$@"); [ ${#MODELS[@]} -gt 0 ] || MODELS=(qwen25_05b smollm2_135m)
for ((s = START; s < N; s++)); do
  for model in "${MODELS[@]}"; do
    "$PY" - "$OUT" "$model" "$DATA" "$N" "$s" <<'PYTHON'
import sys

from kvbench.cli import cmd_run

out, model, data, n, s = sys.argv[1:]
common = ["-m", "progress=false", f"output_dir={out}", f"model={model}", "task=rag", "task.dataset=musique,wikimqa",
          f"task.data_dir={data}", f"task.limit={n}", f"task.shard={s}/{n}"]
for methods in (["method=full,prefix_cache,full_reuse"],
                ["method=cacheblend", "method.recompute_ratio=0.05,0.15,0.3,0.5"]):
    code = cmd_run(common + methods)
    if code:
        sys.exit(code)
PYTHON
  done
  "$PY" benchmarks/rag_quality.py "$OUT" --figure "$OUT/rag_quality.png" > "$OUT/rag_quality.md" || true
done
