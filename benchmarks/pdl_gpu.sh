#!/usr/bin/env bash
# Programmatic dependent launch on and off, on one H200 (about 6 minutes): the kernel and engine GPU
# tests with it on, benchmarks/step_parts.py (a decode step's parts, by batch size) and bench.py
# (bf16 and FP8 caches, alternating on/off twice) with NANOVLLM_PDL=1 and =0. Logs and JSON to $OUT.
#   PYTHONPATH=. bash benchmarks/pdl_gpu.sh [tests] [parts] [bench]   (all three by default)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
stages=${*:-tests parts bench}
nvidia-smi --query-gpu=name --format=csv,noheader
if [[ $stages == *tests* ]]; then
  timeout 240 python -m pytest -q tests/test_kernels_gpu.py tests/test_decode_graphs.py tests/test_fp8_kv.py \
    tests/test_gpu_engine.py tests/test_sampling_kernel.py > "$OUT/tests_pdl.txt" 2>&1
  echo "tests (PDL on), exit $?: $(tail -1 "$OUT/tests_pdl.txt")"
fi
if [[ $stages == *parts* ]]; then
  for pdl in 1 0; do
    NANOVLLM_PDL=$pdl python benchmarks/step_parts.py --json "$OUT/step_parts_pdl$pdl.json" \
      > "$OUT/step_parts_pdl$pdl.txt" 2>&1
    grep -E "PDL|batch|padding|contexts|lm_head" "$OUT/step_parts_pdl$pdl.txt"
  done
fi
if [[ $stages == *bench* ]]; then
  for round in 1 2; do
    for kv in auto fp8; do
      for pdl in 1 0; do
        NANOVLLM_PDL=$pdl python bench.py --kv-cache-dtype $kv --json "$OUT/bench_${kv}_pdl${pdl}_$round.json" \
          > "$OUT/bench_${kv}_pdl${pdl}_$round.txt" 2>&1
        echo "round $round kv $kv PDL $pdl: $(grep -m1 Throughput "$OUT/bench_${kv}_pdl${pdl}_$round.txt")"
      done
    done
  done
fi
