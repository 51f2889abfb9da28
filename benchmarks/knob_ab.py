"""bench.py under several settings of module constants, alternating in rounds in one tree (each run a
fresh process through benchmarks/bench_with.py), then each setting's median and its ratio to the
first's. ab_gpu.sh compares two trees; this compares knobs within one.

    python benchmarks/knob_ab.py --rounds 3 --variant off nanovllm.models.llama.FOLD_NORMS=False \\
        --variant on nanovllm.models.llama.FOLD_NORMS=True -- --kv-cache-dtype fp8

A --variant is a label followed by its knobs (bench_with.py's module.NAME=VALUE, none for the
defaults); the arguments after -- go to bench.py. Logs go to --logs (one per run).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys


def main():
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variant", nargs="+", action="append", required=True, metavar="LABEL [KNOB ...]")
    p.add_argument("--logs", default=os.environ.get("OUT", "/tmp/out"))
    p.add_argument("--timeout", type=float, default=100, help="seconds a run may take")
    args, bench_args = p.parse_args(argv[:cut]), argv[cut + 1:]
    os.makedirs(args.logs, exist_ok=True)
    with_script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_with.py")
    figures = {label: [] for label, *_ in args.variant}
    for r in range(1, args.rounds + 1):
        for label, *knobs in args.variant:
            log = os.path.join(args.logs, f"knob_ab_{label}_{r}.log")
            with open(log, "w") as f:
                try:
                    subprocess.run([sys.executable, with_script, *knobs, "--", *bench_args], stdout=f,
                                   stderr=subprocess.STDOUT, timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    pass
            m = re.search(r"Throughput: ([0-9.]+) tok/s", open(log).read())
            if m:
                figures[label].append(float(m[1]))
            print(f"{label} round {r}: {m[1] + ' tok/s' if m else 'no figure, see ' + log}", flush=True)
    base = None   # (label, median) of the first setting with a figure: the ratios' reference
    for label, runs in figures.items():
        if not runs:
            print(f"{label}: no figure")
            continue
        median = statistics.median(runs)
        base = base or (label, median)
        print(f"{label}: median {median:,.0f} tok/s of {len(runs)} ({min(runs):,.0f}-{max(runs):,.0f}), "
              f"{median / base[1]:.4f}x {base[0]}")


if __name__ == "__main__":
    main()
