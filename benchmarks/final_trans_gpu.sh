#!/usr/bin/env bash
# After making the transposed FP8 dots the default: the decode kernel, FP8 and engine GPU tests, the
# sweep of the bf16 tiles transposed or not, bench.py FP8 twice and bf16 once (one H200, ~5 min).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python -m pytest -q -p no:cacheprovider --timeout 150 -rfE tests/test_kernels_gpu.py \
  tests/test_fp8_kv.py tests/test_gpu_engine.py > "$OUT/tests.log" 2>&1
echo "GPU tests: exit $? ($(tail -n 1 "$OUT/tests.log"))"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head
timeout 150 python benchmarks/fp8_decode_sweep.py --graph --only "64x1 trans" --json "$OUT/sweep.json" \
  > "$OUT/sweep.txt" 2>&1; echo "sweep: exit $?"; grep -E "^(b=|  bf16|  64x1)" "$OUT/sweep.txt"
for run in fp8:--kv-cache-dtype=fp8 fp8b:--kv-cache-dtype=fp8 bf16:; do
  label=${run%%:*}; arg=${run#*:}
  timeout 100 python bench.py ${arg/=/ } --json "$OUT/bench_$label.json" > "$OUT/bench_$label.log" 2>&1
  python -c "import json;r=json.load(open('$OUT/bench_$label.json'));print('$label', r['tokens_per_s'], r['fraction_of_h200_limit'], round(r['copy_bytes_per_s']/1e12, 3))"
done
