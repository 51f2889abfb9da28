"""Prefill GEMMs of a 16,384-token chunk at Qwen3-8B's and 0.6B's shapes: TFLOP/s of cuBLAS as the
engine calls it (F.linear), of the same product split into column halves or row halves, and the SM
clock while each runs (nvidia-smi, sampled in a thread). The 8B run's profile put gate_up at about
600 TFLOP/s and the other prefill GEMMs at 800-850: is it the shape (cuBLAS's choice) or power?

    PYTHONPATH=. python benchmarks/prefill_gemm_probe.py
"""
import statistics
import subprocess
import threading
import time

import torch
import torch.nn.functional as F

M = 16384
SHAPES = {  # name: (K, N)
    "8b qkv": (4096, 6144), "8b o": (4096, 4096), "8b gate_up": (4096, 24576), "8b down": (12288, 4096),
    "0.6b gate_up": (1024, 6144), "0.6b qkv": (1024, 4096),
}


class ClockSampler:
    def __init__(self):
        self.samples, self.running = [], True
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while self.running:
            query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]
            out = subprocess.run(query, capture_output=True, text=True).stdout.split(",")
            if len(out) == 2:
                self.samples.append((float(out[0]), float(out[1])))
            time.sleep(0.05)

    def take(self):
        s, self.samples = self.samples, []
        return s

    def stop(self):
        self.running = False
        self.thread.join()


def timed(fn, seconds=1.5):
    """Median ms of fn over about `seconds` of back-to-back calls, after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times, end = [], time.time() + seconds
    while time.time() < end:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def variants(x, w, out):
    n, half = w.shape[0], x.shape[0] // 2
    return {
        "F.linear": lambda: F.linear(x, w),
        "N halves": lambda: [torch.mm(x, h.t()) for h in (w[: n // 2], w[n // 2:])],
        "M halves": lambda: [F.linear(x[i * half:(i + 1) * half], w) for i in range(2)],
        "mm out=": lambda: torch.mm(x, w.t(), out=out),
    }


def main():
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  M = {M}")
    clocks = ClockSampler()
    print(f"{'shape':14s} {'variant':10s} {'ms':>8} {'TFLOP/s':>8} {'SM MHz':>8} {'W':>6}")
    for name, (k, n) in SHAPES.items():
        x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        out = torch.empty(M, n, device="cuda", dtype=torch.bfloat16)
        for vname, fn in variants(x, w, out).items():
            clocks.take()
            ms = timed(fn)
            s = clocks.take()
            mhz = statistics.median(c for c, _ in s) if s else float("nan")
            watts = statistics.median(p for _, p in s) if s else float("nan")
            print(f"{name:14s} {vname:10s} {ms:8.3f} {2 * M * k * n / ms / 1e9:8.1f} {mhz:8.0f} {watts:6.0f}")
    clocks.stop()


if __name__ == "__main__":
    main()
