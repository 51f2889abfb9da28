"""Fault scenarios for a TP=2 engine, run by tests/test_tp_faults.py (gloo, CPU) and
tests/test_tp_gpu.py (NCCL) in a subprocess with a deadline, since a regression here is a hang:

    python tests/tp_faults.py MODEL_DIR DEVICE SCENARIO...

prints one JSON line per scenario as it finishes. This file deliberately has no
`if __name__ == "__main__":` guard: the workers must not run the user's script (scenario
"no_main_guard" generates with TP=2 from it)."""
import faulthandler
import functools
import json
import os
import signal
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import random_prompts  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine import tp_worker  # noqa: E402
from nanovllm.parallel import command_pipe  # noqa: E402

MODEL, DEVICE, SCENARIOS = sys.argv[1], sys.argv[2], sys.argv[3:]
faulthandler.register(signal.SIGUSR1, all_threads=True)   # the runner asks where a hung scenario is
OPTIONS = dict(device=DEVICE, kvcache_block_size=16, num_kvcache_blocks=16, max_num_batched_tokens=64,
               max_num_seqs=4, enforce_eager=True)
PROMPTS = random_prompts(3, [5, 17, 33], seed=1)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
KEEP = []
LONG = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)   # runs until interrupted


def tokens(llm, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def keep_generating(llm, seconds: float = 60):
    """Generate again and again (a fault meant to land mid-generate stops it with an error)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tokens(llm, LONG)


def outcome(fn) -> dict:
    """{"error": type name, "message": first lines, "seconds": how long fn took}."""
    start = time.monotonic()
    try:
        fn()
        error, message = None, ""
    except BaseException as e:   # KeyboardInterrupt included: it is what some scenarios expect
        error, message = type(e).__name__, str(e)[:2000]
    return dict(error=error, message=message, seconds=round(time.monotonic() - start, 2))


def interrupt_after(seconds: float):
    """Ctrl-C to this process (rank 0) after `seconds`, as a user would press it."""
    threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT)).start()


def shm_mapped(pids: list[int]) -> list[str]:
    """Files of /dev/shm (segments, sem.mp-* semaphores) these processes have mapped and that are
    still there (not unlinked): the engine uses none, so none can be left behind."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                found.update(line.split(maxsplit=5)[5].strip() for line in f
                             if "/dev/shm/" in line and not line.rstrip().endswith("(deleted)"))
        except OSError:
            pass   # already gone
    return sorted(found)


def finish(llm, record: dict) -> dict:
    """Shut down twice (idempotent); record how long it took and what was left behind."""
    pids = llm.executor.workers.pids
    record["shm_mapped"] = shm_mapped([os.getpid(), *pids])
    record["shutdown"] = outcome(llm.shutdown)
    record["second_shutdown"] = outcome(llm.shutdown)
    record["pids"] = pids
    record["exit_codes"] = [w.proc.returncode for w in llm.executor.workers.workers]   # -9: killed
    record["workers_left"] = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
    return record


def no_main_guard():
    expected = tokens(LLM(MODEL, **OPTIONS))
    llm = LLM(MODEL, tensor_parallel_size=2, **OPTIONS)
    return finish(llm, dict(same_tokens_as_tp1=tokens(llm) == expected))


def worker_raises():
    llm = LLM(MODEL, tensor_parallel_size=2, **OPTIONS)
    workers = llm.executor.workers
    # A command the worker cannot run: it fails inside its step loop, as a bug there would.
    bad = command_pipe.encode(("step", "not a StepInput"))
    command_pipe.send(workers.workers[0].commands, bad, workers.check)
    return finish(llm, dict(first=outcome(lambda: tokens(llm)), later=outcome(lambda: tokens(llm))))


def worker_killed():
    llm = LLM(MODEL, tensor_parallel_size=2, **OPTIONS)
    os.kill(llm.executor.workers.pids[0], signal.SIGKILL)
    return finish(llm, dict(first=outcome(lambda: tokens(llm)), later=outcome(lambda: tokens(llm))))


def worker_killed_mid_generate():
    llm = LLM(MODEL, tensor_parallel_size=2, **OPTIONS)
    threading.Timer(1.0, os.kill, (llm.executor.workers.pids[0], signal.SIGKILL)).start()
    return finish(llm, dict(first=outcome(lambda: keep_generating(llm))))


def worker_killed_mid_generate_graphs():
    """As above with CUDA graphs: decode's collectives run inside graph replays."""
    llm = LLM(MODEL, tensor_parallel_size=2, **{**OPTIONS, "enforce_eager": False})
    threading.Timer(1.0, os.kill, (llm.executor.workers.pids[0], signal.SIGKILL)).start()
    return finish(llm, dict(first=outcome(lambda: keep_generating(llm))))


