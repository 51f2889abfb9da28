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
import itertools
import os
import statistics
import sys
import threading
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm.kernels.all_reduce import BLOCK, PROGRAMS, PeerAllReduce  # noqa: E402
from nanovllm.parallel.parallel_state import (TPGroup, all_reduce, exchange, init_tp_group,  # noqa: E402
                                        master_store, tp_group, worker_store)

CALLS = 50     # all-reduces in one graph
REPLAYS = 20   # timed replays (after 3 warm-ups)


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


def check_sums(peer, group, x, expected, same_gpu, what):
    """The kernel's sum, eager and in a CUDA graph replayed twice (3 calls a replay on one buffer,
    reset to the partial before each), and NCCL's, must all be `expected`, bit for bit."""
    got = [peer(x.clone())]
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
        got.append(all_reduce(x.clone()))   # NCCL: the group has no peer kernel
    torch.cuda.synchronize()
    if not all(torch.equal(g, expected) for g in got):
        equal = [torch.equal(g, expected) for g in got]
        raise SystemExit(f"rank {group.rank}: {what}: a sum differs from the rank-ordered one (eager, two "
                         f"graph replays{'' if same_gpu else ', NCCL'}): {equal}")


def partial_exchange(name):
    return lambda payload: exchange(name, payload)


def rank_main(rank, world, port, args, results):
    device = torch.device("cuda", 0 if args.same_gpu else rank)
    torch.cuda.set_device(device)
    store = worker_store(port, world)
    # same GPU: no NCCL (it refuses two ranks on one GPU), a group that only has the store
    group = (TPGroup(rank, world, backend=None, store=store) if args.same_gpu
             else init_tp_group(store, rank, world, device))
    nccl_us = {}
    with tp_group(group):
        for config, (programs, block) in enumerate(itertools.product(args.programs, args.block)):
            peer = PeerAllReduce.connect(rank, world, device, partial_exchange(f"buffer{config}_"),
                                         programs=programs, block=block)
            peer.max_bytes = 1 << 40   # larger tensors too, in slot-sized chunks
            for rows in args.rows:
                x = partial(rows, args.hidden, rank, device)
                expected = expected_sum(rows, args.hidden, world, device)
                check_sums(peer, group, x, expected, args.same_gpu,
                           f"{rows} x {args.hidden}, {programs} programs x {block}")
                if args.check:
                    continue
                if rows not in nccl_us:
                    nccl_us[rows] = per_call_us(all_reduce, x)
                if rank == 0:
                    results.put((programs, block, rows, x.numel() * x.element_size(), nccl_us[rows],
                                 per_call_us(peer, x)))
        if args.check:
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
    p.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256, 512, 2048, 16384])
    p.add_argument("--programs", type=int, nargs="+", default=[PROGRAMS], help="grids to try")
    p.add_argument("--block", type=int, nargs="+", default=[BLOCK], help="elements a program moves per step")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--check", action="store_true", help="check the sums and the abort, no timing")
    p.add_argument("--same-gpu", action="store_true",
                   help="every rank on GPU 0 (a one-GPU machine: checks only, the ranks time-slice the GPU)")
    args = p.parse_args()
    if args.same_gpu and not args.check:
        p.error("--same-gpu checks only (add --check): two processes on one GPU take turns, no timing")
    store = master_store(args.world)   # the ranks rendezvous through it
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.world, store.port, args, results))
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
    if args.check:
        also = "" if args.same_gpu else " and NCCL's"
        print(f"sums equal the rank-ordered sum{also} for rows {args.rows} x {args.hidden}; "
              f"abort ended the wait in {results.get(timeout=5)[1]:.2f} s")
        return
    print(f"{'programs':>8} {'block':>6} {'rows':>6} {'bytes':>11} {'NCCL us':>9} {'peer us':>9} "
          f"{'speed-up':>8}")
    for _ in range(len(args.programs) * len(args.block) * len(args.rows)):
        programs, block, rows, nbytes, nccl, mine = results.get(timeout=5)
        print(f"{programs:>8} {block:>6} {rows:>6} {nbytes:>11,} {nccl:>9.1f} {mine:>9.1f} "
              f"{nccl / mine:>8.2f}")


if __name__ == "__main__":
    main()
