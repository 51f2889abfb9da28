"""benchmarks/profile_bench.py's host profile on CPU: every hook point it times exists and runs, the
figures add up, the hooks are undone afterwards, and a hook point that moved is named."""
import inspect
import os
import sys

import pytest

from nanovllm import LLM, SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import profile_bench  # noqa: E402
from profile_bench import HookPointMissing, host_profile  # noqa: E402

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    llm = LLM(qwen3_dir, device="cpu", kvcache_block_size=16, num_kvcache_blocks=16)
    yield llm
    llm.shutdown()


def params(max_tokens=6):
    return [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens) for _ in PROMPTS]


def test_host_profile_times_every_phase_and_undoes_its_hooks(llm):
    pack = inspect.getattr_static(profile_bench.DecodeInputs, "pack")
    lines = []
    figures = host_profile(llm, lines, PROMPTS, params())
    # One prefill step samples the first token of both; the other 5 come from decode steps.
    assert figures["decode_steps"] == 5
    assert len(figures["step_wall_s"]) == 5 and all(s > 0 for s in figures["step_wall_s"])
    text = "\n".join(lines)
    assert "5 decode steps" in text
    for _, _, label in profile_bench.HOST_PHASES:
        assert label in text
    # Undone: the engine's own methods again, and it still generates.
    assert "_step" not in vars(llm) and "run_decode" not in vars(llm.model_runner)
    assert inspect.getattr_static(profile_bench.DecodeInputs, "pack") is pack
    assert len(llm.generate(PROMPTS, params(2), use_tqdm=False)[1].outputs[0].token_ids) == 2


def test_a_hook_point_that_moved_is_named(llm, monkeypatch):
    monkeypatch.setattr(profile_bench, "HOST_PHASES",
                        profile_bench.HOST_PHASES + [("model_runner", "prepare_decode", "decode inputs")])
    with pytest.raises(HookPointMissing, match=r"model_runner\.prepare_decode is gone"):
        host_profile(llm, [], PROMPTS, params())
    assert "_step" not in vars(llm) and "schedule" not in vars(llm.scheduler)   # undone


def test_a_hook_point_that_never_runs_is_named(llm, monkeypatch):
    monkeypatch.setattr(profile_bench, "HOST_PHASES",
                        profile_bench.HOST_PHASES + [("scheduler", "reset", "scheduler.reset")])
    with pytest.raises(HookPointMissing, match=r"never called during the run: scheduler\.reset"):
        host_profile(llm, [], PROMPTS, params())


def test_host_profile_of_a_tensor_parallel_engine(qwen3_dir):
    """--tensor-parallel-size: rank 0's hooks run under TP=2 (gloo on CPU) as they do alone."""
    llm = LLM(qwen3_dir, device="cpu", kvcache_block_size=16, num_kvcache_blocks=16, tensor_parallel_size=2)
    try:
        lines = []
        figures = host_profile(llm, lines, PROMPTS, params())
        assert figures["decode_steps"] == 5
        text = "\n".join(lines)
        for _, _, label in profile_bench.HOST_PHASES:
            assert label in text
    finally:
        llm.shutdown()
