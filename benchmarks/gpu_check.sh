#!/usr/bin/env bash
# The GPU check, in one device call (at most 10 minutes): the whole pytest suite, then bench.py at
# temperature 0.6 and greedy on GPU 0. The suite runs as six pytest processes at once: the
# tensor-parallel GPU tests (tests/test_tp_gpu.py and the TP=2 lifecycle test: TP=2 with 2 or more
# GPUs, skipped with one), the other test files that use CUDA (they skip without it) with one GPU
# visible, as on the one-GPU machine, and all the rest with CUDA hidden, as CI runs them (three
# processes, a third of the files each; the TP file is split in two as well). Prints a short table that names every failed test (and, for a stage cut off at its
# limit, the test it was in); the full logs (`pytest -v`: one line per test as it ends) and
# bench.py's JSON records go to $OUT (default /tmp/out).
#
#   PYTHONPATH=. bash benchmarks/gpu_check.sh           # tests and bench, ~8 minutes on 2 H200s
#   BENCH=0 PYTHONPATH=. bash benchmarks/gpu_check.sh   # tests only
#
# BUDGET (seconds, default 530) bounds the whole check: pytest gets what the two bench runs leave.
# THREADS (default 4): torch's CPU threads in each test process (six at once, and their
# subprocesses: all of the host's threads each would oversubscribe its cores many times over).
# Exit status 0 only when every test passed (or skipped) and both bench runs gave a figure.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ $# -gt 0 ]]; then
  echo "gpu_check.sh takes no arguments (got: $*); set BUDGET, BENCH, THREADS or OUT in the environment" >&2
  exit 2
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-530}
BENCH=${BENCH:-1}
export OMP_NUM_THREADS=${THREADS:-4} MKL_NUM_THREADS=${THREADS:-4}
BENCH_S=80                      # each bench.py run: start-up, warm-up and about 6 s of generate
bench_runs=$([[ $BENCH == 0 ]] && echo 0 || echo 2)
num_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [[ $num_gpus -lt 1 ]]; then
  echo "no GPU found: run this on the GPU machine" >&2
  exit 2
fi
rm -f "$OUT"/tests_* "$OUT"/bench_*
git log --oneline -1 2>/dev/null
echo "$num_gpus GPU(s):"
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c

