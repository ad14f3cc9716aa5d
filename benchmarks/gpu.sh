#!/usr/bin/env bash
# The GPU measurements of benchmarks/RESULTS.md §9, step by step, on a CUDA machine:
#
#   bash benchmarks/gpu.sh tests smoke        # the suite on CUDA; every e2e bench once, small
#   (cudatests: tests/test_gpu.py alone; env: LENGTHS, NEW_TOKENS, ROUNDS, REPEATS, STEP_TIMEOUT per step;
#   PARAMS='kmeans_device=model ...' the method's parameters, TAG names their records)
#   bash benchmarks/gpu.sh cudatests decode_graph   # issue 42's table (~5 min on an H200): the static decode
#   step eager vs replayed as CUDA graphs, sync-free replays, the roofline, and the methods at 32k (MHA shape);
#   its parts decode_8b, decode_mha, decode_pq, decode_compile run alone too (T_8B, T_MHA, T_PQ, T_COMPILE:
#   each one's time limit in s; KERNELS: the decode attention kernels decode_8b compares; MHA_METHODS;
#   PROFILE_TOP=N: decode_mha prints each method's N ops with the most GPU time, from torch.profiler;
#   quest_scoring: Quest's page scores per layer, products vs gemv, ~1 min)
#   bash benchmarks/gpu.sh pqcache            # pqcache_e2e on llama31_8b_shape at 32k-128k, bf16
#   bash benchmarks/gpu.sh clusterkv reuse profile decode kmeans
#   (decode: where a decode step goes, torch.profiler; profile: does PQCache's k-means hide behind the prefill;
#   kmeans: one layer's clustering, timed and profiled, at KMEANS_LENGTHS)
#
# Records land in $OUT (default benchmarks/gpu-out/). On a machine without hydra-core & co. (a bare
# CUDA image with torch and transformers), `bash benchmarks/gpu_prepare.sh` puts their wheels in .whl/
# and the text assets in .gpu/home (carry both): the wheels are installed into /tmp/site and the source
# tree runs as the package (its subpackages linked as pyproject.toml lays them out). KVBENCH_HOME
# defaults to .gpu/home.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KVBENCH_HOME=${KVBENCH_HOME:-$PWD/.gpu/home}
PY=${PY:-python3}
if [ -d .whl ] && ! $PY -c "import hydra, kvbench.methods" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site
  # run the source tree itself (the tests start `python -m kvbench` from here): the installed layout's
  # subpackages, linked where pyproject.toml's package-dir puts them
  for pair in methods:methods tasks:tasks conf:conf papers_data:results/papers; do
    [ -e "kvbench/${pair%%:*}" ] || ln -s "../${pair#*:}" "kvbench/${pair%%:*}"
  done
fi
KV="$PY -m kvbench.cli"

