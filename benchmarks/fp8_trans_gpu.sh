#!/usr/bin/env bash
# The transposed FP8 decode dots (Fp8Decode.transposed: S^T = K Q^T, O^T += V^T P^T, the query heads
# as the dots' N) in one device call on one H200 (about 6 minutes): the FP8 GPU kernel and engine
# tests, the decode sweep of the default against the transposed tiles in CUDA graphs, then bench.py
# --kv-cache-dtype fp8 alternating the default and the sweep's fastest transposed tile
# (benchmarks/knob_ab.py, 2 rounds). Logs in $OUT (default /tmp/out).
#
#   bash benchmarks/fp8_trans_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python -m pytest -q -p no:cacheprovider --timeout 150 -rfE tests/test_kernels_gpu.py -k fp8 \
  tests/test_fp8_kv.py > "$OUT/trans_tests.log" 2>&1
echo "GPU tests: exit $? ($(tail -n 1 "$OUT/trans_tests.log"))"
grep -E "^(FAILED|ERROR)" "$OUT/trans_tests.log" | head -20
timeout 240 python benchmarks/fp8_decode_sweep.py --graph --only "64x1 asm" trans \
  --json "$OUT/trans_sweep.json" > "$OUT/trans_sweep.txt" 2>&1
echo "sweep: exit $?"; grep -v -i warn "$OUT/trans_sweep.txt" | tail -n 48
# the fastest transposed variant (fp8_decode_sweep.fastest: correct on every case, best mean of copy)
best=$(python - "$OUT/trans_sweep.json" <<'PY'
import json, sys
sys.path.insert(0, "benchmarks")
from fp8_decode_sweep import fastest
d = json.load(open(sys.argv[1]))
name = fastest(d["results"], [n for n in d["variants"] if "trans" in n])[0][1]
print(d["variants"][name]["block_n"], d["variants"][name]["num_warps"])
PY
)
read -r bn warps <<< "$best"
echo "bench.py A/B: default against transposed ${bn} x ${warps}"
F=nanovllm.kernels.decode_attention.FP8_DECODE
python benchmarks/knob_ab.py --rounds 2 --logs "$OUT/trans_bench" --variant default \
  --variant "trans-${bn}x${warps}" $F.block_n=$bn $F.num_warps=$warps $F.transposed=True \
  -- --kv-cache-dtype fp8 | tee "$OUT/trans_runs.txt"
