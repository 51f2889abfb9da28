#!/usr/bin/env bash
# The full GPU check of one call: every test (CPU-only ones too, on the GPU box), then the benchmarks.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
git log --oneline -1 2>/dev/null
timeout 330 python -m pytest -q -x tests --deselect tests/test_default_model.py --deselect tests/test_smollm2.py \
  -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|error|FAIL" | tail -8
timeout 60 python benchmarks/bench_kernels.py --json "$OUT/kernels.json" 2>&1 | grep -v -i warn | tail -14
timeout 150 python bench.py --json "$OUT/bench_t06.json" --prefix-cache 2>&1 | grep -v -i warn | tail -2
timeout 100 python bench.py --temperature 0 --json "$OUT/bench_greedy.json" 2>&1 | grep -v -i warn | tail -1
