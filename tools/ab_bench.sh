#!/usr/bin/env bash
# Same-machine A/B of two versions of kernels/: machines differ by a few percent
# (copy 3.508-3.529 ms on the seed shape), so compare versions only within one call.
#
#   bash tools/ab_bench.sh DIR_A DIR_B [ROUNDS] [-- bench.py args]
#
# DIR_A, DIR_B: kernel source folders (e.g. kernels and a copy made with
# `git archive REV kernels | tar -x -C ab/REV`, under a folder that .git/info/exclude
# ignores and `carry` sends). Both are built at once (each its own cache name; two
# builds side by side take about one build's time on the device's 16 cores), then
# bench.py --no-compile runs ROUNDS times (default 2) for A and B alternately.
set -uo pipefail
a=$(realpath "$1"); b=$(realpath "$2"); rounds=${3:-2}
shift $(( $# >= 3 ? 3 : $# )); [ "${1:-}" = "--" ] && shift
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
pids=()
for dir in "$a" "$b"; do
  INSTANCE_NORM_KERNELS="$dir" python3 -c "import solution" 2>&1 | tail -1 & pids+=($!)
done
wait "${pids[@]}"
for round in $(seq "$rounds"); do
  for dir in "$a" "$b"; do
    echo "== round $round: $dir"
    INSTANCE_NORM_KERNELS="$dir" python3 bench.py --no-compile "$@" 2>&1 | grep -E "copy_|ours|no speed"
  done
done
