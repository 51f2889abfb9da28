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


def graph_ms(fn, calls: int = 10, timings: int = 25, warmup: int = 3) -> float:
    """Median ms per call of fn, `calls` calls recorded in one CUDA graph (fn runs once before the
    capture, to compile its kernels and allocate), the graph timed by median_ms."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_ms(graph.replay, calls=1, timings=timings, warmup=warmup) / calls
