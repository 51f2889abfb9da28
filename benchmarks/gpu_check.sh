#!/usr/bin/env bash
# One device call: GPU tests, kernel benchmark, bench.py. Usage: bash benchmarks/gpu_check.sh [tests|bench|all]
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
git log --oneline -1 2>/dev/null || true
if [[ $what == tests || $what == all ]]; then
  timeout 300 python -m pytest -q -x tests/test_kernels_gpu.py tests/test_gpu_engine.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
fi
if [[ $what == bench || $what == all ]]; then
  timeout 120 python benchmarks/bench_kernels.py --json "$OUT/kernels.json" 2>&1 | tail -20
  timeout 240 python bench.py --json "$OUT/bench.json" 2>&1 | tail -5
fi
