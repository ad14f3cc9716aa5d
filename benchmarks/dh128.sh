#!/usr/bin/env bash
# PQCache's claims at head dimension 128 (RESULTS "Head dimension 128"), on Qwen2.5-Coder-1.5B-Instruct
# (model=qwen25_15b: d_h 128, 12:2 GQA; `kvbench fetch qwen25_15b` converts it once, ~15 GB of RAM).
# The recall-vs-budget figure (ClusterKV Fig. 11a's sweep) and the NIAH grid at 1/10 of the tokens and
# 1/64 communication (PQCache Fig. 9's), PQCache against the Oracle. Resumable; CPU, about 2 hours.
#   bash benchmarks/dh128.sh [recall] [niah]
set -euo pipefail
cd "$(dirname "$0")/.."
K="${KVBENCH_CMD:-.venv/bin/kvbench}"
RUN="$K run progress=false output_dir=${KVBENCH_OUT:-results/runs}"
SECTIONS="${*:-recall niah}"
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
if want recall; then
  # pqcache apart with overlap=false: its points then share one dense prefill (quality is the same)
  $RUN -m +experiment=clusterkv_fig11a model=qwen25_15b method=pqcache method.overlap=false
  $RUN -m +experiment=clusterkv_fig11a model=qwen25_15b method=quest,clusterkv,sparq,infllm
fi
if want niah; then
  $RUN -m +experiment=pqcache_fig9 model=qwen25_15b method=pqcache_niah,oracle,full
fi
