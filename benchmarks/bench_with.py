"""bench.py with nanovllm's tuning knobs set: once, or several settings alternating in rounds in one
tree (each run a fresh process), then each setting's median and its ratio to the first's. ab_gpu.sh
compares two trees; this compares knobs within one.

    python benchmarks/bench_with.py NANOVLLM_DECODE_PROGRAMS_PER_SM=6 -- --json x.json
    python benchmarks/bench_with.py --rounds 3 --variant off NANOVLLM_FOLD_NORMS=0 \\
        --variant on NANOVLLM_FOLD_NORMS=1 -- --kv-cache-dtype fp8

A knob is NAME=VALUE, NAME one of the environment variables nanovllm/envs.py declares (a typo is an
error naming the closest, a bad value one saying what it takes). They are set in the environment
before nanovllm is imported, so every tensor-parallel worker reads them too. A --variant is a label
followed by its knobs (none: the defaults); the arguments after -- go to bench.py. An A/B's logs go to
--logs (one per run).
"""
import argparse
import importlib.util
import os
import re
import runpy
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench.py")


def declared_variables():
    """nanovllm/envs.py, loaded from its file: importing nanovllm.envs would import nanovllm, whose
    modules read the knobs as they are imported, before they are set."""
    spec = importlib.util.spec_from_file_location("_nanovllm_envs", os.path.join(ROOT, "nanovllm", "envs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def checked_knobs(knobs: list[str]) -> dict[str, str]:
    """{NAME: VALUE} of NAME=VALUE knobs, each name declared and each value one its variable takes."""
    envs, checked = declared_variables(), {}
    for knob in knobs:
        name, sep, value = knob.partition("=")
        if not sep:
            raise SystemExit(f"{knob!r}: give NAME=VALUE, NAME a variable of nanovllm/envs.py")
        try:
            envs.by_name(name).get({name: value})
        except ValueError as e:
            raise SystemExit(str(e)) from None
        checked[name] = value
    return checked


def set_knobs(knobs: list[str]):
    """Set each NAME=VALUE in this process's environment, before nanovllm is imported (its modules read
    the knobs at import; the TP workers it starts inherit them)."""
    checked = checked_knobs(knobs)
    if checked and "nanovllm" in sys.modules:
        raise SystemExit("set the knobs before nanovllm is imported: its modules have read them already")
    for name, value in checked.items():
        os.environ[name] = value
        print(f"set {name}={value}", flush=True)


def run_once(knobs: list[str], bench_args: list[str]):
    set_knobs(knobs)
    sys.argv = [BENCH, *bench_args]
    runpy.run_path(BENCH, run_name="__main__")


def alternate(args, bench_args: list[str]):
    """Every variant once per round, each run a fresh bench.py, then the medians."""
    os.makedirs(args.logs, exist_ok=True)
    variants = [(label, checked_knobs(knobs)) for label, *knobs in args.variant]
    figures = {label: [] for label, _ in variants}
    for r in range(1, args.rounds + 1):
        for label, knobs in variants:
            log = os.path.join(args.logs, f"bench_with_{label}_{r}.log")
            with open(log, "w") as f:
                try:
                    subprocess.run([sys.executable, BENCH, *bench_args], stdout=f, stderr=subprocess.STDOUT,
                                   timeout=args.timeout, env={**os.environ, **knobs})
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


def main():
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("knobs", nargs="*", metavar="NAME=VALUE", help="one run with these knobs")
    p.add_argument("--variant", nargs="+", action="append", metavar="LABEL [KNOB ...]",
                   help="alternate this setting with the other variants' (an A/B)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--logs", default=os.environ.get("OUT", "/tmp/out"))
    p.add_argument("--timeout", type=float, default=100, help="seconds a run may take")
    args, bench_args = p.parse_args(argv[:cut]), argv[cut + 1:]
    if args.variant and args.knobs:
        p.error("give knobs for one run, or --variant LABEL KNOB... for an A/B, not both")
    if args.variant:
        alternate(args, bench_args)
    else:
        run_once(args.knobs, bench_args)


if __name__ == "__main__":
    main()
