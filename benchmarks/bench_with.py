"""bench.py with module constants set first: tune a knob without editing the library (one GPU: the
engine runs in this process, so the setting reaches it; TP workers would import their own copy).

    python benchmarks/bench_with.py nanovllm.kernels.decode_attention.PROGRAMS_PER_SM=6 -- --json x.json

Each KNOB is module.NAME=VALUE, VALUE a Python literal; the arguments after -- go to bench.py.
"""
import ast
import importlib
import os
import runpy
import sys


def set_knobs(knobs: list[str]):
    """Set each module.NAME=VALUE (VALUE a Python literal) in its imported module."""
    for knob in knobs:
        target, sep, literal = knob.partition("=")
        module_name, _, name = target.rpartition(".")
        if not sep or not module_name:
            raise SystemExit(f"{knob!r}: give module.NAME=VALUE")
        value = ast.literal_eval(literal)
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            raise SystemExit(f"{module_name} has no {name}")
        setattr(module, name, value)
        print(f"set {module_name}.{name} = {getattr(module, name)!r}", flush=True)


def main():
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    knobs, bench_args = argv[:cut], argv[cut + 1:]
    set_knobs(knobs)
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench.py")
    sys.argv = [bench, *bench_args]
    runpy.run_path(bench, run_name="__main__")


if __name__ == "__main__":
    main()
