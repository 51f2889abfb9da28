"""The peer-memory all-reduce kernel (nanovllm/kernels/all_reduce.py) under the Triton interpreter:
2 and 3 ranks as processes over shared host buffers run the whole protocol (push, signal, wait,
sum) for several calls in a row (both buffer halves, tensors over several of the grid's spans, a
tensor larger than a slot in two launches, bf16 and fp32), and every rank gets the rank-ordered
sum, bit for bit. A rank whose peer never comes is ended by the abort word within seconds. On two
GPUs, tests/test_tp_gpu.py runs it against NCCL (benchmarks/all_reduce_bench.py --check)."""
import os
import threading
import time

import pytest
import torch
import torch.multiprocessing

from conftest import interp, run_interpreted_tests
from nanovllm.parallel.parallel_state import TPGroup, all_reduce, tp_group

SLOT_BYTES = 1 << 19   # small buffers and grids: the interpreter is slow
GRID = dict(programs=64, block=1024)
# (elements, dtype) per call: within one span, over two spans of the grid (64 x 1024), uneven ends,
# a whole slot, two slots' worth (two launches)
CALLS = [(1000, torch.bfloat16), (70_001, torch.float32), (5, torch.bfloat16), (131_072, torch.float32),
         (200_000, torch.float32), (3000, torch.bfloat16)]


def test_peer_all_reduce_interpreted():
    run_interpreted_tests(__file__)


def partial(rank: int, call: int, n: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * call + rank)
    return (torch.randn(n, generator=g) * (rank + 1)).to(dtype)


def _rank(rank: int, buffers, results, grid):
    parent = os.getppid()

    def watch_parent():   # the test's process was killed: end too, rather than wait for peers forever
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch_parent, daemon=True).start()
    from nanovllm.kernels.all_reduce import PeerAllReduce
    ar = PeerAllReduce(rank, [b.data_ptr() for b in buffers], torch.device("cpu"), slot_bytes=SLOT_BYTES,
                       **grid)
    ar.max_bytes = 1 << 30   # larger than a slot too: in chunks
    outs = []
    for call, (n, dtype) in enumerate(CALLS):
        x = partial(rank, call, n, dtype)
        assert ar.fits(x)
        outs.append(ar(x).clone())
    results[rank] = torch.cat([o.float() for o in outs])


# Two ranks with the default grid (what TP=2 runs) and three with the small grid: the kernel is the same
# code for any WORLD (static loops over the ranks), so two ranks on the small grid added only time.
@interp
@pytest.mark.parametrize("world, grid", [(3, GRID), (2, {})], ids=["3", "2-default-grid"])
def test_interp_every_rank_gets_the_rank_ordered_sum(world, grid):
    from nanovllm.kernels.all_reduce import buffer_bytes
    buffers = [torch.zeros(buffer_bytes(world, SLOT_BYTES), dtype=torch.uint8).share_memory_()
               for _ in range(world)]
    total = sum(n for n, _ in CALLS)
    results = torch.zeros(world, total).share_memory_()
    # spawned: a forked child of a process that used torch's thread pool can hang in it
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, buffers, results, grid)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
    finally:   # a rank left waiting for a peer that failed would spin on
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    expected = []
    for call, (n, dtype) in enumerate(CALLS):
        acc = torch.zeros(n)
        for r in range(world):
            acc += partial(r, call, n, dtype).float()
        expected.append(acc.to(dtype).float())
    expected = torch.cat(expected)
    for r in range(world):
        assert torch.equal(results[r], expected), f"rank {r}"


@interp
def test_interp_abort_ends_a_wait_for_a_missing_peer():
    from nanovllm.kernels.all_reduce import PeerAllReduce, buffer_bytes
    buffers = [torch.zeros(buffer_bytes(2, SLOT_BYTES), dtype=torch.uint8) for _ in range(2)]
    ar = PeerAllReduce(0, [b.data_ptr() for b in buffers], torch.device("cpu"), slot_bytes=SLOT_BYTES, **GRID)
    threading.Timer(0.5, ar.abort).start()   # rank 1 never calls: only the abort ends the wait
    start = time.monotonic()
    ar(torch.ones(100, dtype=torch.bfloat16))
    assert time.monotonic() - start < 30


