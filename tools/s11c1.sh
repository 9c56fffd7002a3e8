#!/usr/bin/env bash
# Prepared in session 10 for session 11's first device call (docs/perf-notes.md #56-#58):
#  1. main's GPU tests (its #56 host fallback has not run on a GPU);
#  2. this branch (experiment/block-channels-last, rebased on main): its forward GPU
#     tests and compute-sanitizer (covers main's kernels too);
#  3. A/B, channels-last: main (split path) vs this branch (block path), with forced
#     paths on the few-tile shape (1, 32, 16, 16, 16) (4 CTAs: block may lose there);
#  4. A/B, contiguous slices of 113-227 KB: main (cluster) vs one CTA per SM (v_one).
# Setup here, on main's checkout (carry tools/scratch):
#   for v in main:v_main experiment/block-channels-last:v_cl; do rm -rf tools/scratch/${v##*:}; mkdir -p tools/scratch/${v##*:}; git archive ${v%%:*} kernels tests tools solution.py pytest.ini | tar -x -C tools/scratch/${v##*:}; done
#   rm -rf tools/scratch/v_one; cp -r tools/scratch/v_main tools/scratch/v_one; sed -i 's/return ctas >= 2 || (ctas == 1/return ctas >= 1 || (ctas == 1/' tools/scratch/v_one/kernels/instance_norm_forward.cu
# Run: bash tools/scratch/v_cl/tools/s11c1.sh from the repository root (~7 min).
set -uo pipefail
export PYTHONUNBUFFERED=1
ROOT=$PWD; start=$(date +%s); OUT=${OUT:-/tmp/out}
S=$ROOT/tools/scratch
t() { echo "[$(( $(date +%s) - start )) s] $*"; }
grep -c "ctas >= 1 ||" $S/v_one/kernels/instance_norm_forward.cu
for v in v_main v_cl v_one; do INSTANCE_NORM_KERNELS=$S/$v/kernels python3 -c "import solution" > $OUT/build_$v.log 2>&1 & done
wait; t builds; grep -il error $OUT/build_*.log
timeout -k 10 140 python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=20 --tb=short 2>&1 | grep -E "passed|failed|FAILED|^E " | head -20 | tee $OUT/pytest_main.log
t main tests
(cd $S/v_cl && timeout -k 10 120 python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=20 --tb=short tests/test_gpu.py 2>&1 | grep -E "passed|failed|FAILED|^E " | head -20 | tee $OUT/pytest_cl.log)
t branch tests
for tool in memcheck racecheck synccheck; do
  (cd $S/v_cl && timeout -k 10 150 compute-sanitizer --tool $tool --kernel-name kns=instance_norm --error-exitcode 3 python3 tools/sanitize_paths.py > $OUT/sanitizer_$tool.log 2>&1) &
done
wait
for tool in memcheck racecheck synccheck; do echo "$tool: $(grep -cE 'ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards' $OUT/sanitizer_$tool.log) clean, $(grep -c ': ok' $OUT/sanitizer_$tool.log) ok, $(grep -c WRONG $OUT/sanitizer_$tool.log) wrong"; grep -E "ERROR SUMMARY|HAZARD|rror" $OUT/sanitizer_$tool.log | head -3; done
t sanitizers
b() { local v=$1; shift; echo "-- $v $*"; INSTANCE_NORM_KERNELS=$S/$v/kernels timeout 60 python3 bench.py --no-compile --runs 20 "$@" 2>&1 | grep -E "copy_|ours|path|rror|differ|WRONG"; }
for s in "--shape 8,256,56,56 --channels-last" "--shape 8,256,56,56 --channels-last --dtype bfloat16" "--shape 16,64,64,64 --channels-last" "--shape 2,24,84,84 --channels-last --dtype bfloat16"; do b v_main $s; b v_cl $s; done
b v_cl --shape 1,32,16,16,16 --channels-last --paths
for s in "--shape 8,64,200,200" "--shape 8,64,300,300 --dtype bfloat16" "--shape 8,64,224,224"; do b v_main $s; b v_one $s; done
t done
