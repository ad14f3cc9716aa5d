#!/usr/bin/env bash
# Every artifact behind benchmarks/RESULTS.md, through `kvbench reproduce` (replaces the former
# acceptance.sh + tables.sh). Each call runs only what is missing (runs resume sample by sample), then
# writes results/reproduce/<scale>/<experiment>/ (report.md, report.tex, CSVs, figures); the HTML
# report at the end shows them all. Run on an otherwise idle machine: the latency artifacts time it.
#   bash benchmarks/reproduce.sh [scale] [artifact ...]     scale: smoke | cpu (default) | paper
# Extra Hydra overrides for every call go in KVBENCH_OVERRIDES (e.g. "hydra/launcher=local").
set -euo pipefail
cd "$(dirname "$0")/.."
K="${KVBENCH_CMD:-.venv/bin/kvbench}"
SCALE="${1:-cpu}"; shift || true
read -r -a EXTRA <<< "${KVBENCH_OVERRIDES:-}"
ARTIFACTS=("$@")
if [ ${#ARTIFACTS[@]} -eq 0 ]; then  # every experiment file, as `kvbench reproduce --list` names them
  mapfile -t ARTIFACTS < <($K reproduce --list | awk '{print $1}')
fi
for artifact in "${ARTIFACTS[@]}"; do
  echo "== kvbench reproduce $artifact scale=$SCALE" >&2
  $K reproduce "$artifact" "scale=$SCALE" "${EXTRA[@]}"
done
if [ "$SCALE" = cpu ] && [ $# -eq 0 ]; then  # the micro-benchmarks of RESULTS.md (not paper artifacts)
  $K bench --save benchmarks/bench-cpu.json
fi
$K report --html "results/reproduce/$SCALE/html" --scale "$SCALE"
