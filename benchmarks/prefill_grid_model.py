"""A model of the Triton prefill kernel's grid on the long workload's prefill steps (CPU only): 132 SMs,
one program (CTA) each at a time, each program taken by the next free SM in launch order; a program
costs C0 + its key tiles (the prefix's, then its new keys' up to the diagonal), in tile-iterations.
Compares today's order (the last query tiles first, by tile index) with the programs sorted by their
work, and with perfect balance. The steps: the prompts packed in order into 16,384-token steps, the
last one of a step continued (after its prefix) in the next.

    python benchmarks/prefill_grid_model.py [C0]
"""
import heapq
import math
import sys

from bench import long_workload

BUDGET, BLOCK, HEADS, SMS = 16384, 128, 16, 132


def prefill_steps(lens: list[int]) -> list[list[tuple[int, int]]]:
    """Each step's (prefix, new tokens) per sequence."""
    steps, cur, room, i, done = [], [], BUDGET, 0, 0
    while i < len(lens):
        take = min(room, lens[i] - done)
        cur.append((done, take))
        room, done = room - take, done + take
        if done == lens[i]:
            i, done = i + 1, 0
        if room == 0 or i == len(lens):
            steps.append(cur)
            cur, room = [], BUDGET
    return steps


def launch_order(step: list[tuple[int, int]], c0: float) -> list[float]:
    """Each program's cost in the kernel's launch order: query tiles from the last, then sequences,
    then heads; a tile past a sequence's end exits at once."""
    tiles = max(math.ceil(n / BLOCK) for _, n in step)
    costs = []
    for z in range(tiles):
        m = tiles - 1 - z
        for prefix, n in step:
            cost = c0 + math.ceil(prefix / BLOCK) + m + 1 if m * BLOCK < n else 0.02
            costs += [cost] * HEADS
    return costs


def makespan(costs: list[float]) -> float:
    free = [0.0] * SMS
    for cost in costs:
        heapq.heappush(free, heapq.heappop(free) + cost)
    return max(free)


def main():
    c0 = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    prompts, _ = long_workload(256, 0.6)
    steps = prefill_steps([len(p) for p in prompts])
    now = by_work = ideal = 0.0
    for step in steps:
        costs = launch_order(step, c0)
        now += makespan(costs)
        by_work += makespan(sorted(costs, reverse=True))
        ideal += sum(costs) / SMS
    print(f"{len(steps)} prefill steps, C0 = {c0}: launch order {now:.0f} tile-iterations, sorted by work "
          f"{by_work:.0f} ({now / by_work:.3f}x), perfect balance {ideal:.0f} ({now / ideal:.3f}x)")


if __name__ == "__main__":
    main()