# Test files whose imports are missing here (no network to install them) are left out, by name.
ignore=()
for module in hypothesis; do
  if ! python -c "import $module" 2>/dev/null; then
    for f in $(grep -l -E "^(from|import) $module" tests/*.py); do
      ignore+=("$f"); echo "not run: $f (needs $module, not installed)"
    done
  fi
done
# A test that hangs in Python fails alone (pytest-timeout, signal method), and the rest still run;
# the tests that could hang in C code (NCCL, a TP group) run their work in a subprocess with a deadline.
per_test=()
python -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 240)
[[ $num_gpus -ge 2 ]] && echo "tensor-parallel GPU tests: TP=2 runs" || echo "tensor-parallel GPU tests: skipped (one GPU)"

skip() { for f in "${ignore[@]}"; do [[ $1 == "$f" ]] && return 0; done; return 1; }
gpu_files=() cpu_files=()
for f in tests/test_*.py; do
  skip "$f" && continue
  if grep -q -E "cuda.is_available|device_count" "$f"; then
    [[ $f == tests/test_tp_gpu.py ]] || gpu_files+=("$f")
  else
    cpu_files+=("$f")
  fi
done
# The CUDA-hidden files in three parts, three processes: the interpreter tests are the long pole
# (in two halves, the second ran past a 390 s stage limit).
third=$(( (${#cpu_files[@]} + 2) / 3 ))
cpu_part1=("${cpu_files[@]:0:third}") cpu_part2=("${cpu_files[@]:third:third}")
cpu_part3=("${cpu_files[@]:2*third}")
pytest_s=$(( BUDGET - bench_runs * BENCH_S - 10 ))
start=$SECONDS
suite() {  # label, then what to run; writes tests_LABEL.{log,xml,rc,s}
  local label=$1; shift
  # At the limit: SIGINT first, so pytest stops the test it is in and still writes its report.
  timeout -s INT -k 20 $pytest_s python -m pytest -v -p no:cacheprovider -rfE --durations=10 \
    "${per_test[@]}" --junitxml "$OUT/tests_$label.xml" "$@" > "$OUT/tests_$label.log" 2>&1
  echo $? > "$OUT/tests_$label.rc"; echo $(( SECONDS - start )) > "$OUT/tests_$label.s"
}
# The other CUDA files see one GPU, as on the one-GPU machine; their two-GPU test runs with TP's.
# The TP file in two processes (its NCCL fault scenarios, and the rest): alone it took ~340 s.
suite tp tests/test_tp_gpu.py -k "not test_nccl" tests/test_gpu_lifecycle.py::test_tp2_shutdown_frees_the_gpu_and_engines_start_again &
suite tpfaults tests/test_tp_gpu.py -k test_nccl &
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} suite gpu "${gpu_files[@]}" &
CUDA_VISIBLE_DEVICES= suite cpu1 "${cpu_part1[@]}" &
CUDA_VISIBLE_DEVICES= suite cpu2 "${cpu_part2[@]}" &
CUDA_VISIBLE_DEVICES= suite cpu3 "${cpu_part3[@]}"
wait

for label in t06 greedy; do
  [[ $BENCH == 0 ]] && break
  temperature=$([[ $label == t06 ]] && echo 0.6 || echo 0)
  CUDA_VISIBLE_DEVICES=0 timeout -k 5 $BENCH_S python bench.py --temperature $temperature \
    --json "$OUT/bench_$label.json" > "$OUT/bench_$label.log" 2>&1
  echo $? > "$OUT/bench_$label.rc"
done

python - "$OUT" "$pytest_s" "$BENCH" <<'EOF'
import json, os, re, sys, xml.etree.ElementTree as ET
out, limit, bench = sys.argv[1], int(sys.argv[2]), sys.argv[3] != "0"
RESULT = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


def from_xml(path, running):
    """counts and the ids of the tests that failed or errored, from pytest's JUnit XML; running:
    the test a stage cut off at its limit was in (the XML has it, without a result)."""
    counts, bad = dict(passed=0, failed=0, error=0, skipped=0), []
    for case in ET.parse(path).iter("testcase"):
        test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        kind = {"failure": "failed"}.get(kind, kind)
        if test == running:
            bad.append(f"STOPPED AT THE TIME LIMIT {test}")
            continue
        counts[kind] += 1
        if kind in ("failed", "error"):
            bad.append(f"{kind.upper()} {test}")
    return counts, bad


def from_log(path):
    """From `pytest -v`'s log, when there is no XML: counts, the failures, and the test it was in
    when it was stopped (its id printed, its result not)."""
    counts, bad, last = dict(passed=0, failed=0, error=0, skipped=0), [], None
    for line in open(path, errors="replace"):
        m = RESULT.match(line)
        if m:
            kind = {"xfail": "skipped", "xpass": "passed"}.get(m[2].lower(), m[2].lower())
            counts[kind] += 1
            if kind in ("failed", "error"):
                bad.append(f"{m[2]} {m[1]}")
        elif line.startswith("tests/") and "::" in line:
            last = line.split()[0]
    running = last if last and not any(b.endswith(last) for b in bad) else None
    return counts, bad, running


print(f"\n{'check':36s} result")
ok, failures = True, []
for label, name in (("tp", "pytest, tests/test_tp_gpu.py"), ("tpfaults", "pytest, test_tp_gpu.py NCCL faults"),
                    ("gpu", "pytest, other CUDA test files"),
                    *((f"cpu{i}", f"pytest, the rest (CUDA hidden), {i}/3") for i in (1, 2, 3))):
    rc = int(open(os.path.join(out, f"tests_{label}.rc")).read())
    seconds = open(os.path.join(out, f"tests_{label}.s")).read().strip()
    ok = ok and rc == 0
    log, xml = (os.path.join(out, f"tests_{label}.{ext}") for ext in ("log", "xml"))
    counts, bad, running = from_log(log)
    timed_out = rc in (124, 137)
    if not timed_out:
        running = None
    if os.path.exists(xml):
        counts, bad = from_xml(xml, running)
    elif running:
        bad.append(f"STOPPED AT THE TIME LIMIT {running}")
    how = f"in {seconds} s (exit {rc})"
    if timed_out:
        how = f"TIMED OUT after {seconds} s (limit {limit} s)" + (f", in {running}" if running else "")
    elif not os.path.exists(xml):
        how += ", no XML report: counts from the log"
    print(f"{name:36s} {counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
          f"{counts['skipped']} skipped {how}")
    failures += [f"  {b}" for b in bad]

for label, name in (("t06", "bench.py, temperature 0.6"), ("greedy", "bench.py, greedy")):
    if not bench:
        print(f"{name:36s} not run (BENCH=0)")
        continue
    path = os.path.join(out, f"bench_{label}.json")
    bench_rc = open(os.path.join(out, f"bench_{label}.rc")).read().strip()
    if bench_rc != "0" or not os.path.exists(path):
        print(f"{name:36s} FAILED (exit {bench_rc}): see bench_{label}.log")
        ok = False
        continue
    r = json.load(open(path))
    fraction = f", {r['fraction_of_h200_limit']:.1%} of the limit" if r.get("fraction_of_h200_limit") else ""
    print(f"{name:36s} {r['tokens_per_s']:,.0f} tok/s{fraction}, start-up {r['startup_s']} s")
if failures:
    print("failed tests:", *failures, sep="\n")
sys.exit(0 if ok else 1)
EOF
status=$?
echo "logs: $OUT (total $SECONDS s)"
exit $status
