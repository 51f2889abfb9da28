"""Rank 0's handle on tensor-parallel ranks 1..N-1: worker processes (worker_main.py) that each
build their shard of the model and run every step rank 0 runs (the collectives need every rank,
with identical inputs).

Workers are started as fresh interpreters (`python -c` calling worker_main.main), not with
multiprocessing's spawn: spawn re-imports the user's main module in the child, so a script without
an `if __name__ == "__main__":` guard would build a second engine inside every worker.

Rank 0 (the user's process) drives them through one command pipe each: ("step", StepInput) runs one
model step, ("exit", None) ends the loop. A worker that fails writes its traceback to its report
pipe and exits. Rank 0 never waits without a way out: every wait (a full pipe, a gloo collective,
a CUDA event of a step under NCCL) is a loop of short waits that calls TPWorkers.check, which
raises WorkerError when a worker has exited or has stopped answering (its heartbeat counter no
longer moves), and lets Ctrl-C through.

Under NCCL rank 0's thread can also be stuck where it cannot look: in a driver call (a kernel's
first launch loads its module) queued behind an all-reduce that spins for a lost peer. A watch
thread covers that: while a step runs it fails the group when a worker exits, stops answering, or
Ctrl-C goes unanswered for INTERRUPT_GRACE_S; failing aborts the communicator, which ends the
spinning kernel and frees rank 0's thread."""
import atexit
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

import nanovllm.envs as envs
from nanovllm.config import Config, uses_cuda
from nanovllm.parallel import command_pipe
from nanovllm.parallel.parallel_state import (STARTUP_TIMEOUT, TPGroup, abort_tp_group, destroy_tp_group,
                                              init_tp_group, master_store, reset_captured_graphs)
from nanovllm.parallel.heartbeat import Heartbeats
from nanovllm.utils.processes import Lifetime, child_pythonpath, is_stopped

