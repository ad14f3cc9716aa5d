#!/usr/bin/env bash
# The runs behind the figures in benchmarks/RESULTS.md, in the order they were made (CPU, 2 cores).
# Every run resumes if interrupted; re-running this script only computes what is missing.
# Usage: bash benchmarks/acceptance.sh [section ...]   (default: every section)
set -euo pipefail
cd "$(dirname "$0")/.."
K="${KVBENCH_CMD:-.venv/bin/kvbench}"
DATA="${KVBENCH_DATA:-../shared/data}"
RUN="$K run progress=false output_dir=${KVBENCH_OUT:-results/runs}"
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
SECTIONS="${*:-niah_foundation niah_eviction niah_retrieval recall pg19 gsm8k_smollm2 infinitebench longbench gsm8k_qwen question_first pq_config question_first_more bench}"

if want niah_foundation; then  # full / oracle / streamingllm, the foundation's grid
  $RUN -m method=full,oracle,streamingllm budget.token_ratio=0.1 profile.recall=true
fi
if want niah_eviction; then  # the eviction baselines next to full / oracle / pqcache, both question positions
  $RUN -m method=full,oracle,streamingllm,h2o,snapkv,pyramidkv,pqcache task.question_position=end,start \
    budget.token_ratio=0.1 budget.comm_ratio=0.0078125 budget.compensate=true profile.recall=true
fi
if want niah_retrieval; then  # retrieval methods at absolute budgets
  $RUN -m method=oracle,quest,clusterkv,pqcache,sparq,infllm budget.tokens=256,512 budget.comm_ratio=0.0078125 \
    profile.recall=true
fi
if want recall; then  # recall of the exact top-B on one ~4k essay prompt (ClusterKV Fig. 11 on our models)
  # every method at the same settings: 16 sinks, no local window, B = 16 + budget.tokens = 256 / 512 / 1024
  for model in smollm2_135m qwen25_05b; do
    $RUN -m model=$model method=oracle,quest,clusterkv,pqcache,sparq,infllm budget.tokens=240,496,1008 budget.sink=16 \
      budget.local=0 budget.comm_ratio=0.0078125 'task.lengths=[4096]' 'task.depths=[0.5]' task.max_new_tokens=16 \
      profile.recall=true
    $RUN -m model=$model method=oracle method.per_query_head=true budget.tokens=240,496,1008 budget.sink=16 \
      budget.local=0 budget.comm_ratio=0.0078125 'task.lengths=[4096]' 'task.depths=[0.5]' task.max_new_tokens=16 \
      profile.recall=true
    $RUN -m model=$model method=clusterkv method.metric=cosine,l2,ip budget.tokens=256,512,1024 \
      'task.lengths=[4096]' 'task.depths=[0.5]' task.max_new_tokens=16 profile.recall=true
  done
fi
if want pg19; then
  $RUN -m method=full,streamingllm task=pg19 task.data_dir=$DATA/pg19 'task.lengths=[4096]' budget.tokens=1024
fi
if want gsm8k_smollm2; then
  $RUN model=smollm2_135m task=gsm8k_cot task.data_dir=$DATA/gsm8k task.limit=50
fi
if want infinitebench; then
  for model in smollm2_135m qwen25_05b; do
    $RUN model=$model task=infinitebench 'task.lengths=[4096,8192]'
    $RUN model=$model task=infinitebench task.data_dir=$DATA/infinitebench/passkey_lengths_archive \
      task.file=passkey_8192.first5.jsonl
  done
fi
if want longbench; then
  $RUN model=smollm2_135m task=longbench 'task.subsets=[multi_news]' task.data_dir=$DATA/longbench/full \
    task.limit=20 task.max_length=7500
  $RUN model=qwen25_05b task=longbench 'task.subsets=[multifieldqa_zh]' task.data_dir=$DATA/longbench/full \
    task.limit=20 task.max_length=7500
fi
if want gsm8k_qwen; then
  $RUN model=qwen25_05b task=gsm8k_cot task.data_dir=$DATA/gsm8k task.limit=50
fi
if want question_first; then  # the question before the context, where a task has one
  $RUN model=qwen25_05b task=longbench 'task.subsets=[multifieldqa_zh]' task.data_dir=$DATA/longbench/full \
    task.limit=20 task.max_length=7500 task.question_position=start
  $RUN model=smollm2_135m task=gsm8k_cot task.data_dir=$DATA/gsm8k task.limit=50 task.question_position=start
  $RUN model=smollm2_135m task=infinitebench 'task.lengths=[4096,8192]' task.question_position=start
fi
if want pq_config; then  # PQCache's PQ configuration: 1/64 communication (2x6 at d_h 64), and recall over m x b
  $RUN -m method=pqcache task.question_position=end,start budget.token_ratio=0.1 budget.comm_ratio=0.015625 \
    profile.recall=true
  $RUN -m method=pqcache method.m=2,4,8 method.b=4,6,8 budget.tokens=512 'task.lengths=[4096]' 'task.depths=[0.5]' \
    task.max_new_tokens=16 profile.recall=true
fi
if want question_first_more; then  # the rest of the question-first protocol runs
  $RUN model=qwen25_05b task=infinitebench 'task.lengths=[4096,8192]' task.question_position=start
  for model in smollm2_135m qwen25_05b; do
    $RUN model=$model task=infinitebench task.data_dir=$DATA/infinitebench/passkey_lengths_archive \
      task.file=passkey_8192.first5.jsonl task.question_position=start
  done
  $RUN model=qwen25_05b task=gsm8k_cot task.data_dir=$DATA/gsm8k task.limit=50 task.question_position=start
fi
if want bench; then  # the micro and end-to-end benchmarks (run on an otherwise idle machine)
  $K bench --save benchmarks/bench-cpu.json
fi
