#!/usr/bin/env bash
# The runs behind "Shared-context multi-query and RULER" in benchmarks/RESULTS.md (issue 18), CPU.
# Every run resumes if interrupted; re-running only computes what is missing.
# Usage: bash benchmarks/multiquery.sh [section ...]   (default: niah_multiquery ruler)
set -euo pipefail
cd "$(dirname "$0")/.."
K="${KVBENCH_CMD:-.venv/bin/kvbench}"
RUN="$K run progress=false output_dir=${KVBENCH_OUT:-results/runs}"
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
SECTIONS="${*:-niah_multiquery ruler}"
METHODS=full,oracle,snapkv,pyramidkv,h2o,streamingllm,quest,pqcache,clusterkv
BUDGET="budget.token_ratio=0.1 budget.comm_ratio=0.0078125"   # comm 1/128: PQCache's 2x4-bit codes at d_h 64

if want niah_multiquery; then  # 4 needles, 4 questions per 4k context, question-aware vs question-agnostic
  for model in smollm2_135m qwen25_05b; do
    $RUN -m model=$model method=$METHODS task=niah task.needles=4 task.queries_per_context=4 \
      task.compression=question_aware,question_agnostic 'task.lengths=[4096]' 'task.depths=[0,0.25,0.5,0.75]' \
      task.scorer=substring $BUDGET
  done
fi
if want ruler; then  # RULER's 11 synthetic tasks (QA needs SQuAD/HotpotQA: skipped), 5 samples per task and length
  $RUN -m model=smollm2_135m method=$METHODS task=ruler 'task.lengths=[4096]' task.num_samples=5 $BUDGET
  # Qwen2.5-0.5B: one length per run, so each finished (method, length) run can be kept on its own
  # (measured on 2 cores: about 2.5 h at 4k for the nine methods, `full` ~45 s a sample and the methods
  # that replay its shared prefill 7-30 s). 8k was measured with 2 samples per task (22 per method, 1 h 8 min
  # in one process); RULER_8K_SAMPLES=5 gives the 4k count, roughly 3 h on 2 cores.
  $RUN -m model=qwen25_05b method=$METHODS task=ruler "task.lengths=[4096]" task.num_samples=5 $BUDGET
  $RUN -m model=qwen25_05b method=$METHODS task=ruler "task.lengths=[8192]" \
    task.num_samples="${RULER_8K_SAMPLES:-2}" $BUDGET
fi
