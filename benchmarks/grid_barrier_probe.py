"""What does a step between two dependent phases cost: a kernel boundary inside a CUDA graph, or a
grid-wide barrier inside one persistent kernel? The decode step's ~260 kernels each pay a boundary
(the next kernel's launch, ramp-up and the previous one's tail); a persistent kernel that ran a
whole layer would pay barriers instead. This measures both on tiny work, so the figure is the
synchronisation itself:

  launches:  a graph of R launches of a kernel of one program per SM, each program reading what its
             neighbour wrote in the launch before (so the launches are truly dependent);
  barrier:   one kernel of one program per SM running R rounds of the same work, a grid barrier
             between rounds (a counter: atomic add with release, then spin with acquire loads).

Every program must be resident at once for the barrier (one small program per SM is), and a spin
gives up after SPIN_LIMIT polls and flags it, so a mistake cannot hang the GPU.

    PYTHONPATH=. python benchmarks/grid_barrier_probe.py [--rounds 2000] [--warps 4]
"""
import argparse

import torch
import triton
import triton.language as tl

from bench_timing import graph_ms

SPIN_LIMIT = 1 << 22
BLOCK = 256   # values a program writes per round


@triton.jit
def _round(data_ptr, pid, nprog, r, BLOCK: tl.constexpr):
    """Read the neighbour's block of round r - 1, write this program's block of round r."""
    offs = tl.arange(0, BLOCK)
    prev = (r + 1) % 2
    x = tl.load(data_ptr + (prev * nprog + (pid + 1) % nprog) * BLOCK + offs)
    tl.store(data_ptr + ((r % 2) * nprog + pid) * BLOCK + offs, x + 1.0)


@triton.jit
def grid_barrier(counter_ptr, failed_ptr, target, SPIN_LIMIT: tl.constexpr):
    """Arrive at counter_ptr (after the whole program's stores), then wait until it reaches target
    (the programs times the barriers passed so far). Every program must be resident; a spin gives up
    after SPIN_LIMIT polls and sets failed_ptr."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < target) & (spins < SPIN_LIMIT):
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if spins >= SPIN_LIMIT:
        tl.store(failed_ptr, 1)
    tl.debug_barrier()


@triton.jit
def _step_kernel(data_ptr, r, BLOCK: tl.constexpr):
    _round(data_ptr, tl.program_id(0), tl.num_programs(0), r, BLOCK)


@triton.jit
def _persistent_kernel(data_ptr, counter_ptr, failed_ptr, ROUNDS: tl.constexpr, BLOCK: tl.constexpr,
                       SPIN_LIMIT: tl.constexpr):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    for r in range(ROUNDS):
        _round(data_ptr, pid, nprog, r, BLOCK)
        grid_barrier(counter_ptr, failed_ptr, (r + 1) * nprog, SPIN_LIMIT)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--warps", type=int, default=4)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    data = torch.zeros(2 * sms * BLOCK, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    failed = torch.zeros(1, dtype=torch.int32, device="cuda")
    rounds = args.rounds

    def launches():
        for r in range(rounds):
            _step_kernel[(sms,)](data, r, BLOCK=BLOCK, num_warps=args.warps)

    def persistent():
        counter.zero_()
        _persistent_kernel[(sms,)](data, counter, failed, ROUNDS=rounds, BLOCK=BLOCK, SPIN_LIMIT=SPIN_LIMIT,
                                   num_warps=args.warps)

    results = {}
    for name, fn in (("launches", launches), ("barrier", persistent)):
        data.zero_()
        fn()
        torch.cuda.synchronize()
        if name == "barrier":
            # after R rounds every value is R (each round adds one to the neighbour's previous value)
            if int(failed.item()) or float(data.view(2, sms, BLOCK)[(rounds - 1) % 2].min()) != rounds:
                raise SystemExit("the barrier kernel gave up spinning or lost an update: no figure")
        results[name] = graph_ms(fn, calls=1, timings=15) * 1e3 / rounds
    print(f"{torch.cuda.get_device_name()}  triton {triton.__version__}  {sms} programs x {args.warps} "
          f"warps, {rounds} rounds")
    print(f"a kernel boundary in a graph: {results['launches']:.2f} us; "
          f"a grid barrier: {results['barrier']:.2f} us")


if __name__ == "__main__":
    main()
