#!/usr/bin/env bash
# The named stages (default: all) on a machine with a GPU, logs to $OUT (default /tmp/out):
#   build     cold build (timed) and SASS load/store widths
#   tests     python -m pytest -m gpu in three processes at once, and check.py beside them
#   sanitize  compute-sanitizer memcheck, racecheck, synccheck on tools/sanitize_paths.py,
#             at once, beside the tests (our kernels only; SANITIZERS="racecheck" picks tools)
#   bench     bench.py --paths (the README's bench.py, every path) on the seed shape, fp32 and bf16, and
#             on the 3d row (1, 32, 128, 128, 128) fp32 (the pipelined path; --paths also
#             times the cooperative one)
#   suite     bench.py --suite, forward and --backward
#   nets      benchmarks/nets.py (the real-network training benchmark; NETS_ARGS adds options)
#
#   bash tools/gpu_checks.sh [stage ...]
#
# INSTANCE_NORM_EMULATE=a100 or l40s (testing only; docs/design.md, "Pre-Hopper paths") runs the
# same stages with the kernels built as compute_80 PTX and the path choice of that GPU.
set -uo pipefail
export PYTHONUNBUFFERED=1
if [[ " $* " == *" -h "* || " $* " == *" --help "* ]]; then
  sed -n '2,/^set /p' "$0" | grep '^#' | sed -E 's/^# ?//'; exit 0
fi
for stage in $*; do  # unquoted: "tests sanitize" as one argument names two stages
  case "$stage" in build|tests|sanitize|bench|suite|nets) ;;
    *) echo "gpu_checks: unknown stage '$stage' (stages: build tests sanitize bench suite nets)" >&2; exit 2 ;;
  esac
done
python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 2)" \
  || { echo "gpu_checks: needs a CUDA GPU (torch sees none)" >&2; exit 2; }
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
# Inside the repository's ignored out/, so a later run on the same machine reuses the build.
export INSTANCE_NORM_BUILD_ROOT="${INSTANCE_NORM_BUILD_ROOT:-$PWD/out/build}"
stages="${*:-build tests sanitize bench suite nets}"
has() { [[ " $stages " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
start=$(date +%s); python3 -c "import solution" 2>&1 | tail -3; echo "build: $(( $(date +%s) - start )) s"
if has build; then
  # the newest build under the build root solution.py uses
  so=$(ls -t "$INSTANCE_NORM_BUILD_ROOT"/*/instance_norm_*.so | head -1)
  cuobjdump -sass "$so" | grep -oE "(LDG|STG|LDL|STL|LDS|STS)[.A-Z0-9]*" | sort | uniq -c
fi
# The tests and the sanitizers run at once, in separate processes on the one GPU
# (correctness only: nothing here is timed); each logs to its own file.
if has tests; then
  shard() {  # shard NAME FILE...: pytest -m gpu over the files
    local name=$1; shift
    python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short "$@" > "$OUT/pytest_$name.log" 2>&1
    echo "pytest $name ($*): exit $? | $(tail -1 "$OUT/pytest_$name.log")"
    grep -E "^FAILED|^ERROR" "$OUT/pytest_$name.log" | head -20
  }
  shard forward tests/test_gpu.py &
  shard backward tests/test_gpu_backward.py tests/test_gpu_multi.py tests/test_harness.py &
  shard ops tests/test_gpu_epilogue.py tests/test_gpu_ops.py tests/test_gpu_modules.py &
  (python3 check.py --trials 2 > "$OUT/check.log" 2>&1; echo "check.py: exit $? | $(tail -1 "$OUT/check.log")") &
fi
if has sanitize; then
  for tool in ${SANITIZERS:-memcheck racecheck synccheck}; do
    # Only this project's kernels (namespace instance_norm): racecheck also reports
    # hazards inside PyTorch's own float64 mean reduction, which computes the references.
    (timeout 400 compute-sanitizer --tool $tool --kernel-name kns=instance_norm --error-exitcode 3 \
       python3 tools/sanitize_paths.py > "$OUT/sanitizer_$tool.log" 2>&1
     echo "compute-sanitizer $tool: exit $? ($(grep -cE 'ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards' "$OUT/sanitizer_$tool.log") clean summaries)"
     grep -E "WRONG|ERROR SUMMARY" "$OUT/sanitizer_$tool.log" | head -5) &
  done
fi
wait
if has bench; then
  python -m pip install -q -r requirements.txt && python bench.py --paths --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
  python3 bench.py --dtype bfloat16 --paths --json "$OUT/bench_bf16.json" 2>&1 | tee "$OUT/bench_bf16.log"
  python3 bench.py --shape 1,32,128,128,128 --paths --json "$OUT/bench_3d.json" 2>&1 | tee "$OUT/bench_3d.log"
fi
if has suite; then
  python3 bench.py --suite --runs 20 --json "$OUT/suite.json" 2>&1 | tee "$OUT/suite.log" | sed -n '/^summary/,$p'
  python3 bench.py --suite --backward --runs 20 --json "$OUT/suite_backward.json" 2>&1 | tee "$OUT/suite_backward.log" | sed -n '/^summary/,$p'
fi
if has nets; then
  python3 benchmarks/nets.py ${NETS_ARGS:-} --json "$OUT/nets.json" 2>&1 | tee "$OUT/nets.log"
fi
