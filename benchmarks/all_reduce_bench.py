"""All-reduce on two (or more) GPUs, one process each: NCCL against the peer-memory kernel
(nanovllm/kernels/all_reduce.py) at decode sizes, each inside a CUDA graph of CALLS calls (as the
engine replays them), median microseconds a call over several replays. Every size is also checked:
the kernel's sum, eager and replayed in a CUDA graph, must equal the rank-ordered fp32 sum of the
partials rounded once, and NCCL's, bit for bit.

  PYTHONPATH=. python benchmarks/all_reduce_bench.py [--rows 8 64 256 512 2048] [--hidden 4096]
  PYTHONPATH=. python benchmarks/all_reduce_bench.py --check   # sums only, then an abort: exits 0 if right
  PYTHONPATH=. python benchmarks/all_reduce_bench.py --check --same-gpu   # both ranks on GPU 0

--check is tests/test_tp_gpu.py's test: besides the sums it leaves rank 0 alone in a call (rank 1
never joins it) and sets the abort word from another thread, as abort_tp_group does when a peer
dies: the kernel must end within seconds."""
import argparse
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm.kernels.all_reduce import PeerAllReduce  # noqa: E402
from nanovllm.utils.distributed import (TPGroup, connect_peer_all_reduce, exchange, init_tp_group,  # noqa: E402
                                        master_store, tp_group, worker_store)

CALLS = 50     # all-reduces in one graph
REPLAYS = 20   # timed replays (after 3 warm-ups)


def nccl_sum(group, x):
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    group.backend.allreduce([x], opts).wait()
    return x


def per_call_us(fn, x) -> float:
    graph = torch.cuda.CUDAGraph()
    buf = x.clone()
    fn(buf)   # first use (NCCL sets up its communicator) outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn(buf.mul_(0.5))   # the sum doubles buf: keep it bounded
    times = []
    for i in range(REPLAYS + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1000 / CALLS)
    graph.reset()
    return statistics.median(times)


def partial(rows, hidden, rank, device):
    g = torch.Generator(device).manual_seed(rows * 10 + rank)
    return torch.randn(rows, hidden, generator=g, device=device).to(torch.bfloat16)


def expected_sum(rows, hidden, world, device):
    """The rank-ordered fp32 sum of every rank's partial, rounded once (what NCCL gives at 2 ranks)."""
    acc = torch.zeros(rows, hidden, device=device)
    for r in range(world):
        acc += partial(rows, hidden, r, device).float()
    return acc.to(torch.bfloat16)


def rank_main(rank, world, port, rows_list, hidden, check, same_gpu, results):
    device = torch.device("cuda", 0 if same_gpu else rank)
    torch.cuda.set_device(device)
    store = worker_store(port, world)
    if same_gpu:   # no NCCL (it refuses two ranks on one GPU): a group that only has the store
        group = TPGroup(rank, world, backend=None, store=store)
        with tp_group(group):
            group.peer = PeerAllReduce.connect(rank, world, device, lambda b: exchange("peer_buffer", b))
    else:
        group = init_tp_group(store, rank, world, device)
        with tp_group(group):
            connect_peer_all_reduce(device)
    peer = group.peer
    assert peer is not None, "no peer access between these GPUs"
    for rows in rows_list:
        x = partial(rows, hidden, rank, device)
        if not peer.fits(x):
            if not check:
                results.put((rows, x.numel() * x.element_size(), per_call_us(lambda t: nccl_sum(group, t), x),
                             float("nan")))
            continue
        expected = expected_sum(rows, hidden, world, device)
        got = [peer(x.clone())]
        # in a CUDA graph too, replayed twice: 3 calls on one buffer, reset to the partial before each
        buf = x.clone()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for _ in range(3):
                peer(buf.copy_(x))
        for _ in range(2):
            graph.replay()
            torch.cuda.synchronize()
            got.append(buf.clone())
        graph.reset()
        if not same_gpu:
            got.append(nccl_sum(group, x.clone()))
        torch.cuda.synchronize()
        if not all(torch.equal(g, expected) for g in got):
            raise SystemExit(f"rank {rank}: {rows} x {hidden}: a sum differs from the rank-ordered one "
                             f"(eager, graph replays{'' if same_gpu else ', NCCL'}): "
                             f"{[torch.equal(g, expected) for g in got]}")
        if not check:
            results.put((rows, x.numel() * x.element_size(), per_call_us(lambda t: nccl_sum(group, t), x),
                         per_call_us(peer, x)))
    if check:
        x = torch.ones(1024, dtype=torch.bfloat16, device=device)
        if rank == 0:   # alone in this call: only the abort ends it
            threading.Timer(1.0, peer.abort).start()
            start = time.monotonic()
            peer(x)
            torch.cuda.synchronize()
            seconds = time.monotonic() - start
            if seconds > 10:
                raise SystemExit(f"the abort took {seconds:.1f} s")
            results.put(("abort", seconds))
    results.close()
    results.join_thread()   # what this rank put is sent before the exit below
    os._exit(0)   # no collective teardown: the group is broken after the abort


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256, 512, 2048])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--check", action="store_true", help="check the sums and the abort, no timing")
    p.add_argument("--same-gpu", action="store_true",
                   help="every rank on GPU 0 (a one-GPU machine: checks only, the ranks time-slice the GPU)")
    args = p.parse_args()
    store = master_store(args.world)   # the ranks rendezvous through it
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    options = (args.rows, args.hidden, args.check, args.same_gpu, results)
    procs = [ctx.Process(target=rank_main, args=(r, args.world, store.port, *options))
             for r in range(args.world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(240)
    codes = [proc.exitcode for proc in procs]
    if any(code != 0 for code in codes):
        for proc in procs:
            proc.kill()
        sys.exit(f"a rank failed: exit codes {codes}")
    if args.same_gpu and not args.check:
        sys.exit("--same-gpu checks only (add --check): two processes on one GPU take turns, no timing")
    if args.check:
        also = "" if args.same_gpu else " and NCCL's"
        print(f"sums equal the rank-ordered sum{also} for rows {args.rows} x {args.hidden}; "
              f"abort ended the wait in {results.get(timeout=5)[1]:.2f} s")
        return
    print(f"{'rows':>6} {'bytes':>10} {'NCCL us':>9} {'peer us':>9} {'speed-up':>8}")
    for _ in args.rows:
        rows, nbytes, nccl, mine = results.get(timeout=5)
        print(f"{rows:>6} {nbytes:>10,} {nccl:>9.1f} {mine:>9.1f} {nccl / mine:>8.2f}")


if __name__ == "__main__":
    main()
