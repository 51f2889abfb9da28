#!/usr/bin/env bash
# The FP8 KV cache on the GPU machine, one command (outputs in $OUT), best on nvidia-h200-x2: about 5
# minutes, the tests on GPU 1 alongside the rest on GPU 0; on one H200 about 6, with only the FP8 tests.
#   bash benchmarks/fp8_gpu.sh
# 1. decode bandwidth over an FP8 cache (batch 256 x context 1024, bf16 beside it; bench.py's mixed contexts)
# 2. bench.py --kv-cache-dtype fp8, then auto (bf16), then fp8 with --calculate-kv-scales
# 3. the FP8 decode kernel's variants (benchmarks/fp8_decode_sweep.py); bench.py fp8 again with the
#    fastest when that is not the default
# 4. accuracy on a real model (MODEL=a Hugging Face folder, or GGUF=SmolLM2's GGUF file with gguf and
#    accelerate installed; skipped without either)
# 5. the GPU kernel tests and the FP8 engine tests (on GPU 1 alongside 1-4 when two GPUs are visible)
# and a summary table at the end.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
git log --oneline -1 2>/dev/null
run_tests() { timeout 280 python -m pytest -q -p no:cacheprovider "$@" > "$OUT/fp8_tests.log" 2>&1; }
if [[ $(nvidia-smi -L | wc -l) -ge 2 ]]; then   # every GPU kernel test (bf16 too) and the engine's
  (export CUDA_VISIBLE_DEVICES=1; run_tests tests/test_kernels_gpu.py tests/test_fp8_kv.py tests/test_gpu_engine.py) &
  tests=$!
fi
export CUDA_VISIBLE_DEVICES=0
bench() {  # label, then bench.py's arguments
  local label=$1; shift
  timeout 100 python bench.py --json "$OUT/bench_$label.json" "$@" > "$OUT/bench_$label.log" 2>&1
  local rc=$?
  grep -v -i warn "$OUT/bench_$label.log" | tail -$([[ $rc == 0 ]] && echo 1 || echo 25) | sed "s/^/[$label rc=$rc] /"
}
timeout 60 python benchmarks/bench_kernels.py --fp8 --json "$OUT/fp8_kernels.json" 2>&1 | grep -v -i warn | tail -12
bench fp8 --kv-cache-dtype fp8
bench auto
bench fp8_calc --kv-cache-dtype fp8 --calculate-kv-scales
timeout 270 python benchmarks/fp8_decode_sweep.py --json "$OUT/fp8_sweep.json" 2>&1 | grep -v -i warn | tail -22
# The fastest correct variant of the sweep: bench.py with it when it is not the default.
best=$(python - "$OUT/fp8_sweep.json" <<'PY'
import json, sys
sys.path.insert(0, "benchmarks")
from fp8_decode_sweep import fastest
from nanovllm.kernels import decode_attention as d
try:
    data = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit()
ranked = fastest(data["results"], list(data["variants"]))
if ranked and d.Fp8Decode(**data["variants"][ranked[0][1]]) != d.FP8_DECODE:
    print(json.dumps(data["variants"][ranked[0][1]]))
PY
)
if [[ -n $best ]]; then
  echo "fastest FP8 decode variant is not the default: bench.py with it ($best)"
  timeout 100 python -c "
import json, runpy, sys
from nanovllm.kernels import decode_attention as d
d.FP8_DECODE = d.Fp8Decode(**json.loads(sys.argv[1]))
sys.argv = ['bench.py', '--kv-cache-dtype', 'fp8', '--json', '$OUT/bench_fp8_fastest.json']
runpy.run_path('bench.py', run_name='__main__')" "$best" 2>&1 | grep -v -i warn | tail -1 | sed "s/^/[fp8 fastest] /"
fi
if [[ -n $MODEL || -n $GGUF ]]; then
  timeout 150 python benchmarks/fp8_accuracy.py ${MODEL:+--model "$MODEL"} ${GGUF:+--gguf "$GGUF"} \
    --json "$OUT/fp8_accuracy.json" 2>&1 | grep -v -i warn | tail -6
else
  echo "accuracy skipped: set MODEL to a Hugging Face folder or GGUF to a GGUF file (SmolLM2's)"
fi
if [[ -n $tests ]]; then wait $tests; else run_tests tests/test_kernels_gpu.py tests/test_fp8_kv.py -k fp8; fi
grep -E "passed|failed" "$OUT/fp8_tests.log" | tail -2
grep -E "^(FAILED|ERROR)" "$OUT/fp8_tests.log" | head -12
python - "$OUT" <<'PY'
import glob, json, os, sys
print(f"\n{'bench.py run':22s} {'tok/s':>9s} {'of limit':>9s} {'KV tokens':>10s} {'start-up':>9s}")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "bench_*.json"))):
    r = json.load(open(path))
    frac = f"{r['fraction_of_h200_limit']:.1%}" if r.get("fraction_of_h200_limit") else "-"
    print(f"{os.path.basename(path)[6:-5]:22s} {r['tokens_per_s']:9,.0f} {frac:>9s} {r['kv_cache_tokens']:10,d} "
          f"{r['startup_s']:8.1f}s")
try:
    rows = json.load(open(os.path.join(sys.argv[1], "fp8_kernels.json")))["results"]
    for r in rows[:2]:
        print(f"{r['case']:40s} {r['bytes_per_s'] / 1e12:.2f} TB/s ({r['of_copy']:.1%} of copy)")
except (OSError, ValueError, KeyError):
    print("no kernel figures")
PY
