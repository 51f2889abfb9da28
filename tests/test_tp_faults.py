"""Tensor-parallel faults on CPU (gloo): a worker that raises, is killed or is stopped, Ctrl-C to
rank 0 during a step and during shutdown, a start-up failure on a worker, a script without a main
guard. Each is an error naming the rank (with its traceback when there is one) within seconds,
never a hang; shutdown always finishes, twice, and leaves no process or /dev/shm entry behind.
Workers also end when rank 0 is killed.

The scenarios run in one subprocess (tests/tp_faults.py) with a deadline: a regression is a hang,
and the deadline turns it into a failure naming the scenario that did not finish."""
import os
import select
import subprocess
import sys
import time

import pytest

from conftest import REPO
from tp_faults_runner import assert_no_leftovers, run_scenarios

SCENARIOS = ["no_main_guard", "worker_raises", "worker_killed", "worker_killed_mid_generate",
             "worker_stopped", "interrupt_in_step", "interrupt_in_shutdown", "startup_failure",
             "interrupt_in_shutdown_then_exit", "worker_stopped_while_starting", "worker_killed_then_dropped"]


@pytest.fixture(scope="module")
def results(qwen3_dir):
    return run_scenarios(qwen3_dir, "cpu", SCENARIOS, timeout_s=300, scenario_s=120)


def test_no_main_guard(results):
    r = results("no_main_guard")
    assert r["same_tokens_as_tp1"]
    assert r["exit_codes"] == [0]   # told to exit, the worker ended by itself (not killed at the limit)
    assert r["shutdown"]["seconds"] < 3, r["shutdown"]
    assert_no_leftovers(r)


def test_worker_exception_names_the_rank_with_its_traceback(results):
    r = results("worker_raises")
    assert r["first"]["error"] == "WorkerError" and r["first"]["seconds"] < 10
    assert "rank 1" in r["first"]["message"] and "AttributeError" in r["first"]["message"]
    assert r["later"]["error"] == "WorkerError" and r["later"]["seconds"] < 1   # broken, at once
    assert_no_leftovers(r)


@pytest.mark.parametrize("name", ["worker_killed", "worker_killed_mid_generate"])
def test_killed_worker_raises_instead_of_hanging(results, name):
    r = results(name)
    assert r["first"]["error"] == "WorkerError" and r["first"]["seconds"] < 10
    assert "rank 1" in r["first"]["message"] and "SIGKILL" in r["first"]["message"]
    assert_no_leftovers(r)


def test_stopped_worker_is_reported_after_its_heartbeat_timeout(results):
    r = results("worker_stopped")   # WORKER_TIMEOUT_S = 2
    assert r["first"]["error"] == "WorkerError" and r["first"]["seconds"] < 10
    assert "rank 1" in r["first"]["message"] and "not answered" in r["first"]["message"]
    assert r["later"]["error"] == "WorkerError" and r["later"]["seconds"] < 1
    assert_no_leftovers(r)


def test_ctrl_c_in_a_step_interrupts_and_the_engine_says_it_is_out_of_step(results):
    r = results("interrupt_in_step")   # Ctrl-C 1.5 s after the worker was stopped (timeout 60 s)
    assert r["first"]["error"] == "KeyboardInterrupt" and r["first"]["seconds"] < 5
    assert r["in_step"]
    assert r["later"]["error"] == "RuntimeError" and "out of step" in r["later"]["message"]
    assert r["later"]["seconds"] < 1
    assert_no_leftovers(r)


def test_ctrl_c_in_shutdown_and_a_second_shutdown_finishes(results):
    r = results("interrupt_in_shutdown")
    assert r["interrupted"]["error"] == "KeyboardInterrupt" and r["interrupted"]["seconds"] < 5
    assert_no_leftovers(r)


def test_ctrl_c_in_shutdown_then_exit_leaves_no_worker(results):
    r = results("interrupt_in_shutdown_then_exit")
    assert r["interrupted"]["error"] == "KeyboardInterrupt"
    assert_no_leftovers(r, exited=True)


def test_startup_failure_on_a_worker_names_it_and_why(results):
    r = results("startup_failure")
    assert r["start"]["error"] == "WorkerError" and r["start"]["seconds"] < 30
    assert "rank 1" in r["start"]["message"] and "injected start-up failure" in r["start"]["message"]
    assert not r["shm_left"]


def test_worker_stopped_while_it_starts_fails_the_start_within_seconds(results):
    # stopped before its heartbeat began (still importing): the process state tells, not a beat
    r = results("worker_stopped_while_starting")
    assert r["stopped"], "no worker appeared to stop"
    assert r["start"]["error"] == "WorkerError" and r["start"]["seconds"] < 15, r["start"]
    assert "rank 1" in r["start"]["message"] and "stopped" in r["start"]["message"]
    assert not r["pids_alive"] and not r["shm_left"]   # killed, stopped or not


def test_a_failed_engine_is_freed_when_dropped_without_the_cycle_collector(results):
    r = results("worker_killed_then_dropped")
    assert r["first"]["error"] == "WorkerError"
    assert r["alive_after_del"] == []


RANK0 = r"""
import sys, time
from nanovllm import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", kvcache_block_size=16, num_kvcache_blocks=8)
print(*llm.executor.workers.pids, flush=True)
time.sleep(120)
"""


def test_workers_exit_when_rank0_is_killed(qwen3_dir):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", RANK0, qwen3_dir], env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "the engine did not start"
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids), "a worker outlived rank 0"
