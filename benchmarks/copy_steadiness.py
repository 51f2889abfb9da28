"""How steady roofline.measure_copy_bandwidth is, the figure bench.py's "fraction of the limit"
divides by: in one process, repeated measurements idle, after a second of GEMM load, and with the
copy itself warmed up for a time first; 1 GiB and 4 GiB buffers; median and best of the repeats.

    PYTHONPATH=. python benchmarks/copy_steadiness.py
"""
import statistics
import time

import torch

from nanovllm.utils import roofline


def copies(nbytes, repeats):
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return [2 * nbytes / t / 1e12 for t in times]


def load(seconds):
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            x @ x
        torch.cuda.synchronize()


def main():
    print("TB/s, read + written")
    print("as bench.py measures, idle GPU:",
          " ".join(f"{roofline.measure_copy_bandwidth(nbytes=1 << 30) / 1e12:.3f}" for _ in range(5)))
    load(1.0)
    print("as bench.py measures, after 1 s of GEMMs:",
          " ".join(f"{roofline.measure_copy_bandwidth(nbytes=1 << 30) / 1e12:.3f}" for _ in range(5)))
    for nbytes in (1 << 30, 4 << 30):
        v = copies(nbytes, 200)
        print(f"{nbytes >> 30} GiB x 200 copies: first 5 {' '.join(f'{x:.3f}' for x in v[:5])}; "
              f"median of all {statistics.median(v):.3f}, of the last 100 {statistics.median(v[100:]):.3f}, "
              f"best {max(v):.3f}, spread of the last 100 {min(v[100:]):.3f}-{max(v[100:]):.3f}")


if __name__ == "__main__":
    main()
