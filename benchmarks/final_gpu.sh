#!/usr/bin/env bash
# The GPU check, in two device calls on nvidia-h200-x2 (each under 10 minutes; outputs in $OUT):
#   bash benchmarks/final_gpu.sh perf   GPU tests on GPU 1 while GPU 0 runs bench.py (async scheduling
#                                       on and off, greedy, prefix cache), the kernel benchmarks and the profile
#   bash benchmarks/final_gpu.sh tp     TP=2 with CUDA graphs against TP=1 (tracebacks of every process if it
#                                       hangs), tests/test_tp_gpu.py, bench.py on the Qwen3-8B shapes at TP=1, 2
#   bash benchmarks/final_gpu.sh tune   bench.py with tuning constants changed (see the tune branch below)
# The whole test suite and the two bench.py figures in one call: bash benchmarks/gpu_check.sh.
case ${1:-} in
  perf|tp|tune) ;;
  *) echo "usage: bash benchmarks/final_gpu.sh perf|tp|tune (the test suite: bash benchmarks/gpu_check.sh)" >&2
     exit 2 ;;
esac
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
git log --oneline -1 2>/dev/null
bench() {  # label, then bench.py's arguments
  local label=$1; shift
  CUDA_VISIBLE_DEVICES=0 timeout 120 python bench.py --json "$OUT/bench_$label.json" "$@" > /tmp/bench_$label.log 2>&1
  local rc=$?  # on failure, the traceback's end
  grep -v -i warn /tmp/bench_$label.log | tail -$([[ $rc == 0 ]] && echo 2 || echo 25) | sed "s/^/[$label rc=$rc] /"
}
if [[ $1 == perf ]]; then
  CUDA_VISIBLE_DEVICES=1 timeout 420 python -m pytest -q tests/test_kernels_gpu.py tests/test_gpu_engine.py \
    tests/test_sampling_kernel.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1 &
  tests=$!
  bench t06 --prefix-cache
  bench t06_sync --no-async-scheduling
  bench greedy --temperature 0
  CUDA_VISIBLE_DEVICES=0 timeout 120 python benchmarks/bench_kernels.py --json "$OUT/kernels.json" 2>&1 | grep -v -i warn | tail -30
  CUDA_VISIBLE_DEVICES=0 timeout 150 python benchmarks/profile_bench.py --out "$OUT/profile.txt" 2>&1 | grep -v -i warn | tail -50
  wait $tests
  grep -E "passed|failed" "$OUT/gpu_tests.log" | tail -2
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -12
fi
if [[ $1 == tune ]]; then   # GPU 1: a split-count sweep (SWEEP=all|decode|sampler|stages), bench_gemm.py (GEMM=1),
                            # then the GPU tests; GPU 0: ROUNDS x VARIANTS x TEMPS bench.py runs, then the profile (PROFILE=1)
  (CUDA_VISIBLE_DEVICES=1 timeout 240 python -m pytest -q tests/test_kernels_gpu.py tests/test_gpu_engine.py \
     tests/test_sampling_kernel.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
   [[ -n $GEMM ]] && CUDA_VISIBLE_DEVICES=1 timeout 200 python benchmarks/bench_gemm.py > "$OUT/gemm.txt" 2>&1
   CUDA_VISIBLE_DEVICES=1 timeout 120 python benchmarks/bench_kernels.py --sweep ${SWEEP:-all} --json "$OUT/sweep.json" \
     > "$OUT/sweep.txt" 2>&1) &
  side=$!
  # bench.py with module constants of nanovllm.kernels set first. VARIANTS: space-separated, each
  # "default" or comma-separated module.NAME=int (a module of nanovllm.kernels) or blas=cublaslt,
  # e.g. "default sampling.FAST_LOG=0 blas=cublaslt,sampling.NUM_WARPS=4"
  with_knobs='import importlib, sys, runpy, torch
for knob in filter(None, sys.argv[1].replace("default", "").split(",")):
    name, value = knob.split("=")
    if name == "blas":   # blas=cublaslt: torch.backends.cuda.preferred_blas_library
        torch.backends.cuda.preferred_blas_library(value)
        continue
    module, attr = name.rsplit(".", 1)
    module = importlib.import_module("nanovllm.kernels." + module)
    setattr(module, attr, type(getattr(module, attr))(int(value)))
sys.argv = ["bench.py"] + sys.argv[2:]
runpy.run_path("bench.py", run_name="__main__")'
  for round in $(seq ${ROUNDS:-1}); do
    for variant in ${VARIANTS:-default}; do
      for temp in ${TEMPS:-0.6 0}; do
        CUDA_VISIBLE_DEVICES=0 timeout 100 python -c "$with_knobs" $variant --temperature $temp $BENCH_ARGS \
          2>&1 | grep -v -i warn | tail -${BENCH_LINES:-1} | sed "s/^/[$variant T=$temp] /"
      done
    done
  done
  [[ -n $PROFILE ]] && CUDA_VISIBLE_DEVICES=0 timeout 150 python benchmarks/profile_bench.py --out "$OUT/profile.txt" \
    2>&1 | grep -v -i warn | head -14
  wait $side
  grep -v -i warn "$OUT/sweep.txt" | tail -25
  [[ -n $GEMM ]] && grep -v -i warn "$OUT/gemm.txt" | tail -30
  grep -E "passed|failed" "$OUT/gpu_tests.log" | tail -2
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -12
fi
if [[ $1 == tp ]]; then
  PYTHONPATH=benchmarks/hang_dump:. HANG_DUMP_AFTER=100 timeout 150 python benchmarks/tp_equality.py --graphs 2>&1 \
    | grep -v -i warn | tail -60
  # --timeout (pytest-timeout, on the GPU machine): a test that hangs fails with its stacks, the rest still run
  timeout 300 python -m pytest -q tests/test_tp_gpu.py -p no:cacheprovider --durations=0 --timeout 120 \
    > "$OUT/tp_tests.log" 2>&1
  grep -E "passed|failed|s call" "$OUT/tp_tests.log" | tail -12
  for tp in 1 2; do
    timeout 150 python bench.py --model configs/qwen3-8b --tensor-parallel-size $tp --json "$OUT/bench_8b_tp$tp.json" \
      2>&1 | grep -v -i warn | tail -1
  done
fi
