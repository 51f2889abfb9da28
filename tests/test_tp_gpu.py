"""Tensor parallelism on CUDA (NCCL): TP=2 (and 4, 8 where the GPUs exist) gives TP=1's greedy
tokens in fp32, with CUDA graphs and eager; bf16 within a tolerance of transformers' logits; two
engines at once; nothing left after shutdown; faults (a worker that raises, is killed or stopped,
Ctrl-C during a step and during shutdown, a start-up failure) are errors within seconds, never
hangs (tests/tp_faults.py, in a subprocess with a deadline). Skipped without enough GPUs; run on
the H200s."""
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, HFOracle, make_model, random_prompts
from nanovllm import LLM, SamplingParams
from tp_faults_runner import assert_no_leftovers, run_scenarios

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 CUDA GPUs")

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = random_prompts(8, [1, 5, 17, 33, 64, 150, 300, 40], seed=11)
OPTIONS = dict(device="cuda", kvcache_block_size=16, num_kvcache_blocks=96, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def model_8_heads(tmp_path_factory):
    """8 heads and 8 KV heads divide by 2, 4 and 8."""
    return make_model(str(tmp_path_factory.mktemp("qwen3_8h")), "qwen3", num_attention_heads=8,
                      num_key_value_heads=8, head_dim=8)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def run(path: str, tp: int, **options) -> list[list[int]]:
    llm = LLM(path, tensor_parallel_size=tp, **{**OPTIONS, **options})
    try:
        return tokens(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("eager", [True, False])
def test_fp32_tp_matches_tp1(model_8_heads, tp, eager):
    if tp > NUM_GPUS:
        pytest.skip(f"needs {tp} GPUs")
    expected = run(model_8_heads, 1, dtype="float32", enforce_eager=eager)
    assert run(model_8_heads, tp, dtype="float32", enforce_eager=eager) == expected


def test_bf16_tp2_within_tolerance(qwen3_dir):
    oracle = HFOracle(qwen3_dir)
    for prompt, ids in zip(PROMPTS, run(qwen3_dir, 2, dtype="bfloat16")):
        oracle.assert_greedy(prompt, ids, atol=0.3)


def test_two_tp2_engines_and_clean_shutdown(qwen3_dir, model_8_heads):
    expected = [run(p, 1, dtype="float32") for p in (qwen3_dir, model_8_heads)]
    engines = [LLM(p, tensor_parallel_size=2, dtype="float32", **OPTIONS) for p in (qwen3_dir, model_8_heads)]
    for _ in range(2):
        assert [tokens(e) for e in engines] == expected
    pids = [pid for e in engines for pid in e.executor.workers.pids]
    for e in engines:   # with CUDA graphs; took ~11 s when the workers shut their NCCL side down
        start = time.monotonic()
        e.shutdown()
        seconds, codes = time.monotonic() - start, [w.proc.returncode for w in e.executor.workers.workers]
        assert seconds < 5 and codes == [0], (seconds, codes)   # exited (not killed), within seconds
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


# ---- faults under NCCL ----------------------------------------------------------------------

# Two groups, each one subprocess with a deadline under pytest-timeout's 240 s per test.
WORKER_FAULTS = ["worker_raises", "worker_killed", "worker_killed_mid_generate",
                 "worker_killed_mid_generate_graphs", "worker_stopped"]
INTERRUPTS = ["interrupt_in_step", "interrupt_in_shutdown", "startup_failure",
              "interrupt_in_shutdown_then_exit"]


@pytest.fixture(scope="module")
def worker_faults(qwen3_dir):
    return run_scenarios(qwen3_dir, "cuda", WORKER_FAULTS, timeout_s=200, scenario_s=60)


@pytest.fixture(scope="module")
def faults(qwen3_dir):
    return run_scenarios(qwen3_dir, "cuda", INTERRUPTS, timeout_s=200, scenario_s=60)


@pytest.mark.parametrize("name", ["worker_raises", "worker_killed", "worker_killed_mid_generate",
                                  "worker_killed_mid_generate_graphs", "worker_stopped"])
def test_nccl_worker_fault_is_an_error_within_seconds(worker_faults, name):
    r = worker_faults(name)
    assert r["first"]["error"] == "WorkerError" and r["first"]["seconds"] < 15, r["first"]
    assert "rank 1" in r["first"]["message"]
    why = {"worker_raises": "AttributeError", "worker_stopped": "not answered"}.get(name, "SIGKILL")
    assert why in r["first"]["message"], r["first"]["message"]
    if "later" in r:
        assert r["later"]["error"] == "WorkerError" and r["later"]["seconds"] < 1
    assert_no_leftovers(r)


def test_nccl_ctrl_c_in_a_step_interrupts(faults):
    r = faults("interrupt_in_step")   # rank 0 waits on a step a stopped worker never joins
    assert r["first"]["error"] == "KeyboardInterrupt" and r["first"]["seconds"] < 5, r["first"]
    if r["in_step"]:
        # RuntimeError, or WorkerError (one) when the watch thread aborted the group stuck in the step
        later = r["later"]
        assert later["error"] in ("RuntimeError", "WorkerError") and "out of step" in later["message"], later
    assert_no_leftovers(r)


def test_nccl_ctrl_c_in_shutdown(faults):
    r = faults("interrupt_in_shutdown")
    assert r["interrupted"]["error"] == "KeyboardInterrupt" and r["interrupted"]["seconds"] < 5
    assert_no_leftovers(r)
    r = faults("interrupt_in_shutdown_then_exit")
    assert r["interrupted"]["error"] == "KeyboardInterrupt"
    assert_no_leftovers(r, exited=True)


def test_nccl_startup_failure_names_the_worker(faults):
    r = faults("startup_failure")
    assert r["start"]["error"] == "WorkerError" and "rank 1" in r["start"]["message"]
    assert "injected start-up failure" in r["start"]["message"]


def test_peer_all_reduce_equals_nccl_and_aborts():
    """The peer-memory all-reduce gives NCCL's sums bit for bit (decode sizes, 8 to 512 rows of 4096
    bf16, and 2048 rows in two launches), eager and in CUDA graphs, and a rank left alone in a call
    is freed by the abort word within seconds."""
    script = os.path.join(REPO, "benchmarks", "all_reduce_bench.py")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, script, "--check", "--rows", "8", "64", "256", "512", "2048"],
                            env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "sums equal the rank-ordered sum and NCCL's" in result.stdout

