#!/usr/bin/env bash
# FlashAttention-4 on the GPU machine, which has no network and takes at most 64 MiB per call:
# the wheels travel in two halves (the cu13 libs wheel, 92 MB, split across them) over two calls
# on a warm machine, are joined and installed into /tmp/fa4site, then the FA4 tests and benchmarks run.
#
#   here, once:  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#                  --implementation cp --platform manylinux_2_28_x86_64 -d .whl-fa4 \
#                  flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
#                  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels \
#                  apache-tvm-ffi torch-c-dlpack-ext einops 'cuda-bindings>=13,<14' cuda-pathfinder protobuf
#                bash benchmarks/fa4_gpu.sh prepare        # .whl-fa4/part1/ and part2/, each < 60 MiB
#   GPU call 1:  bash benchmarks/fa4_gpu.sh half1          # carry [".whl-fa4/part1"]
#   GPU call 2:  bash benchmarks/fa4_gpu.sh half2 [WHAT]   # carry [".whl-fa4/part2"], within 30 s
#   later calls on the same warm machine: bash benchmarks/fa4_gpu.sh run WHAT
# WHAT: any of tests, bench (default: both, in that order); logs go to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
PARTS=${FA4_PARTS:-/tmp/fa4parts}
SITE=${FA4_SITE:-/tmp/fa4site}
OUT=${OUT:-/tmp/fa4out}
CU13=nvidia_cutlass_dsl_libs_cu13

prepare() {   # here: split the cu13 wheel and share the other wheels out between the halves
    local whl
    whl=$(ls .whl-fa4/${CU13}-*.whl)
    rm -rf .whl-fa4/part1 .whl-fa4/part2
    mkdir -p .whl-fa4/part1 .whl-fa4/part2
    (cd .whl-fa4 && sha256sum "$(basename "$whl")" > part2/"$CU13".sha256)
    split -b 50M "$whl" .whl-fa4/part1/"$CU13".part-
    mv .whl-fa4/part1/"$CU13".part-ab .whl-fa4/part2/
    test ! -e .whl-fa4/part1/"$CU13".part-ac   # two parts exactly
    for w in flash_attn_4 quack_kernels einops nvidia_cutlass_dsl-4 nvidia_cutlass_dsl_libs_core \
             torch_c_dlpack_ext protobuf cuda_pathfinder; do cp .whl-fa4/${w}*.whl .whl-fa4/part1/; done
    for w in cuda_bindings nvidia_cutlass_dsl_libs_base apache_tvm_ffi; do cp .whl-fa4/${w}*.whl .whl-fa4/part2/; done
    du -sh .whl-fa4/part1 .whl-fa4/part2
}

half1() {
    mkdir -p "$PARTS"
    cp .whl-fa4/part1/* "$PARTS"/
    ls -la "$PARTS"
    echo "half1 done: now call half2 with carry [\".whl-fa4/part2\"]"
}

install() {
    cp .whl-fa4/part2/* "$PARTS"/
    cd "$PARTS"
    local name
    name=$(awk '{print $2}' "$CU13".sha256)
    cat "$CU13".part-aa "$CU13".part-ab > "$name"
    sha256sum -c "$CU13".sha256
    # Wheels of what the machine already has are left out, so its own copies are not shadowed.
    local skip=()
    python3 -c "import cuda.bindings" 2>/dev/null && skip+=(cuda_bindings cuda_pathfinder)
    python3 -c "import google.protobuf" 2>/dev/null && skip+=(protobuf)
    python3 -c "import einops" 2>/dev/null && skip+=(einops)
    local wheels=()
    for w in *.whl; do
        local keep=1
        for s in "${skip[@]}"; do [[ $w == ${s}-* ]] && keep=0; done
        ((keep)) && wheels+=("$w")
    done
    echo "installing: ${wheels[*]}"
    # One pip call, so the wheels that share nvidia_cutlass_dsl/ merge into one folder.
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${wheels[@]}"
    cd - > /dev/null
}

fa4_env() {
    # A --target install skips the package's .pth, which puts dsl_packages on sys.path.
    export PYTHONPATH=".:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages"
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1   # compiled kernels on disk: each process reuses them
    python3 -c "import flash_attn.cute, torch; print('flash_attn.cute imports; GPU', torch.cuda.get_device_name())"
}

run() {
    set +e   # one failing piece still leaves the others to run; each prints its exit status
    mkdir -p "$OUT"
    local what=("$@")
    ((${#what[@]})) || what=(tests bench)
    for w in "${what[@]}"; do
        case $w in
        tests)
            timeout 420 python3 -m pytest -q -p no:cacheprovider -rs tests/test_fa4_gpu.py tests/test_gpu_engine.py \
                tests/test_prefill_attention.py 2>&1 | tee "$OUT/tests.log" | tail -25
            echo "tests: exit ${PIPESTATUS[0]}" ;;
        bench)
            for backend in flash_attn_4 torch_flash; do
                timeout 300 python3 bench.py --workload long --prefill-attention $backend --ttft-32k \
                    --json "$OUT/bench_long_$backend.json" 2>&1 | tee "$OUT/bench_long_$backend.log" | tail -4
                echo "bench long $backend: exit ${PIPESTATUS[0]}"
                timeout 200 python3 bench.py --prefill-attention $backend --json "$OUT/bench_default_$backend.json" \
                    2>&1 | tee "$OUT/bench_default_$backend.log" | tail -3
                echo "bench default $backend: exit ${PIPESTATUS[0]}"
            done ;;
        *) echo "unknown WHAT $w: use tests, bench" >&2; exit 2 ;;
        esac
    done
}

stage=${1:-}
shift || true
case $stage in
prepare) prepare ;;
half1) half1 ;;
half2) install; fa4_env; run "$@" ;;
run) fa4_env; run "$@" ;;
*) echo "usage: $0 prepare | half1 | half2 [tests bench] | run [tests bench]" >&2; exit 2 ;;
esac
