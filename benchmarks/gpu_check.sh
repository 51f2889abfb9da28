#!/usr/bin/env bash
# The GPU check, in one device call (at most 10 minutes): the whole pytest suite, then bench.py at
# temperature 0.6 and greedy on GPU 0. The suite runs as three pytest processes at once: the
# tensor-parallel GPU tests (tests/test_tp_gpu.py: TP=2 with 2 or more GPUs, skipped with one), the
# other test files that use CUDA (they skip without it), and all the rest with CUDA hidden, as CI
# runs them. Prints a short table; the full logs and bench.py's JSON records go to $OUT (default
# /tmp/out).
#
#   PYTHONPATH=. bash benchmarks/gpu_check.sh
#
# BUDGET (seconds, default 530) bounds the whole check: pytest gets what the two bench runs leave.
# Exit status 0 only when every test passed (or skipped) and both bench runs gave a figure.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ $# -gt 0 ]]; then
  echo "gpu_check.sh takes no arguments (got: $*); set BUDGET or OUT in the environment instead" >&2
  exit 2
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-530}
BENCH_S=80                      # each bench.py run: start-up, warm-up and about 6 s of generate
num_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [[ $num_gpus -lt 1 ]]; then
  echo "no GPU found: run this on the GPU machine" >&2
  exit 2
fi
rm -f "$OUT"/tests_*.xml "$OUT"/bench_*.json
git log --oneline -1 2>/dev/null
echo "$num_gpus GPU(s):"
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c

# Test files whose imports are missing here (no network to install them) are left out, by name.
ignore=()
for module in hypothesis; do
  if ! python -c "import $module" 2>/dev/null; then
    for f in $(grep -l -E "^(from|import) $module" tests/*.py); do
      ignore+=(--ignore "$f"); echo "not run: $f (needs $module, not installed)"
    done
  fi
done
# A test that hangs fails alone (pytest-timeout, signal method), and the rest still run.
per_test=()
python -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 240)
[[ $num_gpus -ge 2 ]] && echo "tensor-parallel GPU tests: TP=2 runs" || echo "tensor-parallel GPU tests: skipped (one GPU)"

gpu_files=$(grep -l -E "cuda.is_available|device_count" tests/test_*.py | grep -v test_tp_gpu.py)
cpu_ignore=(--ignore tests/test_tp_gpu.py); for f in $gpu_files; do cpu_ignore+=(--ignore "$f"); done
pytest_s=$(( BUDGET - 2 * BENCH_S - 10 ))
start=$SECONDS
suite() {  # label, then what to run; sets nothing, writes tests_LABEL.{log,xml,rc,s}
  local label=$1; shift
  timeout -k 10 $pytest_s python -m pytest -q -p no:cacheprovider -rfE "${per_test[@]}" "${ignore[@]}" \
    --junitxml "$OUT/tests_$label.xml" "$@" > "$OUT/tests_$label.log" 2>&1
  echo $? > "$OUT/tests_$label.rc"; echo $(( SECONDS - start )) > "$OUT/tests_$label.s"
}
suite tp tests/test_tp_gpu.py &
suite gpu $gpu_files &
CUDA_VISIBLE_DEVICES= suite cpu "${cpu_ignore[@]}" tests
wait

for label in t06 greedy; do
  temperature=$([[ $label == t06 ]] && echo 0.6 || echo 0)
  CUDA_VISIBLE_DEVICES=0 timeout -k 5 $BENCH_S python bench.py --temperature $temperature \
    --json "$OUT/bench_$label.json" > "$OUT/bench_$label.log" 2>&1
  echo $? > "$OUT/bench_$label.rc"
done

python - "$OUT" "$pytest_s" <<'EOF'
import json, os, sys, xml.etree.ElementTree as ET
out, limit = sys.argv[1], int(sys.argv[2])
print(f"\n{'check':36s} result")
ok = True
for label, name in (("tp", "pytest, tests/test_tp_gpu.py"), ("gpu", "pytest, other CUDA test files"),
                    ("cpu", "pytest, the rest (CUDA hidden)")):
    rc = int(open(os.path.join(out, f"tests_{label}.rc")).read())
    seconds = open(os.path.join(out, f"tests_{label}.s")).read().strip()
    ok = ok and rc == 0
    if rc in (124, 137):
        print(f"{name:36s} TIMED OUT after {seconds} s (limit {limit} s): see tests_{label}.log")
        continue
    if not os.path.exists(os.path.join(out, f"tests_{label}.xml")):
        print(f"{name:36s} NO RESULTS (exit {rc}): see tests_{label}.log")
        continue
    counts = dict(passed=0, failed=0, error=0, skipped=0)
    for case in ET.parse(os.path.join(out, f"tests_{label}.xml")).iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        kind = {"failure": "failed"}.get(kind, kind)
        counts[kind] += 1
    print(f"{name:36s} {counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
          f"{counts['skipped']} skipped in {seconds} s (exit {rc})")

for label, name in (("t06", "bench.py, temperature 0.6"), ("greedy", "bench.py, greedy")):
    path = os.path.join(out, f"bench_{label}.json")
    bench_rc = open(os.path.join(out, f"bench_{label}.rc")).read().strip()
    if bench_rc != "0" or not os.path.exists(path):
        print(f"{name:36s} FAILED (exit {bench_rc}): see bench_{label}.log")
        ok = False
        continue
    r = json.load(open(path))
    fraction = f", {r['fraction_of_h200_limit']:.1%} of the limit" if r.get("fraction_of_h200_limit") else ""
    print(f"{name:36s} {r['tokens_per_s']:,.0f} tok/s{fraction}, start-up {r['startup_s']} s")
sys.exit(0 if ok else 1)
EOF
status=$?
grep -h -E "^(FAILED|ERROR)" "$OUT"/tests_{tp,gpu,cpu}.log | head -20
echo "logs: $OUT"
exit $status
