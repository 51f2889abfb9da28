#!/usr/bin/env bash
# The GPU figures of structured outputs (issue 18), data parallelism on Ray (issue 20) and the MoE
# model at TP=2 (issue 19): one stage per device call, each under 8 minutes, run from the repository
# root. Logs and bench.py's JSON records go to $OUT (default /tmp/out; at most 5 files a stage); each
# stage ends with a short table.
#
#   stage        machine          carry           what
#   structured   nvidia-h200      [".whl-xgr"]    bench.py free, then every request constrained by one
#                                                 JSON schema (--structured-json, SmolLM2's tokenizer on
#                                                 Qwen3-0.6B's shapes), beside plain bench.py; the
#                                                 structured-output and bitmask GPU tests
#   ray          nvidia-h200-x2   [".whl-ray"]    bench.py on one GPU, then --data-parallel-size 2 (two
#                                                 Ray replicas, a GPU each); tests/test_ray.py
#   moe-tp       nvidia-h200-x2   []              the MoE tests with CUDA hidden (the interpreter, under
#                                                 the machine's triton) and the MoE kernel GPU tests, then
#                                                 `bash benchmarks/moe_gpu.sh tp` (its own table)
#
#   bash benchmarks/scaleout_gpu.sh structured
#   GPU=1 bash benchmarks/scaleout_gpu.sh structured   # the structured stage on GPU 1 of two
#
# The GPU machine has no package index. .whl-xgr (xgrammar, apache-tvm-ffi, pydantic; and
# smollm2-tokenizer/, the demo model's tokenizer files) and .whl-ray (ray without its Java jars, and
# its requirements) are git-ignored folders of Python 3.12 manylinux wheels made on the development
# machine; benchmarks/install_wheels.py installs into /tmp/site only what this Python lacks of them.
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:-}
case $STAGE in structured|ray|moe-tp) ;; *) echo "usage: $0 structured|ray|moe-tp" >&2; exit 2 ;; esac
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
git log --oneline -1 2>/dev/null
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

install() {  # wheel folder, top-level package
  [[ -d $1 ]] || { echo "$1 is missing: carry it with the call" >&2; exit 2; }
  python benchmarks/install_wheels.py "$1" /tmp/site "$2" || exit 1
}
bench() {  # label, time limit in seconds, then bench.py's arguments
  local label=$1 limit=$2; shift 2
  timeout -k 10 "$limit" python bench.py --json "$OUT/bench_$label.json" "$@" > "$OUT/bench_$label.log" 2>&1
  local rc=$?
  grep -v -i warn "$OUT/bench_$label.log" | grep -v "^\s*$" | tail -$([[ $rc == 0 ]] && echo 2 || echo 25) \
    | sed "s/^/[$label rc=$rc] /"
}
tests() {  # label, time limit in seconds, then pytest's arguments
  local label=$1 limit=$2; shift 2
  timeout -k 10 "$limit" python -m pytest -q -p no:cacheprovider -rfEs "$@" > "$OUT/tests_$label.log" 2>&1
  echo "[tests $label rc=$?] $(tail -1 "$OUT/tests_$label.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/tests_$label.log" | head -10
}

start=$SECONDS
if [[ $STAGE == structured ]]; then
  install .whl-xgr xgrammar
  export NANOVLLM_TOKENIZER=$PWD/.whl-xgr/smollm2-tokenizer
  export CUDA_VISIBLE_DEVICES=${GPU:-0}   # GPU=1: alongside another job on GPU 0
  bench default 90
  bench structured 240 --structured-json --tokenizer "$NANOVLLM_TOKENIZER"
  tests structured 120 tests/test_structured_outputs.py \
    tests/test_sampling_kernel.py::test_gpu_fused_sampler_never_draws_a_masked_token
elif [[ $STAGE == ray ]]; then
  install .whl-ray ray
  CUDA_VISIBLE_DEVICES=0 bench dp1 90
  bench dp2 180 --data-parallel-size 2
  grep -E "^  (replica|driver)" "$OUT/bench_dp2.log" | sed "s/^/[dp2] /"   # each replica's share and time
  CUDA_VISIBLE_DEVICES= tests ray 180 tests/test_ray.py
  python -m ray.scripts.scripts stop --force > /dev/null 2>&1   # any Ray process a timeout left behind
else
  CUDA_VISIBLE_DEVICES= tests moe_interp 90 tests/test_moe.py
  CUDA_VISIBLE_DEVICES=0 tests moe_gpu 90 tests/test_kernels_gpu.py -k moe
  BENCH_TIMEOUT=200 bash benchmarks/moe_gpu.sh tp
fi
echo "stage $STAGE: $(( SECONDS - start )) s"

python - "$OUT" "$STAGE" <<'EOF'
import json, os, sys
out, stage = sys.argv[1:]


def record(label):
    path = os.path.join(out, f"bench_{label}.json")
    return json.load(open(path)) if os.path.exists(path) else None


def row(name, value, note=""):
    print(f"{name:44s} {value:>14s}  {note}")


print()
if stage == "structured":
    default, s = record("default"), record("structured")
    row("bench.py (no tokenizer)", f"{default['tokens_per_s']:,.0f} tok/s" if default else "FAILED")
    if s and "structured_tokens_per_s" in s:
        row("bench.py free, SmolLM2 tokenizer", f"{s['tokens_per_s']:,.0f} tok/s", "(no prefix caching)")
        row("bench.py, every request JSON-constrained", f"{s['structured_tokens_per_s']:,.0f} tok/s",
            f"{s['structured_vs_free']:.1%} of free (goal >= 90%); {s['structured_ended_early']} ended by "
            f"the grammar")
    else:
        row("bench.py --structured-json", "FAILED", "see bench_structured.log")
elif stage == "ray":
    one, two = record("dp1"), record("dp2")
    row("bench.py, one engine on GPU 0", f"{one['tokens_per_s']:,.0f} tok/s" if one else "FAILED")
    row("bench.py --data-parallel-size 2", f"{two['tokens_per_s']:,.0f} tok/s" if two else "FAILED",
        f"{two['tokens_per_s'] / one['tokens_per_s']:.2f}x one engine (goal >= 1.9x); start-up "
        f"{two['startup_s']} s {two['startup_phases_s']}" if one and two else "")
    if two and two.get("data_parallel"):
        dp = two["data_parallel"]
        row("  of the two replicas' limit", f"{two['fraction_of_h200_limit'] or 0:.1%}",
            f"limit {two['h200_limit_tokens_per_s'] or 0:,} tok/s; one engine: "
            f"{one['fraction_of_h200_limit'] or 0:.1%} of {one['h200_limit_tokens_per_s'] or 0:,}" if one else "")
        row("  replicas' engine seconds", " / ".join(f"{r['engine_s']:.2f}" for r in dp["replicas"]),
            f"limits {' / '.join(str(r.get('limit_s')) for r in dp['replicas'])} s; driver beyond the "
            f"slowest engine {dp['driver_overhead_s']:.3f} s")
EOF
