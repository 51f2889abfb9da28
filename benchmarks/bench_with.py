"""bench.py with module constants set first: tune a knob without editing the library (one GPU: the
engine runs in this process, so the setting reaches it; TP workers would import their own copy).

    python benchmarks/bench_with.py nanovllm.kernels.decode_attention.PROGRAMS_PER_SM=6 -- --json x.json

Each KNOB is module.NAME=VALUE, VALUE a Python literal, or module.NAME.field=VALUE for a field of a
frozen dataclass constant (nanovllm.kernels.decode_attention.FP8_DECODE.qk_fp8=True); the arguments
after -- go to bench.py.
"""
import ast
import dataclasses
import importlib
import importlib.util
import os
import runpy
import sys


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:   # a parent that is not a package
        return False


def main():
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    knobs, bench_args = argv[:cut], argv[cut + 1:]
    for knob in knobs:
        target, sep, literal = knob.partition("=")
        module_name, _, name = target.rpartition(".")
        if not sep or not module_name:
            raise SystemExit(f"{knob!r}: give module.NAME=VALUE or module.NAME.field=VALUE")
        value, field = ast.literal_eval(literal), None
        if not _is_module(module_name):   # module.NAME.field: a field of a dataclass constant
            (module_name, _, name), field = module_name.rpartition("."), name
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            raise SystemExit(f"{module_name} has no {name}")
        if field is not None:
            value = dataclasses.replace(getattr(module, name), **{field: value})
        setattr(module, name, value)
        print(f"set {module_name}.{name} = {getattr(module, name)!r}", flush=True)
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench.py")
    sys.argv = [bench, *bench_args]
    runpy.run_path(bench, run_name="__main__")


if __name__ == "__main__":
    main()
