#!/usr/bin/env bash
# The GPU check in one call: the GPU tests (and the reliability tests, which run on CUDA), then the benchmarks.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
git log --oneline -1 2>/dev/null
timeout 330 python -m pytest -q tests/test_kernels_gpu.py tests/test_gpu_engine.py tests/test_sampling_kernel.py \
  tests/test_reliability.py tests/test_validation.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|error|FAIL" | tail -8
timeout 60 python benchmarks/bench_kernels.py --json "$OUT/kernels.json" 2>&1 | grep -v -i warn | tail -14
timeout 150 python bench.py --json "$OUT/bench_t06.json" --prefix-cache 2>&1 | grep -v -i warn | tail -2
timeout 100 python bench.py --temperature 0 --json "$OUT/bench_greedy.json" 2>&1 | grep -v -i warn | tail -1
