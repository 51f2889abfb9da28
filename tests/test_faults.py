"""Faults anywhere in a generate call leave the engine as a fresh one: an exception or Ctrl-C at
any line of the engine's code (queueing, scheduling, block bookkeeping, the model step, sampling,
detokenizing stop strings, building outputs) makes generate re-raise it, and afterwards no block
is held, the queues are empty, nothing is in flight, and the next call gives the tokens of a fresh
engine. Under tensor parallelism an interrupted step marks the engine broken instead (the ranks may
be out of step); a fault elsewhere leaves it usable.

Ctrl-C is a signal: Python raises KeyboardInterrupt between any two lines. A trace function that
raises at the k-th line run in the engine's files reproduces that exactly, for every k we pick."""
import os
import subprocess
import sys
import threading
import time

import pytest

from conftest import assert_clean, random_prompts
from nanovllm import LLM, SamplingParams
from nanovllm.engine import (block_manager, decode_graphs, detokenizer, llm_engine, model_runner,
                             output_builder, requests, run_ahead, sampled_tokens, sampling_prep, scheduler,
                             sequence, step_input, stop_checker)
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.sampled_tokens import PendingSample
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stop_checker import StopChecker
from nanovllm.layers import sampler

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# A cache of 6 blocks of 8 tokens for about 100 tokens of requests, and 16-token steps: prompts are
# prefilled in chunks, decoding preempts, and two prompts share a cached first block.
# On CPU also on a GPU machine: CUDA wants blocks of 16 tokens, and the faults are in host code.
OPTIONS = dict(device="cpu", kvcache_block_size=8, num_kvcache_blocks=6, max_num_batched_tokens=16,
               max_num_seqs=4)
PROMPTS = random_prompts(5, [5, 20, 12, 12, 9], seed=11)
PROMPTS[3][:8] = PROMPTS[2][:8]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=5, ignore_eos=True),   # seeded: repeatable
    SamplingParams(temperature=0, max_tokens=12, stop=["w1"], logprobs=2, ignore_eos=True),   # detokenizer
    SamplingParams(temperature=0, max_tokens=4, presence_penalty=0.5, ignore_eos=True),   # waits each step
    SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
]
ENGINE_MODULES = (llm_engine, scheduler, block_manager, sequence, stop_checker, detokenizer, model_runner,
                  decode_graphs, step_input, sampled_tokens, sampler, sampling_prep, requests, output_builder,
                  run_ahead)
ENGINE_FILES = {m.__file__ for m in ENGINE_MODULES}


