"""The tensor-parallel group as the layers see it.

Each engine owns its own group, so two engines can live in one process: the group is not
torch.distributed's global default group but a c10d backend built on the engine's own TCP store.
ModelRunner makes its group current (scoped, like forward_context) while it builds and runs the
model; outside any group the world size is 1.

A group may carry a `watch` function (rank 0: TPWorkers.check) that waits call while they last:
a wait that blocks the host (a gloo collective, a device synchronize) is cut into short waits, so
a dead or stopped peer raises instead of hanging until the backend's timeout, and Ctrl-C is seen."""
import datetime
import logging
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

STARTUP_TIMEOUT = datetime.timedelta(minutes=10)   # loading a large shard can take minutes
WAIT_SLICE = datetime.timedelta(milliseconds=100)  # a watched wait calls watch() this often
ABORT_TIMEOUT_S = 10.0   # the longest abort_tp_group waits for the backend's abort
GRAPH_GRACE_S = 0.5      # how long an abort may run before the graphs holding the communicator go

logger = logging.getLogger(__name__)


@dataclass
class TPGroup:
    rank: int
    size: int
    backend: object   # a c10d backend: ProcessGroupNCCL on CUDA, ProcessGroupGloo on CPU
    store: object     # the TCPStore the backend rendezvoused through (kept alive with it)
    graphs: list = field(default_factory=list)   # CUDA graphs that captured this group's collectives
    watch: Callable[[], None] | None = None      # called during long waits; raises to abandon them
    aborted: bool = False
    peer: object = None   # a kernels.all_reduce.PeerAllReduce for the sums that fit it (CUDA), or None


_current: ContextVar[TPGroup | None] = ContextVar("tp_group", default=None)


@contextmanager
def tp_group(group: TPGroup | None):
    """Make `group` the one tp_rank/tp_size/collectives use inside the block."""
    token = _current.set(group)
    try:
        yield
    finally:
        _current.reset(token)


