#!/usr/bin/env bash
# The peer-memory all-reduce on two GPUs, in one device call (about 8 minutes on nvidia-h200-x2):
#   1. benchmarks/all_reduce_bench.py: NCCL against the kernel per size, over a few grids;
#   2. bench.py on the Qwen3-8B shapes at TP=2, with the kernel (the default) and NCCL only;
#   3. the TP tests that exercise it (its check against NCCL, TP=2 == TP=1 with it,
#      a worker killed in the middle of a generate with CUDA graphs, the TP=2 lifecycle);
#   4. with the time left (PROFILE=0 skips it): profile_bench.py of the 8B shapes at TP=2.
# Outputs under $OUT (default /tmp/out).     PYTHONPATH=. bash benchmarks/all_reduce_gpu.sh
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
nvidia-smi -L | sed 's/ (UUID.*//'
SECONDS=0
timeout 150 python benchmarks/all_reduce_bench.py --programs 64 128 256 --block 2048 4096 \
  > "$OUT/all_reduce_bench.txt" 2>&1
echo "[all_reduce_bench exit $? at ${SECONDS}s]"; cat "$OUT/all_reduce_bench.txt" | tail -40
for run in "custom" "nccl --disable-custom-all-reduce"; do
  set -- $run
  label=$1; shift
  timeout 120 python bench.py --model configs/qwen3-8b --tensor-parallel-size 2 --json "$OUT/bench_8b_tp2_$label.json" "$@" \
    > "$OUT/bench_8b_tp2_$label.log" 2>&1
  echo "[bench 8b tp2 $label exit $? at ${SECONDS}s] $(grep -E '^Total' "$OUT/bench_8b_tp2_$label.log")"
done
timeout 300 python -m pytest -q -p no:cacheprovider --timeout 200 -rfE tests/test_tp_gpu.py \
  -k "peer or (tp1 and 2) or mid_generate" \
  tests/test_gpu_lifecycle.py::test_tp2_shutdown_frees_the_gpu_and_engines_start_again > "$OUT/tp_tests.log" 2>&1
echo "[pytest exit $? at ${SECONDS}s] $(tail -1 "$OUT/tp_tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/tp_tests.log"
if [[ ${PROFILE:-1} != 0 && $SECONDS -lt 430 ]]; then
  timeout $(( 575 - SECONDS )) python benchmarks/profile_bench.py --model configs/qwen3-8b --tensor-parallel-size 2 \
    --out "$OUT/profile_8b_tp2.txt" > "$OUT/profile_8b_tp2.log" 2>&1
  echo "[profile exit $? at ${SECONDS}s]"
  sed -n '/kernels of 5 eager decode/,$p' "$OUT/profile_8b_tp2.txt" | head -12
fi
