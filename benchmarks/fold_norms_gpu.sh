#!/usr/bin/env bash
# Folded RMSNorms (nanovllm.models.llama.FOLD_NORMS) off against on, in one device call on one H200
# (about 7 minutes): the GPU tests the fold touches, then bench.py alternating off / on in the same
# tree (benchmarks/knob_ab.py): 3 rounds on the default workload, 2 with the FP8 cache, 1 on the
# Qwen3-8B shapes; the medians and on / off. Logs in $OUT (default /tmp/out).
#
#   bash benchmarks/fold_norms_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 220 python -m pytest -q -p no:cacheprovider --timeout 120 -rfE tests/test_kernels_gpu.py \
  tests/test_gpu_engine.py tests/test_fp8_kv.py tests/test_triton_engine.py > "$OUT/fold_tests.log" 2>&1
echo "GPU tests: exit $? ($(tail -1 "$OUT/fold_tests.log"))"
grep -E "^(FAILED|ERROR)" "$OUT/fold_tests.log" | head -20
F=nanovllm.models.llama.FOLD_NORMS
for run in "auto 3" "fp8 2 --kv-cache-dtype fp8" "8b 1 --model configs/qwen3-8b"; do
  set -- $run
  label=$1 rounds=$2; shift 2
  echo "== $label"
  python benchmarks/knob_ab.py --rounds "$rounds" --logs "$OUT/$label" --variant off $F=False \
    --variant on $F=True -- "$@"
done | tee "$OUT/fold_runs.txt"
