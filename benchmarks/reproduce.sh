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
if [ ${#ARTIFACTS[@]} -eq 0 ]; then
  ARTIFACTS=(
    pqcache/fig9 pqcache/table3 pqcache/table2 pqcache/table4 pqcache/fig10a pqcache/fig10b pqcache/fig10c
    pqcache/fig10d pqcache/fig11a pqcache/fig11b pqcache/fig11c pqcache/fig11d pqcache/fig12c
    clusterkv/table1 clusterkv/fig9 clusterkv/fig10 clusterkv/fig11a clusterkv/fig11b clusterkv/fig12
    clusterkv/cache_hit_rate
    cacheblend/fig2 cacheblend/fig6 cacheblend/fig7 cacheblend/fig8 cacheblend/fig12 cacheblend/fig16 cacheblend/fig17
  )
fi
for artifact in "${ARTIFACTS[@]}"; do
  echo "== kvbench reproduce $artifact scale=$SCALE" >&2
  $K reproduce "$artifact" "scale=$SCALE" "${EXTRA[@]}"
done
if [ "$SCALE" = cpu ] && [ $# -eq 0 ]; then  # the micro-benchmarks of RESULTS.md (not paper artifacts)
  $K bench --save benchmarks/bench-cpu.json
fi
$K report --html "results/reproduce/$SCALE/html" --scale "$SCALE"