for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)"
  case $step in
    info)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
      git log -1 --format='commit %H' 2>/dev/null || true ;;
    cudatests)  # tests/test_gpu.py alone: the CUDA paths (the whole suite takes minutes: `tests`)
      timeout "${CUDATESTS_TIMEOUT:-90}" $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/tests-gpu.log" ;;
    tests|suite)  # suite: the rest of the suite alone (tests: test_gpu.py first)
      [ "$step" = tests ] && timeout 60 $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/tests-gpu.log"
      # the packaged models (SmolLM2, Qwen2.5) come from PyPI: integration tests need them fetched
      timeout "${TESTS_TIMEOUT:-330}" $PY -m pytest -q -p no:cacheprovider --maxfail=40 --timeout=180 -n "${WORKERS:-8}" -m "${MARK:-not integration}" 2>&1 | tee "$OUT/tests.log" | tail -60 ;;
    smoke)
      timeout 200 $KV bench pqcache_e2e clusterkv_e2e --quick --device cuda --model llama31_8b_shape \
        --lengths 4096 --new-tokens 8 --save "$OUT/smoke.json" 2>&1 | tee "$OUT/smoke.log" ;;
    pqcache|clusterkv)  # one process per length: a length that runs out of time keeps the others
      for length in ${LENGTHS:-32768 65536 131072}; do
        # the prompt and the new tokens share Llama-3.1's 131072 positions: "128k" is 131072 - new tokens
        [ $((length + ${NEW_TOKENS:-256})) -gt 131072 ] && length=$((131072 - ${NEW_TOKENS:-256}))
        timeout "${STEP_TIMEOUT:-600}" $KV bench ${step}_e2e --device cuda --model llama31_8b_shape --lengths "$length" \
          --new-tokens "${NEW_TOKENS:-256}" --rounds "${ROUNDS:-2}" $(for p in ${PARAMS:-}; do echo --param "$p"; done) \
          --save "$OUT/bench-gpu-$step${TAG:+-$TAG}-$length.json" 2>&1 | tee -a "$OUT/$step.log"
      done ;;
    reuse)
      # TTFT at 6k and 16-32k prompt tokens (issue 42); RAM-tier chunks are pinned host memory (a real copy)
      timeout "${STEP_TIMEOUT:-600}" $KV bench reuse_ttft --device cuda --model llama31_8b_shape \
        --lengths "${REUSE_LENGTHS:-6144,16384,32768}" --methods "${REUSE_METHODS:-cacheblend:ram,full_reuse:ram,prefix_cache}" \
        --repeats "${REPEATS:-3}" --save "$OUT/bench-gpu-reuse.json" 2>&1 | tee "$OUT/reuse.log" ;;
    kmeans)  # where one layer's k-means goes (ClusterKV's and PQCache's), both accumulation paths side by side
      for length in ${KMEANS_LENGTHS:-32768 131072}; do
        timeout "${STEP_TIMEOUT:-300}" $PY tools/profile_kmeans.py --length "$length" --repeats "${REPEATS:-2}" \
          --out "$OUT/kmeans-$length" 2>&1 | grep -v "^USDT" | tee -a "$OUT/kmeans.log"
      done ;;
    decode_graph)  # issue 42, the parts below, one after the other
      bash "$PWD/benchmarks/gpu.sh" decode_8b decode_mha decode_pq decode_compile ;;
    decode_8b)  # issue 42 (1): full on the 8B shape at 32k, eager vs graph TPOT, token identity, sync-free
      # replays, the roofline, with each decode attention kernel side by side (engine.decode_attention)
      timeout "${T_8B:-${STEP_TIMEOUT:-240}}" $KV bench decode_graph --device cuda --model llama31_8b_shape \
        --lengths "${LENGTHS_8B:-32768,65536}" --methods full --new-tokens "${NEW_TOKENS:-256}" --rounds "${ROUNDS:-2}" \
        --param kernels="${KERNELS:-split,matmul,sdpa}" --save "$OUT/decode-graph-8b.json" 2>&1 | tee -a "$OUT/decode-graph.log" ;;
    decode_mha)  # issue 42 (2): the selecting methods against full on the MHA shape (Quest's regime; Quest with
      # both page scorings, method.scoring=products|gemv), budget 1024, device-resident KV
      timeout "${T_MHA:-${STEP_TIMEOUT:-240}}" $KV bench decode_graph --device cuda --model llama2_7b_shape --lengths 32768 \
        --methods "${MHA_METHODS:-full,quest,quest:scoring=gemv,clusterkv,oracle}" --new-tokens "${NEW_TOKENS:-256}" --rounds "${ROUNDS:-1}" \
        --param kernels="${MHA_KERNELS:-split}" --param profile="${PROFILE_TOP:-0}" --save "$OUT/decode-graph-mha.json" 2>&1 \
        | tee -a "$OUT/decode-graph.log" ;;
    quest_scoring)  # Quest's page scores per layer, method.scoring products vs gemv (8k-128k, MHA and GQA layouts)
      timeout "${STEP_TIMEOUT:-120}" $KV bench quest_scoring --device cuda --save "$OUT/quest-scoring.json" 2>&1 \
        | tee -a "$OUT/quest-scoring.log" ;;
    decode_pq)  # issue 42 (3): PQCache's TPOT against the context (the paper: nearly flat), k-means on the GPU
      timeout "${T_PQ:-${STEP_TIMEOUT:-240}}" $KV bench decode_graph --device cuda --model llama31_8b_shape \
        --lengths "${PQ_LENGTHS:-32768,65536}" --methods full,pqcache --new-tokens 128 --rounds 1 \
        --param kmeans_device=model --param kernels="${PQ_KERNELS:-split}" --save "$OUT/decode-graph-pqcache.json" 2>&1 \
        | tee -a "$OUT/decode-graph.log" ;;
    decode_compile)  # issue 42 (4): transformers' StaticCache + torch.compile(reduce-overhead) beside full on the
      # 8B shape at 32k (its compilation took over 70 s on 2026-11-29 and did not finish inside 150 s)
      timeout "${T_COMPILE:-${STEP_TIMEOUT:-360}}" $KV bench decode_graph --device cuda --model llama31_8b_shape \
        --lengths 32768 --methods full --new-tokens "${NEW_TOKENS:-256}" --rounds 1 --param compile=true \
        --param kernels="${KERNELS_COMPILE:-split}" --save "$OUT/decode-graph-compile.json" 2>&1 | tee -a "$OUT/decode-graph.log" ;;
    decode)  # where a decode step's time goes (torch.profiler, CPU and CUDA)
      timeout "${STEP_TIMEOUT:-300}" $PY tools/profile_decode.py --model llama31_8b_shape --length "${PROFILE_LENGTH:-8192}" \
        --new-tokens 12 --rounds 1 --methods pqcache,clusterkv --torch-profile 25 2>&1 | tee "$OUT/decode-profile.log" ;;
    profile)
      timeout "${STEP_TIMEOUT:-300}" $PY tools/profile_overlap.py --model llama31_8b_shape --length "${PROFILE_LENGTH:-32768}" --rounds "${ROUNDS:-2}" --out "$OUT/overlap" 2>&1 \
        | tail -60 | tee "$OUT/overlap.log"
      cp "$OUT/overlap/summary.json" "$OUT/overlap-summary.json" 2>/dev/null
      cp "$OUT/overlap/trace.json.gz" "$OUT/overlap-trace.json.gz" 2>/dev/null ;;
    *) echo "unknown step $step (info cudatests tests suite smoke decode_graph decode_8b decode_mha decode_pq decode_compile pqcache clusterkv reuse kmeans decode profile)"; exit 2 ;;
  esac
done