def summary(outputs) -> list:
    """What a caller sees: every completion's tokens, text, finish and stop reasons."""
    return [[(list(c.token_ids), c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


def run(llm):
    return summary(llm.generate(PROMPTS, PARAMS, use_tqdm=False))


def engine_and_expected(path: str, async_scheduling: bool):
    llm = LLM(path, async_scheduling=async_scheduling, **OPTIONS)
    expected = run(LLM(path, async_scheduling=async_scheduling, **OPTIONS))
    assert any(c[2] == "stop" for o in expected for c in o), "no stop string matched: the scenario misses it"
    return llm, expected


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    return engine_and_expected(qwen3_dir, async_scheduling=True)


@pytest.fixture(scope="module")
def sync_engine(qwen3_dir):
    return engine_and_expected(qwen3_dir, async_scheduling=False)


def assert_recovers(llm, expected, error, call, disarm=lambda: None):
    """call() raises error (or, when the fault never came, returns the expected outputs); after
    disarm() the engine is clean and gives the expected outputs again."""
    try:
        got = call()
    except error:
        got = None
    finally:
        disarm()
    if got is not None:
        assert summary(got) == expected
    assert_clean(llm)
    assert run(llm) == expected
    assert_clean(llm)
    return got is None


# ---- Ctrl-C or an exception at any line ---------------------------------------------------

class FaultAtLine:
    """A trace function that raises `error` at the k-th line run in the engine's files (k=None:
    only counts them). Raising from a trace function unsets it: one fault per call."""

    def __init__(self, k: int | None, error: type[BaseException]):
        self.k, self.error, self.count = k, error, 0

    def __call__(self, frame, event, arg):   # on each call: trace only the engine's own frames
        return self.line if frame.f_code.co_filename in ENGINE_FILES else None

    def line(self, frame, event, arg):
        if event == "line":
            self.count += 1
            if self.count == self.k:
                raise self.error(f"injected at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}")
        return self.line


def traced_run(llm, tracer: FaultAtLine):
    sys.settrace(tracer)
    try:
        return llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        sys.settrace(None)


@pytest.mark.parametrize("which", ["engine", "sync_engine"])
def test_a_fault_at_any_line_leaves_a_fresh_engine(request, which):
    llm, expected = request.getfixturevalue(which)
    assert run(llm) == expected   # each call below follows a good one: the prefix cache is warm
    counter = FaultAtLine(None, RuntimeError)
    assert summary(traced_run(llm, counter)) == expected
    lines = counter.count
    # 30 points spread over the whole call, plus the first lines (queueing, the first schedule).
    points = sorted({1, 2, 3, 5, 8, 13, 21, 34} | {lines * i // 30 for i in range(1, 30)})
    missed = []
    for i, k in enumerate(points):
        error = KeyboardInterrupt if i % 2 == 0 else RuntimeError
        fault = FaultAtLine(k, error)
        if not assert_recovers(llm, expected, error, lambda: traced_run(llm, fault)):  # noqa: B023 - called at once
            missed.append((k, error))
    assert not missed, f"faults swallowed instead of re-raised, of {lines} lines: {missed}"


def test_an_interrupt_during_the_recovery_is_finished_by_the_next_call(engine, monkeypatch):
    """A second Ctrl-C that cuts the reset short: the next call completes it first."""
    llm, expected = engine
    real_reset, calls = BlockManager.reset, []

    def interrupted_reset(self, num_blocks=None):
        calls.append(1)
        if len(calls) == 1:
            self.free_block_ids.popitem()   # half-way through: the free list is already wrong
            raise KeyboardInterrupt("second Ctrl-C")
        return real_reset(self, num_blocks)

    monkeypatch.setattr(BlockManager, "reset", interrupted_reset)
    # The first fault lands in the first step, inside the call's recovery scope (a fault at a fixed
    # line count would depend on the Python version's line events).
    faulty_schedule, _ = fail_on_call(Scheduler.schedule, 1, RuntimeError("injected in schedule"))
    monkeypatch.setattr(Scheduler, "schedule", faulty_schedule)
    with pytest.raises(KeyboardInterrupt, match="second Ctrl-C"):
        run(llm)
    assert run(llm) == expected
    assert_clean(llm)


# ---- Ctrl-C or an exception on the k-th call of a function --------------------------------

FUNCTIONS = [
    (BlockManager, "allocate"), (BlockManager, "deallocate"), (BlockManager, "may_append"),
    (BlockManager, "register_computed"), (BlockManager, "_take_free_block"),
    (Scheduler, "add"), (Scheduler, "schedule"), (Scheduler, "advance"), (Scheduler, "complete"),
    (Scheduler, "finish"), (Scheduler, "_preempt"),
    (Sequence, "append_token"), (StopChecker, "check"),
    (IncrementalDetokenizer, "step"), (IncrementalDetokenizer, "find_stop"),
    (ModelRunner, "launch"), (PendingSample, "result"),
    (run_ahead.RunAhead, "apply"), (output_builder.OutputBuilder, "request_output"),
]


def fail_on_call(real, k: int, error: BaseException):
    """real, wrapped to raise error on its k-th call; and the list its calls are counted in."""
    calls = []

    def faulty(*args, **kwargs):
        calls.append(1)
        if len(calls) == k:
            raise error
        return real(*args, **kwargs)
    return faulty, calls


@pytest.mark.parametrize("owner,name", FUNCTIONS, ids=[f"{o.__name__}.{n}" for o, n in FUNCTIONS])
def test_a_fault_in_a_function_leaves_a_fresh_engine(engine, monkeypatch, owner, name):
    llm, expected = engine
    real = getattr(owner, name)
    for k, error in [(1, KeyboardInterrupt), (2, RuntimeError), (5, KeyboardInterrupt)]:
        faulty, calls = fail_on_call(real, k, error(f"injected in {name}"))
        monkeypatch.setattr(owner, name, faulty)
        fired = assert_recovers(llm, expected, error, lambda: llm.generate(PROMPTS, PARAMS, use_tqdm=False),
                                disarm=lambda: monkeypatch.setattr(owner, name, real))
        assert fired or len(calls) < k
        if k == 1:
            assert fired, f"{name} was never called: the scenario does not reach it"


def test_a_fault_in_a_hand_driven_step_aborts_the_queued_requests(engine, monkeypatch):
    llm, expected = engine
    seqs = [seq for p, sp in zip(PROMPTS, PARAMS) for seq in llm.add_request(p, sp)]
    llm.step()
    real, calls = Scheduler._schedule_decode, []

    def interrupted(self):
        calls.append(1)
        if len(calls) < 3:
            return real(self)
        self.running.popleft()   # a sequence is out of both queues when Ctrl-C comes
        raise KeyboardInterrupt("injected")

    monkeypatch.setattr(Scheduler, "_schedule_decode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(100):
            llm.step()
    monkeypatch.setattr(Scheduler, "_schedule_decode", real)
    assert all(seq.is_finished and seq.finish_reason == "abort" and not seq.block_table for seq in seqs)
    assert llm.is_finished()
    assert_clean(llm)
    assert run(llm) == expected


# ---- tensor parallelism ---------------------------------------------------------------------

def test_tp_threads_and_faults(qwen3_dir):
    """A TP=2 engine shared by threads gives each its lone outputs (one call at a time: two steps
    mixed in the workers' channel would deadlock the ranks); a fault outside the model step leaves
    it usable; an interrupt inside one marks it broken. In a subprocess with a deadline: a
    desynchronised TP group could hang."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                        os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, __file__, "tp", qwen3_dir], env=env, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0 and "TP FAULTS OK" in result.stdout, \
        result.stdout[-3000:] + result.stderr[-3000:]


def tp_faults(path: str):
    import torch
    torch.set_num_threads(1)
    llm = LLM(path, tensor_parallel_size=2, **OPTIONS)   # gloo, also on a GPU machine
    expected = run(llm)

    # Threads: each call's outputs are its lone outputs.
    jobs = [(PROMPTS[i:i + 2], PARAMS[i:i + 2]) for i in range(4)]
    alone = [summary(llm.generate(p, sp, use_tqdm=False)) for p, sp in jobs]
    got = {}

    def generate(i):
        got[i] = [summary(llm.generate(*jobs[i], use_tqdm=False)) for _ in range(2)]

    threads = [threading.Thread(target=generate, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a thread is still running: deadlock?"
    assert [got.get(i) for i in range(len(jobs))] == [[a] * 2 for a in alone]
    assert_clean(llm)

    # A fault outside the model step (here in the scheduler) leaves every rank in step.
    real = Scheduler.complete
    Scheduler.complete, _ = fail_on_call(real, 3, KeyboardInterrupt("injected in complete"))
    try:
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        raise AssertionError("the fault did not fire")
    except KeyboardInterrupt:
        pass
    Scheduler.complete = real
    assert_clean(llm)
    assert run(llm) == expected

    # Ctrl-C after the workers got a step and before rank 0 finished its part: broken, at once.
    llm.model_runner.forward_step, _ = fail_on_call(llm.model_runner.forward_step, 2,
                                                    KeyboardInterrupt("injected in rank 0's step"))
    try:
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        raise AssertionError("the fault did not fire")
    except KeyboardInterrupt:
        pass
    assert_clean(llm)
    for call in (lambda: llm.generate(PROMPTS, PARAMS, use_tqdm=False), llm.step,
                 lambda: llm.add_request(PROMPTS[0])):
        start = time.monotonic()
        try:
            call()
            raise AssertionError("a broken engine ran a call")
        except RuntimeError as e:
            assert "can no longer run" in str(e) and "Create a new LLM" in str(e), e
        assert time.monotonic() - start < 1
    start = time.monotonic()
    llm.shutdown()   # the worker waits in a collective rank 0 never joins: shutdown kills it
    assert time.monotonic() - start < 15, "shutdown of an out-of-step engine took too long"
    print("TP FAULTS OK")


if __name__ == "__main__":
    if sys.argv[1] == "tp":
        tp_faults(sys.argv[2])
