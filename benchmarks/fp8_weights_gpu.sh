#!/usr/bin/env bash
# FP8 weights on the GPU machine (outputs in $OUT; one H200), in parts that each fit one call:
#   bash benchmarks/fp8_weights_gpu.sh tests      # tests/test_fp8_gpu.py, then the FP8 CPU tests (~3 min)
#   bash benchmarks/fp8_weights_gpu.sh bench8b    # Qwen3-8B shapes: bf16, --quantization fp8 (per
#                                                 # channel), the block format with each BLOCK_GEMM
#   bash benchmarks/fp8_weights_gpu.sh bench30b   # Qwen3-30B-A3B shapes: bf16, fp8 per channel, block
#   MODEL=FOLDER bash benchmarks/fp8_weights_gpu.sh accuracy   # fp8_weights_accuracy.py (64 x 128);
#                                                 # SmolLM2 reaches the machine as benchmarks/fp8_gpu.sh says
# The vLLM comparison: benchmarks/vs_vllm.py --model configs/qwen3-8b --nano-option quantization=fp8
#   --vllm-option quantization=fp8 (docs/fp8.md).
set -u
OUT=${OUT:-/tmp/fp8w}; mkdir -p "$OUT"
git log --oneline -1 2>/dev/null
bench() {  # label, then bench.py's arguments (bench_with.py when the first is a KNOB=VALUE)
  local label=$1; shift
  if [[ $1 == *=* ]]; then
    timeout 280 python benchmarks/bench_with.py "$1" -- --json "$OUT/bench_$label.json" "${@:2}" > "$OUT/bench_$label.log" 2>&1
  else
    timeout 280 python bench.py --json "$OUT/bench_$label.json" "$@" > "$OUT/bench_$label.log" 2>&1
  fi
  local rc=$?
  grep -v -i warn "$OUT/bench_$label.log" | grep -E "^Total|Error|error" | tail -$([[ $rc == 0 ]] && echo 1 || echo 25) | sed "s/^/[$label rc=$rc] /"
}
case "${1:-tests}" in
  tests)
    timeout 400 python -m pytest -q -p no:cacheprovider tests/test_fp8_gpu.py 2>&1 | tail -15
    timeout 150 python -m pytest -q -p no:cacheprovider tests/test_fp8.py 2>&1 | tail -3 ;;
  bench8b)
    bench 8b_bf16 --model configs/qwen3-8b
    bench 8b_fp8 --model configs/qwen3-8b --quantization fp8
    bench 8b_fp8_block --model configs/qwen3-8b-fp8
    bench 8b_fp8_block_cublas 'nanovllm.kernels.fp8_gemm.BLOCK_GEMM="cublas"' --model configs/qwen3-8b-fp8 ;;
  bench30b)
    bench 30b_bf16 --model configs/qwen3-30b-a3b
    bench 30b_fp8 --model configs/qwen3-30b-a3b --quantization fp8
    bench 30b_fp8_block --model configs/qwen3-30b-a3b-fp8 ;;
  accuracy)
    timeout 500 python benchmarks/fp8_weights_accuracy.py ${MODEL:+--model "$MODEL"} --json "$OUT/fp8_weights_accuracy.json" 2>&1 | grep -v -i warn | tail -5 ;;
esac
