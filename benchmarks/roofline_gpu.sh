#!/usr/bin/env bash
# The workload's limit on this GPU's measured figures (two H200s, about 2.5 minutes; run from the
# repository root; outputs in $OUT):   bash benchmarks/roofline_gpu.sh
# Prints the measured copy bandwidth and bf16 peak with the limits they give (python -m
# nanovllm.utils.roofline), the roofline tests, then bench.py (dummy weights) on the Qwen3-0.6B shapes
# at TP=1 and the Qwen3-8B shapes at TP=1 and TP=2, and a table of tokens/s against each limit.
#   bash benchmarks/roofline_gpu.sh profile   # instead: profile_bench.py for 0.6B TP=1, 8B TP=1 and
#                                              # 8B TP=2 (about 4 minutes; profile_*.txt in $OUT)
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [[ ${1:-} == profile ]]; then
  for run in "0.6b_tp1" "8b_tp1 --model configs/qwen3-8b" "8b_tp2 --model configs/qwen3-8b --tensor-parallel-size 2"; do
    set -- $run
    label=$1; shift
    timeout 150 python benchmarks/profile_bench.py --out "$OUT/profile_$label.txt" "$@" > "$OUT/profile_$label.log" 2>&1
    echo "[$label] exit $?: $(grep -E "^(whole run|decode steps)" "$OUT/profile_$label.txt" 2>/dev/null | tr '\n' ' ')"
  done
  exit 0
fi
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
CUDA_VISIBLE_DEVICES=0 timeout 60 python -m nanovllm.utils.roofline configs/qwen3-0.6b configs/qwen3-8b --tp 1 2
CUDA_VISIBLE_DEVICES=0 timeout 60 python -m pytest -q -p no:cacheprovider tests/test_roofline.py 2>&1 | tail -1
bench() {  # label, then bench.py's arguments
  local label=$1; shift
  timeout ${BENCH_TIMEOUT:-150} python bench.py --json "$OUT/bench_$label.json" "$@" > "$OUT/bench_$label.log" 2>&1
  local rc=$?
  grep -E "^(Total|Limit):" "$OUT/bench_$label.log" | sed "s/^/[$label] /"
  [[ $rc == 0 ]] || { echo "[$label] exit $rc:"; tail -25 "$OUT/bench_$label.log"; }
}
bench 0.6b_tp1
bench 8b_tp1 --model configs/qwen3-8b
bench 8b_tp2 --model configs/qwen3-8b --tensor-parallel-size 2
python - "$OUT" <<'PY'
import json, os, sys
print(f"{'run':<9} {'tokens/s':>9} {'limit':>7} {'of limit':>8} {'H200 doc.':>9} {'TB/s':>5} {'TFLOP/s':>7} {'start-up s':>10}")
for label in ("0.6b_tp1", "8b_tp1", "8b_tp2"):
    path = os.path.join(sys.argv[1], f"bench_{label}.json")
    if not os.path.exists(path):
        print(f"{label:<9} no record (see bench_{label}.log)")
        continue
    r = json.load(open(path))
    print(f"{label:<9} {r['tokens_per_s']:>9,.0f} {r['h200_limit_tokens_per_s']:>7,} {r['fraction_of_h200_limit']:>8.1%} "
          f"{r['documented_h200_limit_tokens_per_s']:>9,} {r['copy_bytes_per_s'] / 1e12:>5.2f} "
          f"{r['bf16_flop_per_s'] / 1e12:>7.0f} {r['startup_s']:>10}")
PY
