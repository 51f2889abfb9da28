"""Tensor-parallel ranks 1..N-1: spawned processes that each build their shard of the model and run
every step rank 0 runs (the collectives need every rank, with identical inputs).

Rank 0 (the user's process) drives them through a ShmChannel: ("step", StepInput) runs one model
step, ("exit", None) ends the loop. A worker that fails sends its traceback through a pipe and
exits; rank 0 checks the workers' liveness whenever it waits, and before every command, so a dead
worker raises WorkerError in the user's process instead of a hang."""
import atexit
import os
import time
import traceback
from multiprocessing import get_context, parent_process
from multiprocessing.connection import wait

import torch

from nanovllm.config import Config
from nanovllm.engine.block_manager import cdiv
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.utils.distributed import (TPGroup, destroy_tp_group, init_tp_group, master_store,
                                        worker_store)
from nanovllm.utils.shm_channel import ShmChannel

JOIN_TIMEOUT_S = 10


class WorkerError(RuntimeError):
    """A tensor-parallel worker died; the engine cannot run any more steps."""


def channel_size(config: Config) -> int:
    """Bytes for the largest StepInput: token ids of a full step plus every block table (a pickled
    int takes at most 9 bytes)."""
    max_blocks = cdiv(config.max_model_len, config.kvcache_block_size)
    max_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)   # the most a step schedules
    ints = config.max_num_batched_tokens + max_seqs * (max_blocks + 8)
    return (1 << 20) + 9 * ints


def use_cuda(config: Config) -> bool:
    return config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())


class TPWorkers:
    """Rank 0's handle on ranks 1..N-1."""

    def __init__(self, config: Config):
        size = config.tensor_parallel_size
        self.device = torch.device("cuda", 0) if use_cuda(config) else torch.device("cpu")
        if self.device.type == "cuda":
            if torch.cuda.device_count() < size:
                raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs, "
                                 f"{torch.cuda.device_count()} are visible")
            torch.cuda.set_device(0)   # rank r uses GPU r
        ctx = get_context("spawn")
        self.store = master_store(size)
        self.channel = ShmChannel(ctx, size - 1, channel_size(config))
        self.processes, self.errors = [], []   # errors: per worker, the pipe its traceback comes through
        self.tracebacks: dict[int, str] = {}
        self.group: TPGroup | None = None
        self.closed = False
        atexit.register(self.shutdown)
        try:
            for rank in range(1, size):
                recv, send = ctx.Pipe(duplex=False)
                p = ctx.Process(target=worker_main, name=f"nanovllm-tp{rank}", daemon=True,
                                args=(config, rank, self.store.port, self.channel, send))
                p.start()
                send.close()
                self.processes.append(p)
                self.errors.append(recv)
            self.wait_until_joined()
            self.group = init_tp_group(self.store, 0, size, self.device)
        except BaseException:
            self.shutdown()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def wait_until_joined(self):
        """Wait (watching for deaths) until every worker has connected to the store, so a worker
        that fails while starting raises here rather than leaving rank 0 in the rendezvous."""
        keys = [f"joined{rank}" for rank in range(1, len(self.processes) + 1)]
        while not self.store.check(keys):
            self.check()
            time.sleep(0.05)

    def check(self):
        """Raise WorkerError if a worker has exited (with its traceback when it sent one)."""
        for rank, (p, conn) in enumerate(zip(self.processes, self.errors), start=1):
            if not p.is_alive():
                if rank not in self.tracebacks:
                    self.tracebacks[rank] = _traceback_sent(conn) or "no traceback (killed or crashed)"
                raise WorkerError(f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code "
                                  f"{p.exitcode}:\n{self.tracebacks[rank]}")

    def raise_if_died(self, error: BaseException, grace_s: float = 2.0):
        """After rank 0 failed (a collective broke): if a worker died or is dying, raise
        WorkerError naming it, chained to rank 0's error."""
        if self.closed:
            return
        ready = wait([p.sentinel for p in self.processes], timeout=grace_s)
        for p in self.processes:
            if p.sentinel in ready:   # its fds are closed, but it may not be reapable yet
                p.join(grace_s)
        try:
            self.check()
        except WorkerError as dead:
            raise dead from error

    def run_step(self, step):
        if self.closed:
            raise RuntimeError("the engine was shut down")
        self.check()
        self.channel.write(("step", step), self.check)

    def shutdown(self):
        """Stop the workers, remove the shared memory and drop the process group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.shutdown)
        told = False
        if self.processes and all(p.is_alive() for p in self.processes):
            try:
                self.channel.write(("exit", None), self.check)
                told = True
            except WorkerError:
                pass
        for p in self.processes:
            # Without a dead peer's acknowledgement no "exit" went out: the rest cannot run anyway.
            p.join(JOIN_TIMEOUT_S if told else 0)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.errors:
            conn.close()
        self.channel.close()
        destroy_tp_group(self.group)
        self.group = None


def worker_main(config: Config, rank: int, port: int, channel: ShmChannel, errors):
    """A worker's whole life: join the group, build the shard, run commands until "exit"."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)   # ranks share the host's cores; one thread each avoids oversubscription
    group = None
    try:
        if use_cuda(config):
            torch.cuda.set_device(rank)
        device = torch.device("cuda", rank) if use_cuda(config) else torch.device("cpu")
        store = worker_store(port, config.tensor_parallel_size)
        store.set(f"joined{rank}", "1")
        group = init_tp_group(store, rank, config.tensor_parallel_size, device)
        runner = ModelRunner(config, group)
        while True:
            command, arg = channel.read(rank - 1, _check_parent)
            if command == "exit":
                break
            if runner.forward_step(arg) is not None:
                runner.keep_sampled(None, sum(arg.samples))   # receive rank 0's sampled tokens
    except BaseException:
        try:
            errors.send(traceback.format_exc())
        finally:
            raise
    finally:
        channel.close()
        destroy_tp_group(group)


def _traceback_sent(conn) -> str | None:
    try:
        return conn.recv() if conn.poll() else None
    except (EOFError, OSError):   # the worker died without sending one
        return None


def _check_parent():
    if not parent_process().is_alive():
        raise SystemExit("rank 0 exited")