class _FakePeer:
    """Stands in for PeerAllReduce in the group: records what all_reduce hands it."""

    def __init__(self, limit: int):
        self.limit, self.seen, self.aborted = limit, [], False

    def fits(self, x):
        return x.numel() <= self.limit

    def __call__(self, x):
        self.seen.append(x.numel())
        return x.mul_(2)

    def abort(self):
        self.aborted = True


def test_all_reduce_uses_the_peer_kernel_for_sums_that_fit_and_the_backend_otherwise():
    calls = []

    class Backend:
        def allreduce(self, tensors, opts):
            calls.append((tensors[0].numel(), opts.reduceOp))

            class Work:
                def wait(self):
                    pass
            return Work()

    peer = _FakePeer(limit=10)
    group = TPGroup(0, 2, Backend(), store=None, peer=peer)
    with tp_group(group):
        assert torch.equal(all_reduce(torch.ones(4)), torch.full((4,), 2.0))   # the peer kernel
        all_reduce(torch.ones(11))                                              # too big: the backend
        all_reduce(torch.ones(4, dtype=torch.int64), torch.distributed.ReduceOp.MIN)   # not a sum
    assert peer.seen == [4]
    assert [n for n, _ in calls] == [11, 4]


def test_exchange_gives_every_rank_all_payloads_in_rank_order():
    """connect()'s handle exchange through the group's store: 3 ranks as threads, each its own group."""
    from nanovllm.parallel.parallel_state import exchange, master_store, worker_store
    master = master_store(3)
    got = {}

    def rank(r):
        group = TPGroup(r, 3, backend=None, store=worker_store(master.port, 3))
        with tp_group(group):
            got[r] = exchange("handles", bytes([r, 255, r]))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (2, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    expected = [bytes([r, 255, r]) for r in range(3)]
    assert got == {r: expected for r in range(3)}


class _FakeDriver:
    """Stands in for the CUDA driver calls of PeerAllReduce.connect: rank FAIL's allocation fails."""
    FAIL = None
    released = []

    def alloc(self, nbytes):
        if threading.current_thread().name == f"rank{self.FAIL}":
            raise RuntimeError("CUDA driver call cuMemAlloc_v2 failed with error 2")
        return 4096

    def zero(self, ptr, nbytes):
        pass

    def ipc_handle(self, ptr):
        return bytes(64)

    def ipc_open(self, handle):
        return 8192

    def release(self, own, opened):
        _FakeDriver.released.append((threading.current_thread().name, own, list(opened)))


@pytest.mark.parametrize("fail", [None, 0, 1])
def test_connect_fails_on_every_rank_when_one_rank_cannot_share_and_nobody_waits(monkeypatch, fail):
    """A rank whose buffer cannot be made still answers the exchange, so every rank raises at once
    (and frees what it made) instead of waiting for it; with no failure both connect."""
    from nanovllm.kernels import all_reduce
    from nanovllm.parallel.parallel_state import exchange, master_store, worker_store
    monkeypatch.setattr(all_reduce, "_Driver", _FakeDriver)
    monkeypatch.setattr(_FakeDriver, "FAIL", fail)
    monkeypatch.setattr(_FakeDriver, "released", [])
    master, outcome = master_store(2), {}

    def rank(r):
        group = TPGroup(r, 2, backend=None, store=worker_store(master.port, 2))
        with tp_group(group):
            try:
                peer = all_reduce.PeerAllReduce.connect(r, 2, torch.device("cpu"),
                                                        lambda b: exchange("buf", b))
                outcome[r] = peer.addrs.tolist()
            except RuntimeError as e:
                outcome[r] = str(e)

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    if fail is None:
        assert outcome == {0: [4096, 8192], 1: [8192, 4096]}
        return
    assert "cuMemAlloc_v2 failed" in outcome[fail]
    assert "another rank could not allocate" in outcome[1 - fail]
    assert (f"rank{1 - fail}", 4096, []) in _FakeDriver.released   # the other rank freed its buffer
