#!/usr/bin/env bash
# The GPU check, in two device calls on nvidia-h200-x2:
#   bash benchmarks/final_gpu.sh tests   GPU tests (one GPU, then TP over two), kernel and 0.6B benchmarks
#   bash benchmarks/final_gpu.sh tp      bench.py at TP=1 and TP=2 on the Qwen3-8B shapes (dummy weights)
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
if [[ $1 == tests ]]; then
  timeout 200 python -m pytest -q tests/test_kernels_gpu.py tests/test_gpu_engine.py tests/test_sampling_kernel.py \
    -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|error|FAIL" | tail -8
  timeout 150 python -m pytest -q tests/test_tp_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/tp_tests.log" \
    | grep -E "passed|failed|error|FAIL" | tail -8
  timeout 40 python benchmarks/bench_kernels.py --json "$OUT/kernels.json" 2>&1 | grep -v -i warn | tail -14
  timeout 110 python bench.py --json "$OUT/bench_t06.json" --prefix-cache 2>&1 | grep -v -i warn | tail -2
  timeout 70 python bench.py --temperature 0 --json "$OUT/bench_greedy.json" 2>&1 | grep -v -i warn | tail -1
fi
if [[ $1 == tp ]]; then
  for tp in 1 2; do
    timeout 150 python bench.py --model configs/qwen3-8b --tensor-parallel-size $tp --json "$OUT/bench_8b_tp$tp.json" \
      2>&1 | grep -v -i warn | tail -1
  done
fi