def master_store(world_size: int) -> dist.TCPStore:
    """Rank 0's store on a free port (port 0: the OS picks one, so engines never collide)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=STARTUP_TIMEOUT,
                         wait_for_workers=False)


def worker_store(port: int, world_size: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=STARTUP_TIMEOUT)


def init_tp_group(store: dist.TCPStore, rank: int, size: int, device: torch.device,
                  watch: Callable[[], None] | None = None) -> TPGroup:
    """Rendezvous with the other ranks: NCCL on CUDA, gloo on CPU."""
    if device.type == "cuda":
        # Built as init_process_group builds its NCCL backend; communicators start on first use.
        backend = dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
    else:
        backend = dist.ProcessGroupGloo(store, rank, size, STARTUP_TIMEOUT)
    return TPGroup(rank, size, backend, store, watch=watch)


def abort_tp_group(group: TPGroup | None, reset_graphs: bool = True):
    """Abandon the group's collectives at once (a peer died or stopped): NCCL kernels waiting for
    the peer exit instead of spinning forever. Later collectives in the group fail or are garbage;
    the engine runs none.

    The abort goes first, on a thread of its own: it raises NCCL's abort flag, which ends kernels
    spinning for the lost peer, also those inside a replaying CUDA graph. NCCL then may wait for
    the graphs that captured the communicator to be released before its abort returns (on the
    H200 it did), so those are reset once the kernels had GRAPH_GRACE_S to exit; resetting them
    first could wait on a graph whose kernel never ends. reset_graphs=False (the watch thread,
    while rank 0's thread may still launch them) leaves the graphs to destroy_tp_group."""
    if group is None or group.aborted:
        return
    group.aborted = True
    if group.peer is not None:
        group.peer.abort()   # the peer-memory kernels stop spinning for the lost rank
    aborting = threading.Thread(target=group.backend.abort, name="tp-group-abort", daemon=True)
    aborting.start()
    start = time.monotonic()
    if reset_graphs and group.graphs:
        aborting.join(GRAPH_GRACE_S)
        reset_captured_graphs(group)
    # Bounded: should the backend's abort block (on a dead peer), the fault is still reported
    # at once, and the communicator is left to the process's end.
    aborting.join(max(0.0, ABORT_TIMEOUT_S - (time.monotonic() - start)))
    if aborting.is_alive():
        logger.warning("aborting the tensor-parallel group did not finish within %.0f s; left to the "
                       "process's end", ABORT_TIMEOUT_S)


def reset_captured_graphs(group: TPGroup):
    """Release the CUDA graphs that captured the group's collectives (their kernels must not be running)."""
    for graph in group.graphs:
        graph.reset()
    group.graphs.clear()


def destroy_tp_group(group: TPGroup | None):
    """Release the group. The CUDA graphs that captured its collectives are reset first: NCCL will
    not destroy a communicator while a captured graph still holds it (the shutdown would hang). An
    aborted group has nothing left to shut down."""
    if group is None:
        return
    reset_captured_graphs(group)
    close_peer_all_reduce(group)
    if not group.aborted and hasattr(group.backend, "shutdown"):
        group.backend.shutdown()


def close_peer_all_reduce(group: TPGroup):
    """Unmap the peers' all-reduce buffers and free this rank's (nothing may run that uses them)."""
    if group.peer is not None:
        group.peer.close()
        group.peer = None


def tp_rank() -> int:
    group = _current.get()
    return group.rank if group else 0


def tp_size() -> int:
    group = _current.get()
    return group.size if group else 1


def all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place: x becomes the sum (or op) of every rank's x."""
    group = _current.get()
    if group and group.size > 1:
        if op == dist.ReduceOp.SUM and group.peer is not None and group.peer.fits(x):
            return group.peer(x)
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        _wait(group, group.backend.allreduce([x], opts))
    return x


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """In place: every rank's x becomes rank src's."""
    group = _current.get()
    if group and group.size > 1:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        _wait(group, group.backend.broadcast([x], opts))
    return x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard of the last dimension (every rank gets the whole)."""
    group = _current.get()
    if not group or group.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(group.size)]
    _wait(group, group.backend.allgather([parts], [x.contiguous()]))
    return torch.cat(parts, dim=-1)


def _wait(group: TPGroup, work):
    """Finish a collective. NCCL's wait() only orders the streams and returns at once (the host
    waits later, in wait_for_device or on a step's event). gloo's blocks this thread until the
    peers take part, so with a watch it waits in slices: the backend's own timeout is minutes."""
    if group.watch is None or not isinstance(group.backend, dist.ProcessGroupGloo):
        work.wait()
        return
    while True:
        try:
            work.wait(WAIT_SLICE)
            return
        except RuntimeError:
            if work.is_completed():
                work.wait()   # it failed (a peer closed its connection): raise its own error
                return
            group.watch()    # it timed out: are the peers alive?


def wait_for_device(device: torch.device):
    """torch.cuda.synchronize(), left through the current group's watch when a peer fails: a
    device waiting on a collective whose peer is gone would never finish."""
    if device.type != "cuda":
        return
    group = _current.get()
    if group is None or group.watch is None:
        torch.cuda.synchronize()
        return
    event = torch.cuda.Event()
    event.record()
    next_watch = time.monotonic() + WAIT_SLICE.total_seconds()
    while not event.query():
        if time.monotonic() >= next_watch:
            group.watch()
            next_watch = time.monotonic() + WAIT_SLICE.total_seconds()
        time.sleep(0.001)


def host_barrier(name: str):
    """Wait, through the store and calling the group's watch, until every rank of the current group
    has got here. Used before a group's first collective: NCCL sets its communicator up there and
    blocks the host until every rank arrives, so a rank that failed earlier (loading its shard)
    would leave the others waiting there for good."""
    exchange(name, b"1")


def exchange(name: str, payload: bytes) -> list[bytes]:
    """Every rank of the current group publishes payload under name; returns all of them, in rank
    order, once every rank has (waiting in short sleeps, calling the group's watch between them)."""
    group = _current.get()
    if group is None or group.size == 1:
        return [payload]
    group.store.set(f"{name}{group.rank}", payload)
    keys = [f"{name}{rank}" for rank in range(group.size)]
    while not group.store.check(keys):
        if group.watch is not None:
            group.watch()
        time.sleep(0.01)
    return [group.store.get(key) for key in keys]


def connect_peer_all_reduce(device: torch.device):
    """Give the current group a one-shot all-reduce over peer memory (kernels/all_reduce.py) when
    every GPU of it can address every other's memory and every rank could map the others'
    buffers; otherwise keep NCCL for every sum (with a warning). Every rank decides the same,
    from what all of them report."""
    from nanovllm.kernels.all_reduce import PeerAllReduce
    group = _current.get()
    if group is None or group.size == 1 or device.type != "cuda":
        return
    ranks = range(group.size)
    ok = all(torch.cuda.can_device_access_peer(device.index, r) for r in ranks if r != device.index)
    if not all(answer == b"1" for answer in exchange("peer_access", b"1" if ok else b"0")):
        logger.info("tensor parallel: a GPU cannot address its peers' memory; NCCL does every all-reduce")
        return
    try:
        peer = PeerAllReduce.connect(group.rank, group.size, device,
                                     lambda payload: exchange("peer_buffer", payload))
    except (RuntimeError, OSError) as e:   # a driver call failed (here or on another rank)
        logger.warning("tensor parallel: the peer-memory all-reduce could not start (%s)", e)
        peer = None
    if not all(answer == b"1" for answer in exchange("peer_ready", b"1" if peer is not None else b"0")):
        if peer is not None:
            peer.close()
        logger.warning("tensor parallel: NCCL does every all-reduce (a rank could not map its peers' memory)")
        return
    group.peer = peer


def min_across_ranks(n: int, device: torch.device) -> int:
    """The smallest n over all ranks of the current group (n itself on one rank)."""
    t = torch.tensor([n], dtype=torch.int64, device=device)
    all_reduce(t, dist.ReduceOp.MIN)
    wait_for_device(device)
    return int(t.item())