def worker_stopped():
    tp_worker.WORKER_TIMEOUT_S = 2.0
    llm = LLM(MODEL, tensor_parallel_size=2, **OPTIONS)
    os.kill(llm.executor.workers.pids[0], signal.SIGSTOP)
    return finish(llm, dict(first=outcome(lambda: tokens(llm)), later=outcome(lambda: tokens(llm))))


def interrupt_in_step():
    """Ctrl-C while rank 0 waits for a worker that does not answer (stopped, with a heartbeat
    timeout far away): the wait is left at once, and the engine says the ranks are out of step."""
    tp_worker.WORKER_TIMEOUT_S = 60.0
    llm = LLM(MODEL, tensor_parallel_size=2, **OPTIONS)
    os.kill(llm.executor.workers.pids[0], signal.SIGSTOP)
    interrupt_after(1.5)
    record = dict(first=outcome(lambda: tokens(llm)), in_step=llm.executor.in_step)
    if record["in_step"]:   # (under NCCL the step may have been launched whole: then only result waited)
        record["later"] = outcome(lambda: tokens(llm))
    return finish(llm, record)


def interrupt_in_shutdown():
    """Ctrl-C inside shutdown() (it waits for a stopped worker to exit): a second shutdown()
    finishes the job."""
    tp_worker.WORKER_TIMEOUT_S = 60.0
    llm = LLM(MODEL, tensor_parallel_size=2, **OPTIONS)
    tokens(llm)
    os.kill(llm.executor.workers.pids[0], signal.SIGSTOP)
    interrupt_after(1.0)
    return finish(llm, dict(interrupted=outcome(llm.shutdown)))


def interrupt_in_shutdown_then_exit():
    """As above, but the process then exits without another shutdown(): the atexit hook stops
    the workers (the test checks the pids after this process is gone)."""
    tp_worker.WORKER_TIMEOUT_S = 60.0
    llm = LLM(MODEL, tensor_parallel_size=2, **OPTIONS)
    os.kill(llm.executor.workers.pids[0], signal.SIGSTOP)
    interrupt_after(1.0)
    KEEP.append(llm)   # alive until exit: what stops the workers must be the atexit hook
    return dict(interrupted=outcome(llm.shutdown), pids=llm.executor.workers.pids,
                shm_mapped=shm_mapped([os.getpid(), *llm.executor.workers.pids]))


def startup_failure():
    """Rank 1 fails while building its runner (tests/worker_faults/sitecustomize.py injects it)."""
    os.environ["NANOVLLM_TEST_FAIL_WORKER_START"] = "1"
    try:
        return dict(start=outcome(lambda: LLM(MODEL, tensor_parallel_size=2, **OPTIONS)))
    finally:
        del os.environ["NANOVLLM_TEST_FAIL_WORKER_START"]


def worker_killed_then_dropped():
    """After a WorkerError, shutdown() and dropping the LLM free the workers' bookkeeping and their
    group at once, with the cycle collector off: nothing (such as the error's traceback) keeps them."""
    import gc
    import weakref
    llm = LLM(MODEL, tensor_parallel_size=2, **OPTIONS)
    os.kill(llm.executor.workers.pids[0], signal.SIGKILL)
    workers, group = weakref.ref(llm.executor.workers), weakref.ref(llm.executor.workers.group)
    first = outcome(functools.partial(tokens, llm))
    llm.shutdown()
    gc.disable()
    try:
        del llm
        alive = [name for name, ref in (("workers", workers), ("group", group)) if ref() is not None]
    finally:
        gc.enable()
    return dict(first=first, alive_after_del=alive)


def worker_stopped_while_starting():
    """A worker stopped (SIGSTOP) as soon as it exists, while it imports, before its heartbeat
    begins: LLM() raises within seconds, not after the start-up timeout."""
    stopped = []

    def stop_the_first_worker():
        deadline = time.monotonic() + 60
        while not stopped and time.monotonic() < deadline:
            for pid in _children():
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            time.sleep(0.01)
    threading.Thread(target=stop_the_first_worker, daemon=True).start()
    start = outcome(lambda: LLM(MODEL, tensor_parallel_size=2, **OPTIONS))
    time.sleep(0.5)
    return dict(start=start, stopped=stopped, pids_alive=[p for p in stopped if os.path.exists(f"/proc/{p}")])


def _children() -> list[int]:
    """This process's child processes (Linux's /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    return found


for name in SCENARIOS:
    tp_worker.WORKER_TIMEOUT_S = 15.0
    try:
        record = globals()[name]()
    except BaseException:
        record = dict(crashed=traceback.format_exc())
    record["shm_left"] = [f for f in os.listdir("/dev/shm") if f.startswith(f"nanovllm-{os.getpid()}-")]
    print(json.dumps({"scenario": name, **record}), flush=True)
