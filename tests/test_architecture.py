"""The package's floors, as docs/how-it-works.md lists them: a module imports only from its
own floor or the floors below it, and no modules import each other in a circle. Imports inside
functions count too: a deferred import is still a dependency."""
import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "nanovllm"

# Lowest first. The first name of a module's path inside nanovllm/ picks its floor.
FLOORS = [
    {"version", "envs", "logger", "outputs", "inputs", "beam_search", "structured", "sampling_params",
     "chat_utils", "utils", "config", "pooling_params", "pooler_config",
     "speculative_config"},   # plain data, options and file helpers: no torch modules of ours
    {"kernels"},                     # Triton kernels and their torch references
    {"parallel"},                    # the TP group and its collectives, the command pipe, heartbeats
    {"layers", "lora", "quantization"},   # nn.Modules built from kernels, sharded by the TP group; LoRA
                                          # on them; quantized weights on them (formats and methods)
    {"models"},                      # decoders built from layers
    {"engine", "spec"},              # Sequences, scheduler, ModelRunner, TP workers, LLMEngine; the
                                     # speculative decoding steps they run
    {"distributed"},                 # data parallelism and Ray, built on LLMEngine
    {"llm"},                         # the LLM facade
    {"serve", "__init__"},           # the OpenAI server; the package's public names
]
# Imports that climb to a higher floor, each with its reason. None today.
ALLOWED_CLIMBS: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _imports(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """module -> the nanovllm modules it imports (the longest name that is a module)."""
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.add(target)
        edges[name] = found
    return edges


def _floor(module: str) -> int:
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    for i, floor in enumerate(FLOORS):
        if key in floor:
            return i
    raise AssertionError(f"{module}: give nanovllm/{key} a floor in tests/test_architecture.py")


def test_every_module_has_a_floor():
    for module in _modules():
        _floor(module)


def test_no_import_climbs_to_a_higher_floor():
    climbs = sorted((a, b) for a, targets in _imports(_modules()).items() for b in targets
                    if _floor(b) > _floor(a) and (a, b) not in ALLOWED_CLIMBS)
    listed = "\n".join(f"{a} -> {b}" for a, b in climbs)
    assert not climbs, f"imports from a lower floor to a higher one:\n{listed}"


def test_no_import_circle():
    edges = _imports(_modules())
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str):
        state[module] = 1
        path.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)


def test_the_checker_sees_a_climb_and_a_circle(tmp_path, monkeypatch):
    """The rules above can fail: a layer importing the engine is a climb, two modules importing each
    other a circle."""
    pkg = tmp_path / "nanovllm"
    for rel, text in {"__init__.py": "", "layers/__init__.py": "", "engine/__init__.py": "",
                      "layers/a.py": "from nanovllm.engine import b\n",
                      "engine/b.py": "def f():\n    from ..layers import a\n"}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    edges = _imports(_modules())
    assert edges["nanovllm.layers.a"] == {"nanovllm.engine", "nanovllm.engine.b"}
    assert "nanovllm.layers.a" in edges["nanovllm.engine.b"]
    with pytest.raises(AssertionError, match=r"nanovllm\.layers\.a -> nanovllm\.engine\.b"):
        test_no_import_climbs_to_a_higher_floor()
    with pytest.raises(AssertionError, match="import circle"):
        test_no_import_circle()


def test_engine_files_stay_short():
    """One job per file: no module of nanovllm/engine over 400 lines."""
    long = {p.name: n for p in (ROOT / "engine").glob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"engine files over 400 lines: {long}"
