#!/usr/bin/env bash
# The tables and figures of benchmarks/RESULTS.md, rendered from the runs that benchmarks/acceptance.sh
# made (nothing is computed here). Usage: bash benchmarks/tables.sh > /tmp/tables.md
set -euo pipefail
cd "$(dirname "$0")/.."
K="${KVBENCH_CMD:-.venv/bin/kvbench}"
RUNS="${KVBENCH_OUT:-results/runs}"
FIGURES="${KVBENCH_FIGURES:-benchmarks/figures}"
R="$K report $RUNS"
GRID='lengths=[1024, 2048, 4096]'
mkdir -p "$FIGURES"

section() { printf '\n### %s\n\n' "$1"; }
figure() { local out="$1"; shift; $R --figure "$out" "$@" >/dev/null || echo "(no runs for $out yet)"; }

NIAH=(--where task=niah --where model=smollm2_135m --where "$GRID")
RATIO=(--where config.budget.tokens=None)
TOKENS=(--where config.budget.token_ratio=None --where question=end)
for value in score recall "KV kept" attended; do
  section "NIAH on SmolLM2, 3 lengths x 5 depths, token ratio 0.1: $value by question position"
  $R --pivot method,budget question --value "$value" "${NIAH[@]}" "${RATIO[@]}"
done
for value in score recall "hit rate" attended bytes_h2d_index_per_step bytes_h2d_kv_per_step; do
  section "NIAH on SmolLM2, 3 lengths x 5 depths, token budgets (question at the end): $value"
  $R --pivot method config.budget.tokens --value "$value" "${NIAH[@]}" "${TOKENS[@]}"
done
for position in end start; do
  figure "$FIGURES/niah_ratio0.1_$position.png" --where task=niah --where model=smollm2_135m --where "$GRID" \
    --where question=$position --where config.budget.tokens=None
done
figure "$FIGURES/niah_tokens_end.png" --where task=niah --where model=smollm2_135m --where "$GRID" \
  --where question=end --where config.budget.token_ratio=None

for model in smollm2_135m qwen25_05b; do
  section "Recall of the exact top-B by budget B (tokens), one ~4k-token essay prompt, $model"
  $R --pivot method config.budget.tokens --value recall --where task=niah --where model=$model \
    --where 'lengths=[4096]' --where config.budget.comm_ratio=0.0078125
  section "ClusterKV recall by k-means metric, $model"
  $R --pivot config.method.metric config.budget.tokens --value recall --where task=niah --where model=$model \
    --where 'lengths=[4096]' --where config.budget.comm_ratio=0.0 --where method=clusterkv
done

section "PQCache: recall by PQ configuration (m sub-spaces x b bits), B = 512, SmolLM2 4k essay prompt"
$R --pivot config.method.m config.method.b --value recall --where task=niah --where method=pqcache \
  --where 'lengths=[4096]' --where config.budget.tokens=512 --where config.budget.comm_ratio=0.0

section "PG19 book 10146 (4096 tokens, decode mode): perplexity"
$R --pivot method,budget "" --where task=pg19
figure "$FIGURES/pg19_curves.png" --where task=pg19

section "GSM8k chain-of-thought, first 50 test problems: accuracy and prompt tokens"
$R --pivot model,question "" --where task=gsm8k_cot
echo
$R --pivot model,question "" --value prompt_tokens --where task=gsm8k_cot

section "InfiniteBench passkey: generated prompts and the released 8k file"
$R --pivot model,config.task.file question --where task=infinitebench
section "InfiniteBench passkey, generated prompts: score by length and needle depth"
"${PYTHON:-.venv/bin/python}" - "$RUNS" <<'PY'
import json, sys
from pathlib import Path
DEPTHS = ("0", "0.25", "0.5", "0.75", "1")
print("| model | question | length | " + " | ".join(f"depth {d}" for d in DEPTHS) + " |")
print("|---|---|---|" + "---|" * len(DEPTHS))
for run in sorted(Path(sys.argv[1]).glob("infinitebench-*/metrics.json")):
    metrics = json.loads(run.read_text())
    if not metrics.get("grid"):
        continue
    model = json.loads((run.parent / "env.json").read_text())["model"]["name"]
    for length, row in metrics["grid"].items():
        cells = " | ".join(f"{row.get(d, float('nan')):.0f}" for d in DEPTHS)
        print(f"| {model} | {metrics['protocol']['question_position']} | {length} | {cells} |")
PY

section "LongBench (first 20 samples, truncation 7500 tokens): score"
$R --pivot model,config.task.subsets question --where task=longbench
