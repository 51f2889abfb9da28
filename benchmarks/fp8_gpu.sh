#!/usr/bin/env bash
# The FP8 KV cache on the GPU machine, one command (outputs in $OUT), best on nvidia-h200-x2: about 5
# minutes, the tests on GPU 1 alongside the rest on GPU 0; on one H200 about 6, with only the FP8 tests.
#   bash benchmarks/fp8_gpu.sh
# 1. decode bandwidth over an FP8 cache (batch 256 x context 1024, bf16 beside it; bench.py's mixed contexts)
# 2. bench.py --kv-cache-dtype fp8, then auto (bf16), then fp8 with --calculate-kv-scales
# 3. the FP8 decode kernel's tile sizes (bench_kernels.py --sweep tiles_fp8)
# 4. accuracy on a real model (MODEL=a Hugging Face folder, or GGUF=SmolLM2's GGUF file with gguf and
#    accelerate installed; skipped without either)
# 5. the GPU kernel tests and the FP8 engine tests (on GPU 1 alongside 1-4 when two GPUs are visible)
# and a summary table at the end.
#
# SmolLM2 (the demo model) on the GPU machine, which has no network and takes at most 64 MiB per
# call: its GGUF (98 MB) and the wheels that convert it (gguf, accelerate and those of their
# dependencies the machine lacks) travel in two halves over two calls on a warm machine.
#   here, once:  bash benchmarks/fp8_gpu.sh prepare          # .whl-gguf/part1 and part2, < 60 MiB each
#   GPU call 1:  bash benchmarks/fp8_gpu.sh half1            # carry [".whl-gguf/part1"]
#   GPU call 2:  bash benchmarks/fp8_gpu.sh half2 [WHAT...]  # carry [".whl-gguf/part2"]
#   later calls on the same warm machine: bash benchmarks/fp8_gpu.sh run WHAT...
# WHAT: profile (benchmarks/profile_bench.py --kv-cache-dtype fp8, about 1 minute), accuracy (greedy
# tokens far from transformers' fp32 argmax, bf16 vs FP8 cache, on SmolLM2; about 2 minutes with the
# conversion), startup (Triton compiles of start-up, FP8 and bf16, each with an empty and then a warm
# Triton cache; about 1 minute); default: all three, in that order. Logs in $OUT.
# ACCURACY_ARGS: more fp8_accuracy.py arguments (a quick try: "--num-prompts 2 --max-tokens 8").

full() {   # (the whole FP8 run described first; its body is not indented, for the heredocs)
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
timeout 150 python benchmarks/bench_kernels.py --sweep tiles_fp8 --json "$OUT/fp8_tiles.json" 2>&1 \
  | grep -v -i warn | tail -6
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
}

PARTS=/tmp/ggufparts
SITE=/tmp/site-gguf
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
WHEELS=(gguf==0.19.0 accelerate==1.15.0 psutil requests charset-normalizer idna urllib3 certifi pyyaml tqdm
        packaging)

prepare() {   # here, with a network: the wheels for the GPU machine's Python 3.12, and the GGUF in halves
    local gguf
    gguf=$(python3 -c "from nanovllm.utils.default_model import gguf_path; print(gguf_path())")
    mkdir -p .whl-gguf/all
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl-gguf/all "${WHEELS[@]}"
    rm -rf .whl-gguf/part1 .whl-gguf/part2
    mkdir -p .whl-gguf/part1 .whl-gguf/part2
    split -n 2 "$gguf" .whl-gguf/part1/gguf.part-
    mv .whl-gguf/part1/gguf.part-ab .whl-gguf/part2/
    (cd "$(dirname "$gguf")" && sha256sum "$GGUF_NAME") > .whl-gguf/part2/gguf.sha256
    cp .whl-gguf/all/*.whl .whl-gguf/part2/
    du -sh .whl-gguf/part1 .whl-gguf/part2
}

half1() {
    mkdir -p "$PARTS"
    cp .whl-gguf/part1/* "$PARTS"/
    ls -la "$PARTS"
    echo "half1 done: now call half2 with carry [\".whl-gguf/part2\"] on this warm machine"
}

install() {   # join the GGUF, check it, and install what this Python lacks of the wheels into $SITE
    cp .whl-gguf/part2/* "$PARTS"/
    cat "$PARTS"/gguf.part-aa "$PARTS"/gguf.part-ab > "$PARTS/$GGUF_NAME"
    (cd "$PARTS" && sha256sum -c gguf.sha256) || return 1
    python benchmarks/install_wheels.py "$PARTS" "$SITE" gguf accelerate || return 1
    export PYTHONPATH=".:$SITE"
    python -c "import gguf, accelerate, transformers
print('gguf and accelerate import; accelerate', accelerate.__version__, 'transformers', transformers.__version__)"
}

run() {
    local what=("$@")
    ((${#what[@]})) || what=(profile accuracy startup)
    for w in "${what[@]}"; do
        case $w in
        accuracy)   # converts the GGUF beside itself once (CPU, about 30 s), then 3 engines + fp32 transformers
            timeout 240 python benchmarks/fp8_accuracy.py --gguf "$PARTS/$GGUF_NAME" \
                --json "$OUT/fp8_accuracy.json" $ACCURACY_ARGS > "$OUT/fp8_accuracy.log" 2>&1
            echo "accuracy: exit $?"; grep -v -i warn "$OUT/fp8_accuracy.log" | tail -6 ;;
        profile)
            timeout 150 python benchmarks/profile_bench.py --kv-cache-dtype fp8 --out "$OUT/profile_fp8.txt" \
                > "$OUT/profile_fp8.log" 2>&1
            echo "profile: exit $?"
            if [[ -s $OUT/profile_fp8.txt ]]; then cat "$OUT/profile_fp8.txt"; else tail -25 "$OUT/profile_fp8.log"; fi ;;
        startup)   # an empty Triton cache each (a fresh machine's first process), then the same one warm
            for dtype in fp8 auto; do
                rm -rf "/tmp/triton-$dtype"
                for pass in cold warm; do
                    timeout 90 python benchmarks/startup_compiles.py --kv-cache-dtype $dtype \
                        --triton-cache "/tmp/triton-$dtype" --json "$OUT/startup_${dtype}_$pass.json" \
                        > "$OUT/startup_${dtype}_$pass.log" 2>&1
                    echo "startup $dtype $pass: exit $?"
                    grep -v -i warn "$OUT/startup_${dtype}_$pass.log" | if [[ $pass == cold ]]; then cat; else head -1; fi
                done
            done ;;
        *) echo "unknown WHAT $w: use profile, accuracy, startup" >&2; return 2 ;;
        esac
    done
}

export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
stage=${1:-full}
shift || true
case $stage in
full) full ;;
prepare) prepare ;;
half1) half1 ;;
half2) install || echo "the GGUF or its wheels are not ready: the accuracy run will fail"
       export PYTHONPATH=".:$SITE"; run "$@" ;;
run) export PYTHONPATH=".:$SITE"; run "$@" ;;
*) echo "usage: $0 [full] | prepare | half1 | half2 [profile accuracy startup] | run WHAT..." >&2; exit 2 ;;
esac
