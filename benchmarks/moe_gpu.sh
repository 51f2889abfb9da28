#!/usr/bin/env bash
# Qwen3-MoE on the GPU machine (run from the repository root; outputs in $OUT):
#   bash benchmarks/moe_gpu.sh      one H200, about 5 minutes: the MoE kernel GPU tests, bench.py on the
#                                   Qwen3-30B-A3B shapes with dummy weights, a quick tile sweep of the kernels
#   bash benchmarks/moe_gpu.sh tp   two H200s: bench.py at TP=2, then one rank's shard (inter 384) timed
#   bash benchmarks/moe_gpu.sh profile   one H200: benchmarks/profile_bench.py on the 30B-A3B shapes (about 5 minutes)
# Ends with a table: tokens/s against the workload's limit (nanovllm/utils/roofline.py, docs/moe.md).
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
git log --oneline -1 2>/dev/null
MODEL=configs/qwen3-30b-a3b
bench() {  # label, then bench.py's arguments
  local label=$1; shift
  timeout ${BENCH_TIMEOUT:-240} python bench.py --model $MODEL --json "$OUT/bench_$label.json" "$@" > "$OUT/bench_$label.log" 2>&1
  local rc=$?
  grep -v -i warn "$OUT/bench_$label.log" | tail -$([[ $rc == 0 ]] && echo 1 || echo 25) | sed "s/^/[$label rc=$rc] /"
}
if [[ $1 == profile ]]; then
  for part in host kernels; do   # one engine per process: the 61 GB model fits the GPU once
    CUDA_VISIBLE_DEVICES=0 timeout 280 python benchmarks/profile_bench.py --model $MODEL --skip-$part \
      --gpu-memory-utilization 0.9 --out "$OUT/moe_profile_no_$part.txt" 2>&1 | grep -v -i warn | tail -30
  done
  exit
fi
if [[ $1 == tp ]]; then
  bench tp2 --tensor-parallel-size 2
  CUDA_VISIBLE_DEVICES=0 timeout 90 python benchmarks/moe_sweep.py --inter 384 --no-sweep --json "$OUT/moe_kernels_tp2.json" \
    2>&1 | grep -v -i warn
else
  export CUDA_VISIBLE_DEVICES=0
  timeout 150 python -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py -k moe > "$OUT/moe_gpu_tests.log" 2>&1
  grep -E "passed|failed|error" "$OUT/moe_gpu_tests.log" | tail -2; grep -E "^(FAILED|ERROR)" "$OUT/moe_gpu_tests.log" | head
  bench tp1
  timeout ${SWEEP_TIMEOUT:-150} python benchmarks/moe_sweep.py --quick --json "$OUT/moe_sweep.json" 2>&1 | grep -v -i warn
fi
python - "$OUT" <<'PY'
import glob, json, os, sys
print(f"{'run':<6} {'tokens/s':>9} {'limit':>7} {'of limit':>8} {'start-up s':>10}")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "bench_*.json"))):
    r = json.load(open(path))
    print(f"tp{r['tp']:<4} {r['tokens_per_s']:>9,.0f} {r['h200_limit_tokens_per_s']:>7,} "
          f"{r['fraction_of_h200_limit']:>8.1%} {r['startup_s']:>10}")
PY
