#!/usr/bin/env bash
# A/B in one device call: an earlier commit's tree (base) against the working tree (new), bench.py
# runs alternating base, new, base, new... so that both meet the same machine in the same state.
#
#   here:             bash benchmarks/ab_gpu.sh prepare REV   # REV's files into .ab_base/ (git-ignored)
#   the GPU machine:  bash benchmarks/ab_gpu.sh run [ROUNDS] [bench.py arguments...]
#                     (the device call carries [".ab_base"]; ROUNDS defaults to 3)
#
# Each side runs inside its own tree: bench.py and the benchmark scripts put their own folder first
# on sys.path, so PYTHONPATH=.ab_base would still import the new tree's nanovllm. STEP_PARTS=1 also
# runs benchmarks/step_parts.py on each side (copied into the base tree when it lacks it; it needs
# that tree's DecodeGraphs). Prints each run's tokens/s, the medians and new / base; JSON and logs
# go to $OUT (default /tmp/out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
case "${1:-}" in
  prepare)
    rev=${2:?usage: ab_gpu.sh prepare REV}
    rm -rf .ab_base && mkdir .ab_base && git archive "$rev" | tar -x -C .ab_base || exit 1
    echo "$rev $(git rev-parse --short "$rev")" > .ab_base/AB_REV
    echo "base $(cat .ab_base/AB_REV) in .ab_base/; carry [\".ab_base\"] with: bash benchmarks/ab_gpu.sh run"
    ;;
  run)
    [[ -f .ab_base/AB_REV ]] || { echo "no .ab_base/: run 'bash benchmarks/ab_gpu.sh prepare REV' first and carry it" >&2; exit 2; }
    rounds=${2:-3}; shift $(( $# < 2 ? $# : 2 ))
    mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
    side() { if [[ $1 == base ]]; then (cd .ab_base && PYTHONPATH=. "${@:2}"); else PYTHONPATH=. "${@:2}"; fi; }
    echo "base: $(cat .ab_base/AB_REV); new: the working tree; bench.py $*"
    if [[ ${STEP_PARTS:-0} == 1 ]]; then
      [[ -f .ab_base/benchmarks/step_parts.py ]] || cp benchmarks/step_parts.py .ab_base/benchmarks/
      for v in base new; do
        echo "== step_parts, $v"
        side $v python benchmarks/step_parts.py --json "$OUT/ab_step_parts_$v.json" 2>&1 | grep -E "^ *(batch|[0-9]+ )"
      done
    fi
    for ((r = 1; r <= rounds; r++)); do
      for v in base new; do
        side $v python bench.py "$@" --json "$OUT/ab_bench_${v}_$r.json" > "$OUT/ab_bench_${v}_$r.log" 2>&1
        echo "round $r $v: $(grep -m1 -o 'Throughput: [0-9.]* tok/s' "$OUT/ab_bench_${v}_$r.log" || echo "no figure: see $OUT/ab_bench_${v}_$r.log")"
      done
    done
    python - "$OUT" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
med = {}
for v in ("base", "new"):
    figs = []
    for r in range(1, rounds + 1):
        try:
            figs.append(json.load(open(f"{out}/ab_bench_{v}_{r}.json"))["tokens_per_s"])
        except (OSError, ValueError, KeyError):
            pass
    med[v] = statistics.median(figs) if figs else None
    print(f"{v}: " + ", ".join(f"{f:,.0f}" for f in figs) + (f"  median {med[v]:,.0f} tok/s" if figs else "  no figures"))
if med["base"] and med["new"]:
    print(f"new / base: {med['new'] / med['base']:.4f}")
PY
    ;;
  *) echo "usage: ab_gpu.sh prepare REV | run [ROUNDS] [bench.py arguments...]" >&2; exit 2 ;;
esac
