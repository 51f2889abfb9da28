#!/usr/bin/env bash
# The FP8 decode split target (Fp8Decode.programs_per_sm, 8 since this change; 4 before, the bf16
# cache's PROGRAMS_PER_SM) and the bf16 tile width (BLOCK_N 128 / 64) A/B'd with knob_ab.py, after the
# FP8 and decode GPU tests (one H200, ~6 min).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python -m pytest -q -p no:cacheprovider --timeout 120 -rfE tests/test_kernels_gpu.py \
  tests/test_fp8_kv.py > "$OUT/tests.log" 2>&1
echo "GPU tests: exit $? ($(tail -n 1 "$OUT/tests.log"))"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head
DA=nanovllm.kernels.decode_attention
python benchmarks/knob_ab.py --rounds 3 --logs "$OUT/fp8" --variant p8 --variant p4 $DA.FP8_DECODE.programs_per_sm=4 \
  --variant p6 $DA.FP8_DECODE.programs_per_sm=6 -- --kv-cache-dtype fp8 2>&1
python benchmarks/knob_ab.py --rounds 3 --logs "$OUT/bf16" --variant n128 --variant n64 $DA.BLOCK_N=64 2>&1