# A worker whose heartbeat has not moved for this long is reported as not answering. Its
# heartbeat comes from a thread of its own, so a long step does not delay it: only a stopped
# process (SIGSTOP, a debugger) or one whose interpreter is frozen (the GIL held in native code)
# goes quiet. Read when an engine starts (tests lower it).
WORKER_TIMEOUT_S = 15.0
HEARTBEAT_S = 0.25
CHECK_EVERY_S = 0.01    # while rank 0 polls a CUDA event, how often it checks the workers
WATCH_EVERY_S = 0.1     # how often the watch thread looks at the workers
INTERRUPT_GRACE_S = 1.0  # after Ctrl-C in a step, how long rank 0's thread has to leave it by itself
JOIN_TIMEOUT_S = 5.0    # how long a worker told to exit may take before it is killed (it takes ~0.1 s)
_WORKER_MAIN = "from nanovllm.engine.worker_main import main; main()"
TRACEBACK_BYTES = 32_000   # a worker's report fits in a pipe's buffer, so writing it never blocks


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed, died or stopped answering; the engine cannot run any more
    steps."""


@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen
    commands: int            # write end of its command pipe
    reports: int             # read end of its report pipe
    beat: int = 0            # heartbeat count last seen, and when it last moved (rank 0's clock)
    beat_seen: float = field(default_factory=time.monotonic)

    def traceback(self) -> str | None:
        """What the (exited) worker wrote to its report pipe, if anything."""
        try:
            return os.read(self.reports, TRACEBACK_BYTES + 1024).decode(errors="replace") or None
        except OSError:   # nothing written, or already closed
            return None

    def close(self):
        for fd in (self.commands, self.reports):
            try:
                os.close(fd)
            except OSError:
                pass
        self.commands = self.reports = -1


class TPWorkers:
    """Rank 0's handle on ranks 1..N-1."""

    def __init__(self, config: Config, lifetime: Lifetime):
        """lifetime: the executor's, which this marks closed when it shuts the workers down."""
        size = config.tensor_parallel_size
        self.lifetime = lifetime
        self.device = torch.device("cuda", 0) if uses_cuda(config) else torch.device("cpu")
        if self.device.type == "cuda":
            if torch.cuda.device_count() < size:
                raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs, "
                                 f"{torch.cuda.device_count()} are visible")
            torch.cuda.set_device(0)   # rank r uses GPU r
        self.timeout_s = WORKER_TIMEOUT_S
        self.store = master_store(size)
        self.beats = Heartbeats(size)
        self.workers: list[_Worker] = []
        self.group: TPGroup | None = None
        self.error: WorkerError | None = None   # once set, every check raises it again
        self._watched_at = time.monotonic()
        self._fail_lock = threading.Lock()
        self.busy = 0   # > 0 while rank 0's thread runs or waits on a step (see stepping)
        self.steps = 0  # stepping periods begun (busy 0 -> 1): tells the watch thread one step from the next
        self._signals_w = -1   # the watch thread's signal pipe (see stepping)
        atexit.register(self.shutdown)   # unregistered once everything is released
        try:
            for rank in range(1, size):
                self._start(config, rank)
            self.wait_until_joined()
            self.group = init_tp_group(self.store, 0, size, self.device, watch=self.check)
        except BaseException:
            self.shutdown(graceful=False)
            raise
        # Signals caught during a step are written to this pipe (signal.set_wakeup_fd) for the watch
        # thread, which closes the read end when it ends.
        signals_r, self._signals_w = os.pipe()
        for fd in (signals_r, self._signals_w):
            os.set_blocking(fd, False)
        threading.Thread(target=_watch, args=(weakref.ref(self), signals_r), name="tp-watch",
                         daemon=True).start()

    def _start(self, config: Config, rank: int):
        commands_r, commands_w = command_pipe.new_pipe()
        reports_r, reports_w = os.pipe()
        fds = (commands_r, reports_w, self.beats.fd)
        # The worker imports the same nanovllm as rank 0, and runs one OpenMP thread: the ranks
        # share the host's cores.
        env = envs.environ_with(PYTHONPATH=child_pythonpath(), OMP_NUM_THREADS="1")
        try:
            proc = subprocess.Popen([sys.executable, "-c", _WORKER_MAIN, *map(str, fds), str(rank)],
                                    pass_fds=fds, env=env)
        except BaseException:
            for fd in (commands_r, commands_w, reports_r, reports_w):
                os.close(fd)
            raise
        os.close(commands_r)
        os.close(reports_w)
        os.set_blocking(reports_r, False)
        self.workers.append(_Worker(rank, proc, commands_w, reports_r))
        command_pipe.send(commands_w, command_pipe.encode((config, self.store.port)), self.check)

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def wait_until_joined(self):
        """Wait (watching for deaths) until every worker has connected to the store, so a worker
        that fails while starting raises here rather than leaving rank 0 in the rendezvous."""
        keys = [f"joined{w.rank}" for w in self.workers]
        deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
        while not self.store.check(keys):
            self.check()
            if time.monotonic() > deadline:
                self._fail(WorkerError(f"tensor-parallel workers did not start within {STARTUP_TIMEOUT}"))
            time.sleep(0.05)

    # ---- watching -------------------------------------------------------------------------

    @contextmanager
    def stepping(self):
        """Around rank 0's part of a step (launching it, waiting for it): the watch thread then
        counts a quiet worker's heartbeat as a fault, and hears Ctrl-C. Python runs signal
        handlers only between bytecodes, so Ctrl-C during a stuck driver call would wait for that
        call; with the wakeup fd the signal also reaches the watch thread (the main thread only,
        and only when nothing else uses the fd, such as an asyncio loop)."""
        wakeup = False
        if threading.current_thread() is threading.main_thread():
            previous = signal.set_wakeup_fd(self._signals_w, warn_on_full_buffer=False)
            wakeup = previous == -1
            if not wakeup:
                signal.set_wakeup_fd(previous)   # someone else's (an asyncio loop): theirs stays
        if not self.busy:
            self.steps += 1
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1
            if wakeup:
                signal.set_wakeup_fd(-1)

    def _watch_once(self, seen: dict, interrupted: bool):
        """One look of the watch thread. seen: its memory between looks (a worker's last heartbeat
        count and when it moved, when Ctrl-C came); interrupted: a SIGINT arrived since the last look.
        Raises WorkerError (having aborted the group) when it finds a fault."""
        for w in self.workers:
            code = w.proc.poll()
            if code is not None and not self.lifetime.closed:
                self._fail(self._exit_error(w, code), reset_graphs=False)
        if not self.busy:   # between steps: rank 0's thread is free to look for itself
            seen.clear()
            return
        now = time.monotonic()
        for w in self.workers:
            beat = self.beats.count(w.rank)
            last = seen.get(w.rank)
            if last is None or last[0] != beat:
                seen[w.rank] = (beat, now)
            elif beat and now - last[1] > self.timeout_s:
                self._fail(self._quiet_error(w, now - last[1]), reset_graphs=False)
        if interrupted:
            seen.setdefault("interrupted", (now, self.steps))
        if "interrupted" in seen and seen["interrupted"][1] != self.steps:
            del seen["interrupted"]   # rank 0 left that step by itself (the next began before this look)
        if "interrupted" in seen and now - seen["interrupted"][0] > INTERRUPT_GRACE_S:
            self._fail(WorkerError(
                "a step was interrupted (Ctrl-C) while rank 0 was blocked in it, waiting for a "
                "tensor-parallel worker: the ranks are out of step and their group was aborted"),
                reset_graphs=False)

    def check(self):
        """Raise WorkerError if a worker has exited (with its traceback when it wrote one) or its
        heartbeat has not moved for timeout_s while rank 0 was watching."""
        if self.error is not None:
            raise self.fresh_error()
        now = time.monotonic()
        # Staleness counts only while rank 0 watches: after a pause (the user idle between
        # calls, or rank 0 itself stopped with Ctrl-Z) every worker starts a fresh period.
        watching = now - self._watched_at < 1.0
        self._watched_at = now
        for w in self.workers:
            code = w.proc.poll()
            if code == 0 and self.lifetime.closed:
                continue   # told to exit, and did
            if code is not None:
                self._fail(self._exit_error(w, code))
            beat = self.beats.count(w.rank)
            if beat == 0 and is_stopped(w.proc.pid):   # before its heartbeat began: still importing
                self._fail(WorkerError(f"tensor-parallel worker rank {w.rank} (pid {w.proc.pid}) was "
                                       "stopped (SIGSTOP, a debugger) while it was starting"))
            if beat != w.beat or not watching:
                w.beat, w.beat_seen = beat, now
            elif beat and now - w.beat_seen > self.timeout_s:
                self._fail(self._quiet_error(w, now - w.beat_seen))

    def _quiet_error(self, w: "_Worker", seconds: float) -> WorkerError:
        return WorkerError(f"tensor-parallel worker rank {w.rank} (pid {w.proc.pid}) has not answered "
                           f"for {seconds:.1f} s: it is stopped (SIGSTOP, a debugger) or frozen")

    def _exit_error(self, w: "_Worker", code: int) -> WorkerError:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return WorkerError(f"tensor-parallel worker rank {w.rank} (pid {w.proc.pid}) {how}:\n"
                           f"{w.traceback() or 'no traceback (killed or crashed)'}")

    def _fail(self, error: WorkerError, reset_graphs: bool = True):
        """The group cannot go on: abort the communicator (an NCCL kernel waiting for a dead peer
        would spin forever and hold rank 0's stream), kill the workers, raise. The first error
        wins (rank 0's thread and the watch thread may both find one). reset_graphs=False: the
        caller is not rank 0's thread, which may be launching the graphs."""
        with self._fail_lock:
            if self.error is None:
                self.error = error
                abort_tp_group(self.group, reset_graphs)
                for w in self.workers:
                    if w.proc.poll() is None:
                        w.proc.kill()
        raise self.fresh_error()

    def fresh_error(self) -> WorkerError:
        """A fresh copy of the error to raise: the stored one never carries a traceback, whose
        frames would keep this object and its group alive after the engine is dropped."""
        return WorkerError(*self.error.args)

    def raise_if_died(self, error: BaseException, grace_s: float = 2.0):
        """After rank 0 failed (a gloo collective broke): if a worker died or is dying, raise
        WorkerError naming it, chained to rank 0's error."""
        if self.lifetime.closed and self.error is None:
            return
        deadline = time.monotonic() + grace_s
        try:
            while True:
                self.check()
                if time.monotonic() > deadline:
                    return
                time.sleep(0.02)
        except WorkerError as dead:
            raise dead from error

    def wait_until(self, done):
        """Poll done() (a CUDA event's query) until it is true, checking the workers every
        CHECK_EVERY_S: under NCCL a step whose peer died never completes, and a blocking
        synchronize could not be left, not even with Ctrl-C."""
        next_check = time.monotonic() + CHECK_EVERY_S
        while not done():
            if time.monotonic() >= next_check:
                self.check()
                next_check = time.monotonic() + CHECK_EVERY_S
            time.sleep(0)   # yields, like CUDA's own spin-wait, without adding a sleep's latency
        self.check()   # an aborted group's kernels end too: their step is garbage, not done

    # ---- commands -------------------------------------------------------------------------

    def run_step(self, step):
        self.check()
        data = command_pipe.encode(("step", step))
        for w in self.workers:
            command_pipe.send(w.commands, data, self.check)

    def shutdown(self, graceful: bool = True):
        """Stop the workers, drop the process group. Idempotent. graceful=False (the ranks are out
        of step, or a worker failed) kills the workers without asking. A shutdown cut short by
        Ctrl-C is finished by the next call, or at exit: the atexit hook stays until the end.
        In a child forked from rank 0's process (which inherits the hook and the pipes) it does
        nothing: the workers are the parent's."""
        if self.lifetime.forked:
            return
        ask = graceful and not self.lifetime.closed and self.error is None
        self.lifetime.closed = True
        try:
            if ask:
                self._ask_workers_to_exit()
        finally:
            self._release()

    def _ask_workers_to_exit(self):
        try:
            data = command_pipe.encode(("exit", None))
            for w in self.workers:
                command_pipe.send(w.commands, data, self.check)
            if self.device.type == "cuda":
                # Rank 0 lets go of its side while the workers end: a process's exit waits for
                # its NCCL peers' side of their shared memory, so waiting first costs seconds.
                self._release_group()
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            for w in self.workers:
                while w.proc.poll() is None and time.monotonic() < deadline:
                    self.check()
                    time.sleep(0.01)
        except WorkerError:
            pass   # one failed or stopped: _release kills the rest

    def _release_group(self):
        """Drop rank 0's side of the group. The workers end without a collective teardown (see
        worker_main): NCCL's would wait for peers that are gone or going, so rank 0 aborts its side
        (after releasing the graphs that captured it, when nothing can be running); gloo's closes."""
        if self.group is None:
            return
        group, self.group = self.group, None
        clean = self.error is None and all(w.proc.returncode in (None, 0) for w in self.workers)
        if not clean or self.device.type == "cuda":
            if clean:
                reset_captured_graphs(group)
            abort_tp_group(group)
        destroy_tp_group(group)

    def _release(self):
        """Kill what is still running, close the pipes and the group. Each step is quick and safe
        to repeat."""
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.kill()
            w.proc.wait()
            w.close()
        self._release_group()
        if self.beats is not None:
            self.beats.close()
            self.beats = None
        if self._signals_w != -1:
            os.close(self._signals_w)   # (the read end is the watch thread's to close)
            self._signals_w = -1
        self.store = None
        atexit.unregister(self.shutdown)


def _watch(ref: "weakref.ref[TPWorkers]", signals: int):
    """Rank 0's second pair of eyes (see the module's docstring): looks at the workers every
    WATCH_EVERY_S, and at once when a signal arrives, until the workers are closed or failed."""
    seen = {}
    try:
        while True:
            select.select([signals], [], [], WATCH_EVERY_S)
            try:
                interrupted = signal.SIGINT in os.read(signals, 512)
            except BlockingIOError:
                interrupted = False
            workers = ref()
            if workers is None or workers.lifetime.closed or workers.error is not None:
                return
            try:
                workers._watch_once(seen, interrupted)
            except WorkerError:
                return   # recorded, and the group aborted: rank 0's next check raises it
            except ValueError:
                if workers.lifetime.closed:
                    return   # shut down while looking (the heartbeat map was closed)
                raise
            del workers
    finally:
        os.close(signals)

