#!/usr/bin/env bash
# Times the README's quickstart as a newcomer meets it: a fresh clone, an empty pip cache and an empty
# asset cache (KVBENCH_HOME), then `make run` (set-up of .venv, SmolLM2 and the essays downloaded and
# converted, the 3-method needle grid, heatmaps and table). Run it on an idle machine; it prints the
# wall time of each phase and leaves nothing behind (the clone and caches live under a temp folder).
#   bash benchmarks/time_quickstart.sh [repository]      (default: this checkout)
set -euo pipefail
repo="$(cd "${1:-$(dirname "$0")/..}" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/kvbench-quickstart.XXXXXX")"
trap 'rm -rf "$work"' EXIT
git clone -q "$repo" "$work/kvbench"
# ../shared is not needed by the quickstart; the clone sits outside the repository's parent on purpose
export PIP_CACHE_DIR="$work/pip-cache" KVBENCH_HOME="$work/kvbench-home"
cd "$work/kvbench"
start=$(date +%s.%N)
make .venv/.kvbench-installed >/dev/null  # make run's set-up (kvbench and what running needs)
setup=$(date +%s.%N)
make run 2>&1 | tail -n 12
end=$(date +%s.%N)
python3 - "$start" "$setup" "$end" "$(git rev-parse --short HEAD)" <<'PY'
import sys
start, setup, end, sha = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
fmt = lambda s: f"{int(s // 60)} min {s % 60:.0f} s"
print(f"quickstart at {sha}: set-up {fmt(setup - start)}, assets + run {fmt(end - setup)}, total {fmt(end - start)}")
PY
