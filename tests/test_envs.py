"""nanovllm/envs.py (every environment variable in one place, read typed) and the logging it sets up:
INFO lines on stderr by default, NANOVLLM_LOGGING_LEVEL, NANOVLLM_CONFIGURE_LOGGING."""
import ast
import logging
import pathlib
import subprocess
import sys

import pytest

from nanovllm import envs
from nanovllm.logger import configure_logger

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_no_module_but_envs_reads_the_environment():
    readers = []
    for path in sorted((REPO / "nanovllm").rglob("*.py")):
        if path.name == "envs.py" and path.parent.name == "nanovllm":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb")
                    and isinstance(node.value, ast.Name) and node.value.id == "os"):
                readers.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert readers == [], f"read the environment through nanovllm/envs.py: {readers}"


def test_every_nanovllm_variable_the_package_names_is_declared():
    # a NANOVLLM_* name written anywhere in the package is one of envs.py's
    declared = {v.name for v in envs.VARIABLES}
    import re
    named = set()
    for path in (REPO / "nanovllm").rglob("*.py"):
        named |= set(re.findall(r"\bNANOVLLM_[A-Z0-9_]+\b", path.read_text()))
    assert named - declared == set()


def test_values_are_typed_and_bad_text_names_the_variable():
    assert envs.GRAMMAR_THREADS.get({}) == 1
    assert envs.GRAMMAR_THREADS.get({"NANOVLLM_GRAMMAR_THREADS": "3"}) == 3
    assert envs.FOLD_NORMS.get({"NANOVLLM_FOLD_NORMS": "0"}) is False
    assert envs.FOLD_NORMS.get({"NANOVLLM_FOLD_NORMS": "On"}) is True
    assert envs.FOLD_NORMS.get({"NANOVLLM_FOLD_NORMS": ""}) is True   # empty: the default
    assert envs.LOGGING_LEVEL.get({"NANOVLLM_LOGGING_LEVEL": "DEBUG"}) == "debug"
    with pytest.raises(ValueError, match=r"NANOVLLM_FOLD_NORMS='maybe': use one of 1, true"):
        envs.FOLD_NORMS.get({"NANOVLLM_FOLD_NORMS": "maybe"})
    with pytest.raises(ValueError, match=r"NANOVLLM_LOGGING_LEVEL='loud': use one of debug, info"):
        envs.LOGGING_LEVEL.get({"NANOVLLM_LOGGING_LEVEL": "loud"})
    with pytest.raises(ValueError, match=r"NANOVLLM_DECODE_PROGRAMS_PER_SM='0': use a positive integer"):
        envs.DECODE_PROGRAMS_PER_SM.get({"NANOVLLM_DECODE_PROGRAMS_PER_SM": "0"})


def test_by_name_names_the_closest_variable():
    assert envs.by_name("NANOVLLM_FOLD_NORMS") is envs.FOLD_NORMS
    with pytest.raises(ValueError, match="did you mean NANOVLLM_FOLD_NORMS"):
        envs.by_name("NANOVLLM_FOLD_NORM")


def test_info_lines_on_stderr_by_default_and_knobs_reach_a_fresh_interpreter(qwen3_dir):
    # A fresh interpreter started as tp_worker starts its workers (envs.environ_with), with nanovllm's
    # defaults but one knob: the engine's start-up line is on stderr, in nanovllm's format, as vLLM
    # prints its own; and the knob set before nanovllm is imported is what the module reads (a patched
    # module attribute reached rank 0 alone).
    code = ("import nanovllm.models.llama as m; print(m.FOLD_NORMS); from nanovllm import LLM; "
            f"LLM({qwen3_dir!r}, device='cpu', num_kvcache_blocks=8, kvcache_block_size=16).shutdown()")
    env = {k: v for k, v in envs.environ_with().items() if not k.startswith("NANOVLLM_")}
    env.update(PYTHONPATH=str(REPO), NANOVLLM_FOLD_NORMS="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "False\n"
    lines = [line for line in out.stderr.splitlines() if line.startswith("INFO ")]
    assert any("[nanovllm.engine.model_runner] start-up:" in line for line in lines), out.stderr[-2000:]


@pytest.mark.parametrize("environ, shown", [
    ({}, ["INFO", "WARNING"]),
    ({"NANOVLLM_LOGGING_LEVEL": "warning"}, ["WARNING"]),
    ({"NANOVLLM_LOGGING_LEVEL": "DEBUG"}, ["DEBUG", "INFO", "WARNING"]),
    ({"NANOVLLM_CONFIGURE_LOGGING": "0"}, []),   # left to the application: no handler of ours
])
def test_logging_level_and_leaving_logging_to_the_application(capsys, environ, shown):
    name = f"nanovllm_probe_{len(environ)}_{'_'.join(environ.values())}"
    logger = configure_logger(name, environ)
    assert len(logger.handlers) == (0 if shown == [] else 1)
    configure_logger(name, environ)   # a second call adds no second handler
    assert len(logger.handlers) == (0 if shown == [] else 1)
    for level in ("DEBUG", "INFO", "WARNING"):
        logger.log(getattr(logging, level), "probe %s", level)
    err = capsys.readouterr().err
    assert [line.split()[0] for line in err.splitlines()] == shown
    assert all(line.endswith(f"[{name}] probe {line.split()[0]}") for line in err.splitlines())
    if shown:
        assert logger.propagate is False   # one copy of each line, not a second through the root logger


def test_tp_workers_leave_info_lines_to_rank_0():
    from nanovllm.logger import quiet_worker_logger
    logger = configure_logger("nanovllm_probe_worker", {})
    quiet_worker_logger("nanovllm_probe_worker", {})
    assert logger.level == logging.WARNING
    logger = configure_logger("nanovllm_probe_worker_debug", {"NANOVLLM_LOGGING_LEVEL": "debug"})
    quiet_worker_logger("nanovllm_probe_worker_debug", {"NANOVLLM_LOGGING_LEVEL": "debug"})
    assert logger.level == logging.DEBUG   # asked for: every rank's lines


def test_bench_with_checks_knobs_against_envs_and_sets_them_before_nanovllm_is_imported():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_with
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert bench_with.checked_knobs(["NANOVLLM_FOLD_NORMS=0", "NANOVLLM_FP8_BLOCK_GEMM=triton"]) == {
        "NANOVLLM_FOLD_NORMS": "0", "NANOVLLM_FP8_BLOCK_GEMM": "triton"}
    with pytest.raises(SystemExit, match="did you mean NANOVLLM_FOLD_NORMS"):
        bench_with.checked_knobs(["NANOVLLM_FOLD_NORM=0"])
    with pytest.raises(SystemExit, match="NANOVLLM_FP8_BLOCK_GEMM='cutlass': use one of cublas, triton"):
        bench_with.checked_knobs(["NANOVLLM_FP8_BLOCK_GEMM=cutlass"])
    with pytest.raises(SystemExit, match="give NAME=VALUE"):
        bench_with.checked_knobs(["nanovllm.models.llama.FOLD_NORMS"])
    with pytest.raises(SystemExit, match="before nanovllm is imported"):   # this process has imported it
        bench_with.set_knobs(["NANOVLLM_FOLD_NORMS=0"])
