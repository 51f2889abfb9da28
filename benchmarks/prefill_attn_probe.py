"""Is there a faster prefill attention in torch than FlashAttention-2 on this GPU (CUDA only)?

bench.py's prefill steps hold about 16,384 prompt tokens of 100-1,024 each (Qwen3-0.6B: 16 query
heads, 8 KV heads, head_dim 128, bf16, causal). This times, per step shape, each CUDA graph-free
call (median of CUDA-event timings after warm-up, benchmarks/bench_timing.py):
  fa2           the engine's path: torch's FlashAttention-2 varlen op (kernels/flash_prefill.py)
  cudnn         torch's cuDNN attention op on the same varlen inputs, KV heads as given (GQA)
  cudnn+expand  the same with the KV heads repeated to the query heads first (the repeat timed too)
and checks each output against fa2's. Prints TFLOP/s of the causal attention's FLOPs. Then the
first call on each of 6 new step shapes (other lengths, totals and longest prompts), host wall time
with a synchronize: an op that plans per shape (cuDNN builds a graph) pays it at every new prefill.

    PYTHONPATH=. python benchmarks/prefill_attn_probe.py
"""
import argparse
import time

import torch
from bench_timing import median_ms

from nanovllm.kernels.flash_prefill import aten_flash_mode, aten_flash_varlen

H, HKV, D = 16, 8, 128


def step_lens(total: int, lo: int, hi: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lens = []
    while True:
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        if sum(lens) + n > total:
            return lens or [total]
        lens.append(n)


def step_inputs(lens: list[int]):
    """cu_seqlens and random bf16 q, k, v for prompts of these lengths."""
    n = sum(lens)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).int()
    q = torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16)
    return cu, q, k, v


def cudnn(q, k, v, cu, max_len, scale):
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, False, 0.0, True,
                                                   False, scale=scale)[0]


def make_variants(q, k, v, cu, max_len, scale):
    group = H // HKV
    return {
        "fa2": lambda: aten_flash_varlen(q, k, v, cu, cu, max_len, max_len, scale),
        "cudnn": lambda: cudnn(q, k, v, cu, max_len, scale),
        "cudnn+expand": lambda: cudnn(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                      cu, max_len, scale),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", nargs="+", default=["16384:100:1024", "16384:1024:1024", "16384:4096:4096",
                                                  "4096:100:1024"],
                   help="TOTAL:LO:HI: prompts of LO-HI tokens up to TOTAL tokens a step")
    args = p.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "cuDNN", torch.backends.cudnn.version(),
          "FA2 mode", aten_flash_mode(torch.device("cuda")))
    scale = D ** -0.5
    print(f"{'case':>18s} {'seqs':>5s} {'variant':>13s} {'ms':>8s} {'TFLOP/s':>8s} {'max |diff|':>10s}")
    for case in args.cases:
        total, lo, hi = map(int, case.split(":"))
        lens = step_lens(total, lo, hi, seed=0)
        cu, q, k, v = step_inputs(lens)
        flops = sum(2 * 2 * L * (L + 1) / 2 * H * D for L in lens)
        ref = aten_flash_varlen(q, k, v, cu, cu, max(lens), max(lens), scale)
        variants = make_variants(q, k, v, cu, max(lens), scale)
        for name, fn in variants.items():
            try:
                out = fn()
                torch.cuda.synchronize()
            except Exception as e:   # noqa: BLE001 - a variant this build lacks is reported, not fatal
                print(f"{case:>18s} {len(lens):5d} {name:>13s} failed: {type(e).__name__}: {str(e)[:100]}")
                continue
            diff = (out.float() - ref.float()).abs().max().item() if out.shape == ref.shape else float("nan")
            ms = median_ms(fn)
            print(f"{case:>18s} {len(lens):5d} {name:>13s} {ms:8.3f} {flops / ms / 1e9:8.1f} {diff:10.4f}")
    print("first call on a new step shape (ms, host wall with a synchronize):")
    for name in ("fa2", "cudnn", "cudnn+expand"):
        times = []
        for seed in range(1, 7):
            lens = step_lens(16384 - 37 * seed, 100, 1024 - 11 * seed, seed)
            cu, q, k, v = step_inputs(lens)
            if name == "cudnn+expand":   # repeated before the clock starts: the plan alone is timed
                k, v = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
            call = make_variants(q, k, v, cu, max(lens), scale)["fa2" if name == "fa2" else "cudnn"]
            torch.cuda.synchronize()
            t = time.perf_counter()
            try:
                call()
                torch.cuda.synchronize()
            except Exception as e:   # noqa: BLE001
                times.append(f"failed ({type(e).__name__})")
                break
            times.append(f"{(time.perf_counter() - t) * 1e3:.2f}")
        print(f"  {name:13s} " + " ".join(times))


if __name__ == "__main__":
    main()
