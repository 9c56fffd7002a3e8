#!/usr/bin/env bash
# Same-machine A/B of two versions of kernels/: machines differ by a few percent
# (copy 3.508-3.529 ms on the seed shape), so compare versions only within one run of this.
#
#   bash tools/ab_bench.sh DIR_A DIR_B [ROUNDS] [-- bench.py args]
#
# DIR_A, DIR_B: kernel source folders (e.g. kernels and a copy made with
# `git archive REV kernels | tar -x -C ab/REV`, under a folder git ignores). Both are
# built at once (each its own cache name; two builds side by side take about one
# build's time on 16 cores), then bench.py --no-compile runs ROUNDS times (default 2)
# for A and B alternately, each in its own process; bench.py's rows print, or its whole
# output where it fails. Exits 2 on a usage error or without a GPU.
set -uo pipefail
usage() { sed -n '2,/^set /p' "$0" | grep '^#' | sed -E 's/^# ?//'; }
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then usage; exit 0; fi
if [[ $# -lt 2 || ! -d "$1" || ! -d "$2" ]]; then
  usage >&2; echo "ab_bench: DIR_A and DIR_B must be kernel source folders, got '${1:-}' and '${2:-}'" >&2; exit 2
fi
a=$(realpath "$1"); b=$(realpath "$2"); rounds=${3:-2}
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "ab_bench: ROUNDS must be a positive integer, got '$rounds'" >&2; exit 2; }
shift $(( $# >= 3 ? 3 : $# )); [ "${1:-}" = "--" ] && shift
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 2)" \
  || { echo "ab_bench: needs a CUDA GPU (torch sees none)" >&2; exit 2; }
pids=()
for dir in "$a" "$b"; do
  INSTANCE_NORM_KERNELS="$dir" python3 -c "import solution" 2>&1 | tail -1 & pids+=($!)
done
wait "${pids[@]}"
for round in $(seq "$rounds"); do
  for dir in "$a" "$b"; do
    echo "== round $round: $dir"
    # The rows' lines only, or the whole output where bench.py fails.
    output=$(INSTANCE_NORM_KERNELS="$dir" python3 bench.py --no-compile "$@" 2>&1) \
      || { echo "$output" >&2; echo "ab_bench: bench.py failed for $dir" >&2; exit 1; }
    grep -E "copy_|ours|no speed" <<< "$output"
  done
done
