"""The GPU timing the benchmark scripts share: CUDA events around back-to-back calls, medians."""
import statistics

import torch


def median_ms(fn, calls: int = 10, timings: int = 25, warmup: int = 3) -> float:
    """Median over `timings` of the mean time in ms of `calls` back-to-back calls of fn (CUDA events
    on the current stream), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(timings):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)
