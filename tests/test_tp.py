"""Tensor parallelism on CPU (gloo): TP=2 and TP=4 give TP=1's greedy tokens; engines live side by
side; shutdown leaves no process behind and gives the model's memory back. (Faults: test_tp_faults.py.)

Each TP engine starts workers that import torch (seconds each), so engines are module-scoped and
shared by the tests. The device is pinned to the CPU, so the tests run the same on a GPU machine."""
import atexit
import gc
import os
import socket
import time
import weakref

import pytest

from conftest import make_model, random_prompts
from nanovllm import LLM, SamplingParams

# A small cache (9 blocks of 16 tokens) and small steps, so the prompts below are prefilled in
# chunks and decoding preempts: TP must agree with TP=1 through all of it.
OPTIONS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=9, max_num_batched_tokens=48,
               max_num_seqs=4)
PROMPTS = random_prompts(4, [5, 17, 33, 40], seed=1)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


def reference(path: str, prompts=PROMPTS) -> list[list[int]]:
    return tokens(LLM(path, **OPTIONS), prompts)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("llama")), "llama")


def _engine(path: str, tp: int):
    llm = LLM(path, tensor_parallel_size=tp, **OPTIONS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def qwen3_tp2(qwen3_dir):
    yield from _engine(qwen3_dir, 2)


@pytest.fixture(scope="module")
def llama_tp2(llama_dir):
    yield from _engine(llama_dir, 2)


def _count_calls(obj, name: str, record):
    """Wrap obj.name so each call appends record(*args) to the returned list."""
    calls, original = [], getattr(obj, name)

    def wrapper(*args):
        result = original(*args)
        calls.append(record(*args))
        return result
    setattr(obj, name, wrapper)
    return calls


def test_tp2_matches_tp1_qwen3_with_preemption_and_prefix_cache(qwen3_dir, qwen3_tp2):
    expected = reference(qwen3_dir)
    preempted = _count_calls(qwen3_tp2.scheduler, "_preempt", lambda seq: seq.seq_id)
    cached = _count_calls(qwen3_tp2.scheduler.block_manager, "allocate", lambda seq: seq.num_computed_tokens)
    assert tokens(qwen3_tp2) == expected
    assert preempted, "the small cache should have forced a preemption"
    # Again: the prompts' full blocks are still cached, so prefill starts past them.
    cached.clear()
    assert tokens(qwen3_tp2) == expected
    assert any(n > 0 for n in cached), "the second run should have hit the prefix cache"


def test_tp2_prompt_logprobs_and_token_constraints_match_tp1(qwen3_dir, qwen3_tp2):
    """Prompt logprobs take extra logits rows in prefill (chunked here) on every rank; a chunk that
    only computes them samples nothing on any rank."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2,
                            logit_bias={7: 5.0}, bad_words=["w9"])

    tp2, tp1 = (llm.generate(PROMPTS[2:], params, use_tqdm=False)
                for llm in (qwen3_tp2, LLM(qwen3_dir, **OPTIONS)))
    for a, b in zip(tp2, tp1):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.prompt_logprobs[0] is None
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert list(x)[0] == list(y)[0]   # the prompt token
            expected = [lp.logprob for lp in y.values()]
            assert [lp.logprob for lp in x.values()] == pytest.approx(expected, abs=1e-4)


def test_tp2_matches_tp1_llama(llama_dir, llama_tp2):
    assert tokens(llama_tp2) == reference(llama_dir)


def test_two_engines_alive_at_once(qwen3_dir, llama_dir, qwen3_tp2, llama_tp2):
    a, b = qwen3_tp2.executor.workers, llama_tp2.executor.workers
    assert a.store.port != b.store.port
    prompts = PROMPTS[:2]
    want_q, want_l = reference(qwen3_dir, prompts), reference(llama_dir, prompts)
    for _ in range(2):   # interleaved, so each engine runs while the other has state
        assert tokens(qwen3_tp2, prompts) == want_q
        assert tokens(llama_tp2, prompts) == want_l


def _running(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def test_tp4_matches_tp1_and_shutdown_leaves_nothing(tmp_path):
    path = make_model(str(tmp_path / "qwen3_8h"), "qwen3", num_attention_heads=8, num_key_value_heads=4,
                      head_dim=8)
    expected = reference(path)
    llm = LLM(path, tensor_parallel_size=4, **OPTIONS)
    pids, port = llm.executor.workers.pids, llm.executor.workers.store.port
    assert len(pids) == 3 and all(map(_running, pids))
    assert tokens(llm) == expected
    model = weakref.ref(llm.model_runner.model)
    llm.shutdown()
    assert not any(map(_running, pids))
    assert model() is None, "shutdown should drop the model (and the KV cache with it)"
    with pytest.raises(ConnectionRefusedError):   # the rendezvous store (the group held it) is closed
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llm.shutdown()   # idempotent


def test_a_forked_child_leaves_the_workers_alone(qwen3_tp2):
    # A child forked from the engine's process inherits its atexit hook, its pipes and the engine:
    # the child's exit (hook, destructor or an explicit shutdown) must not stop the parent's workers.
    expect = tokens(qwen3_tp2, PROMPTS[:1])
    pid = os.fork()
    if pid == 0:
        try:
            qwen3_tp2.shutdown()
            atexit._run_exitfuncs()
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert all(map(_running, qwen3_tp2.executor.workers.pids))
    assert tokens(qwen3_tp2, PROMPTS[:1]) == expect


def test_deleting_an_engine_frees_its_model(qwen3_dir):
    llm = LLM(qwen3_dir, **OPTIONS)
    model, cache = weakref.ref(llm.model_runner.model), weakref.ref(llm.model_runner.kv_cache)
    tokens(llm, PROMPTS[:1])
    del llm
    gc.collect()
    assert model() is None and cache() is None


class _Recorder:
    """Stands for a backend or a CUDA graph: records the calls made on it."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def reset(self):
        self.calls.append(f"reset {self.name}")

    def shutdown(self):
        self.calls.append(f"shutdown {self.name}")

    def abort(self):
        self.calls.append(f"abort {self.name}")


def test_destroying_a_group_resets_its_captured_graphs_first():
    """NCCL cannot destroy a communicator while a CUDA graph that captured its collectives lives:
    the group resets those graphs before it shuts its backend down."""
    from nanovllm.parallel.parallel_state import TPGroup, destroy_tp_group
    calls = []
    group = TPGroup(0, 2, _Recorder("backend", calls), store=None)
    group.graphs.extend([_Recorder("graph 8", calls), _Recorder("graph 16", calls)])
    destroy_tp_group(group)
    assert calls == ["reset graph 8", "reset graph 16", "shutdown backend"] and not group.graphs


def test_an_aborted_group_is_aborted_once_and_not_shut_down():
    """After a fault the communicator is aborted first (NCCL kernels waiting for a dead peer exit,
    also inside a replaying graph), then its captured graphs are reset (on the H200 abort did not
    finish while a graph held the communicator); a graceful shutdown of it afterwards could wait
    for the peer, so destroy does nothing more."""
    from nanovllm.parallel.parallel_state import TPGroup, abort_tp_group, destroy_tp_group
    calls = []
    group = TPGroup(0, 2, _Recorder("backend", calls), store=None)
    group.graphs.append(_Recorder("graph 8", calls))
    abort_tp_group(group)
    abort_tp_group(group)
    destroy_tp_group(group)
    assert calls == ["abort backend", "reset graph 8"] and not group.graphs


def test_the_watch_threads_abort_leaves_the_graphs_to_rank_0():
    """The watch thread aborts without touching the graphs (rank 0's thread may be launching
    them); destroying the group later resets them."""
    from nanovllm.parallel.parallel_state import TPGroup, abort_tp_group, destroy_tp_group
    calls = []
    group = TPGroup(0, 2, _Recorder("backend", calls), store=None)
    group.graphs.append(_Recorder("graph 8", calls))
    abort_tp_group(group, reset_graphs=False)
    assert calls == ["abort backend"] and group.graphs
    destroy_tp_group(group)
    assert calls == ["abort backend", "reset graph 8"] and not group.graphs


def test_an_abort_that_blocks_is_left_behind_after_its_time(monkeypatch, caplog):
    """Should the backend's abort block (a dead peer), the fault is still reported: abort_tp_group
    returns after ABORT_TIMEOUT_S and says so."""
    import threading

    from nanovllm.parallel import parallel_state as distributed
    monkeypatch.setattr(distributed, "ABORT_TIMEOUT_S", 0.2)
    release = threading.Event()

    class Blocking:
        def abort(self):
            release.wait(30)

    start = time.monotonic()
    distributed.abort_tp_group(distributed.TPGroup(0, 2, Blocking(), store=None))
    assert time.monotonic() - start < 5
    assert "did not finish within" in caplog.text
    release.set()


def test_a_worker_that_exits_is_noticed_without_a_call(qwen3_dir):
    """The watch thread finds a worker that exited even while rank 0's thread looks nowhere (under
    NCCL it can be stuck in a driver call behind an all-reduce waiting for the lost peer): it records
    the error and aborts the group at once, and the next call raises it."""
    import signal

    from nanovllm.engine.tp_worker import WorkerError
    llm = LLM(qwen3_dir, tensor_parallel_size=2, **OPTIONS)
    try:
        workers = llm.executor.workers
        os.kill(workers.pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 5
        while workers.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert isinstance(workers.error, WorkerError) and "rank 1" in str(workers.error)
        assert "SIGKILL" in str(workers.error) and workers.group.aborted
        start = time.monotonic()
        with pytest.raises(WorkerError, match="rank 1"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 2
    finally:
        llm.shutdown()


def test_a_worker_stopped_during_a_step_is_noticed_without_a_call(qwen3_dir):
    """While rank 0's thread is inside a step (here: marked busy, as if stuck in a driver call), the
    watch thread finds a worker whose heartbeat stopped, records the error and aborts the group."""
    import signal

    from nanovllm.engine.tp_worker import WorkerError
    llm = LLM(qwen3_dir, tensor_parallel_size=2, **OPTIONS)
    try:
        workers = llm.executor.workers
        workers.timeout_s = 1.0
        os.kill(workers.pids[0], signal.SIGSTOP)
        workers.busy += 1
        deadline = time.monotonic() + 10
        while workers.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        workers.busy -= 1
        assert isinstance(workers.error, WorkerError) and "not answered" in str(workers.error)
        assert workers.group.aborted
        with pytest.raises(WorkerError, match="rank 1"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert not os.path.exists(f"/proc/{workers.pids[0]}")


def test_ctrl_c_unanswered_in_a_step_aborts_the_group(qwen3_dir, monkeypatch):
    """Ctrl-C reaches the watch thread during a step (signal.set_wakeup_fd); if rank 0's thread has
    not left the step INTERRUPT_GRACE_S later (stuck in a driver call), the group is aborted so the
    call can end, and the engine says the ranks are out of step. Between steps nothing happens."""
    from nanovllm.engine import tp_worker
    monkeypatch.setattr(tp_worker, "INTERRUPT_GRACE_S", 0.0)
    llm = LLM(qwen3_dir, tensor_parallel_size=2, **OPTIONS)
    try:
        workers = llm.executor.workers
        workers._watch_once({}, interrupted=True)   # not in a step: ignored
        assert workers.error is None
        workers.busy += 1
        seen = {}
        workers._watch_once(seen, interrupted=True)
        time.sleep(0.01)
        with pytest.raises(tp_worker.WorkerError, match="out of step"):
            workers._watch_once(seen, interrupted=False)
        workers.busy -= 1
        assert workers.group.aborted
        with pytest.raises(RuntimeError, match="out of step"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def test_ctrl_c_in_a_step_rank_0_left_is_not_charged_to_the_next(qwen3_dir, monkeypatch):
    """Ctrl-C heard in one step that rank 0's thread then left by itself: when the next step began
    before the watch thread looked again (it looks every WATCH_EVERY_S), the interrupt belongs to
    the finished step and aborts nothing (it once aborted the group a grace period later)."""
    from nanovllm.engine import tp_worker
    monkeypatch.setattr(tp_worker, "INTERRUPT_GRACE_S", 0.0)
    llm = LLM(qwen3_dir, tensor_parallel_size=2, **OPTIONS)
    try:
        workers = llm.executor.workers
        seen = {}
        with workers.stepping():
            workers._watch_once(seen, interrupted=True)
        with workers.stepping():
            time.sleep(0.01)
            workers._watch_once(seen, interrupted=False)
        assert workers.error is None and not workers.group.aborted
        assert tokens(llm) == tokens(llm)
    finally:
        llm.shutdown()


def test_stepping_hands_sigint_to_the_watch_pipe_only_inside_a_step(qwen3_dir):
    """Inside stepping() the main thread's signal wakeup fd is the watch thread's pipe (Ctrl-C still
    raises KeyboardInterrupt as usual), and outside it is left as it was."""
    import signal
    llm = LLM(qwen3_dir, tensor_parallel_size=2, **OPTIONS)
    try:
        workers = llm.executor.workers
        assert signal.set_wakeup_fd(-1) == -1
        with pytest.raises(KeyboardInterrupt):
            with workers.stepping():
                assert workers.busy == 1
                fd = signal.set_wakeup_fd(-1)
                signal.set_wakeup_fd(fd)
                assert fd == workers._signals_w
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
        assert workers.busy == 0 and signal.set_wakeup_fd(-1) == -1
        assert workers.error is None
        assert tokens(llm) == tokens(llm)   # still usable: the interrupt came between steps' work
    finally:
        llm.shutdown()
