#!/usr/bin/env bash
# One device call: build (timed, cold), GPU tests, check.py, bench.py (the README
# command) with every path in fp32, bf16 and fp16, compute-sanitizer on small
# shapes, SASS load/store widths. Logs go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
start=$(date +%s); python3 -c "import solution" 2>&1 | tail -3; echo "cold build: $(( $(date +%s) - start )) s"
so=$(ls ~/.cache/instance_norm_cuda/*/instance_norm_*.so | head -1)
cuobjdump -sass "$so" | grep -oE "(LDG|STG|LDL|STL|LDS|STS)[.A-Z0-9]*" | sort | uniq -c
python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
python3 check.py 2>&1 | tee "$OUT/check.log"
python -m pip install -q -r requirements.txt && python bench.py --paths --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
python3 bench.py --dtype bfloat16 --paths --json "$OUT/bench_bf16.json" 2>&1 | tee "$OUT/bench_bf16.log"
python3 bench.py --dtype float16 --no-compile --json "$OUT/bench_fp16.json" 2>&1 | tee "$OUT/bench_fp16.log"
for tool in memcheck racecheck synccheck; do
  timeout 80 compute-sanitizer --tool $tool --error-exitcode 3 python3 tools/sanitize_paths.py > "$OUT/sanitizer_$tool.log" 2>&1
  echo "compute-sanitizer $tool: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$OUT/sanitizer_$tool.log") clean summaries)"; tail -2 "$OUT/sanitizer_$tool.log"
done
