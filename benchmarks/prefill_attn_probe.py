"""Prefill attention kernels on this GPU, per step shape (CUDA only): the Triton kernel
(kernels/triton_prefill.py) at several tiles against torch's FlashAttention-2 varlen op as the engine
calls it (kernels/flash_prefill.py, the gather of the pages included when there is a cached prefix).
Prints ms and TFLOP/s of the causal attention's FLOPs, and each output's largest difference from
FlashAttention-2's.

    PYTHONPATH=. python benchmarks/prefill_attn_probe.py [--tiles 128:64:8:3 128:64:8:3:ld ...]

A tile ending in :ld loads keys and values with plain loads, :tma through tensor descriptors; without
either suffix the kernel chooses (descriptors on Hopper).
"""
import argparse
import random

import torch
from bench_kernels import median_ms

from nanovllm.kernels.backend import paged_kv_slots
from nanovllm.kernels.flash_prefill import prefill_attention_aten
from nanovllm.kernels.triton_prefill import TILES_128, prefill_attention_triton

PAGE = 256
# name: (num_heads, num_kv_heads, [(prefix, new tokens) per sequence])
random.seed(0)
CASES = {
    "long: 3 new prompts": (16, 8, [(0, 5000), (0, 6000), (0, 5384)]),
    "long: chunks after prefixes": (16, 8, [(3000, 2500), (0, 7000), (5120, 2880), (0, 3984)]),
    "bench: 0.6B, 100-1024": (16, 8, [(0, random.randint(100, 1024)) for _ in range(30)]),
    "bench: 8B, 100-1024": (32, 8, [(0, random.randint(100, 1024)) for _ in range(30)]),
    "32k: second chunk": (16, 8, [(16384, 16384)]),
}
DEFAULT_TILES = ["128:128:8:3:ld", "128:128:8:3:tma", "128:128:8:2:tma", "128:64:8:3:tma", "128:64:4:3:tma",
                 "64:64:4:3:ld", "64:64:4:3:tma", "64:128:4:3:tma"]


def make_inputs(num_heads, num_kv_heads, seqs, head_dim=128):
    """Random bf16 queries, a paged cache holding every sequence's keys (prefix and new), and the new
    tokens' k, v beside it (as in the engine: the Triton kernel reads earlier keys from the pages,
    new ones from k, v)."""
    dev, dt = "cuda", torch.bfloat16
    q_lens = [n for _, n in seqs]
    k_lens = [p + n for p, n in seqs]
    blocks = [-(-k // PAGE) for k in k_lens]
    k_cache = torch.randn(sum(blocks), PAGE, num_kv_heads, head_dim, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    table = torch.full((len(seqs), max(blocks)), -1, dtype=torch.int32, device=dev)
    perm = torch.randperm(sum(blocks), device=dev).int()
    at = 0
    for i, b in enumerate(blocks):
        table[i, :b] = perm[at:at + b]
        at += b
    cu_q = torch.tensor([0] + q_lens, device=dev).cumsum(0).int()
    cu_k = torch.tensor([0] + k_lens, device=dev).cumsum(0).int()
    q = torch.randn(sum(q_lens), num_heads, head_dim, device=dev, dtype=dt)
    paged = any(p for p, _ in seqs)
    kv_slots = paged_kv_slots(table, cu_k, sum(k_lens), PAGE) if paged else None
    # the new tokens' K/V (what the engine's store kernel hands over beside the cache): their cache rows
    slots = paged_kv_slots(table, cu_k, sum(k_lens), PAGE)
    starts = cu_k[:-1].tolist()
    new = slots[torch.cat([torch.arange(at + p, at + p + n) for (p, n), at in zip(seqs, starts)]).to(dev)]
    k = k_cache.view(-1, num_kv_heads, head_dim)[new]
    v = v_cache.view(-1, num_kv_heads, head_dim)[new]
    args = (q, k, v, k_cache, v_cache, cu_q, cu_k, max(q_lens), max(k_lens), table if paged else None,
            head_dim ** -0.5)
    flops = sum(4 * head_dim * num_heads * (n * p + n * (n + 1) / 2) for p, n in seqs)
    return args, kv_slots, flops


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tiles", nargs="+", default=DEFAULT_TILES, help="BLOCK_M:BLOCK_N:num_warps:num_stages")
    args = p.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "engine tiles (head_dim 128):", TILES_128)
    print(f"{'case':>28s} {'kernel':>22s} {'ms':>8s} {'TFLOP/s':>8s} {'max diff':>9s}")
    for name, (heads, kv_heads, seqs) in CASES.items():
        call_args, kv_slots, flops = make_inputs(heads, kv_heads, seqs)
        ref = prefill_attention_aten(*call_args, kv_slots)
        variants = {"fa2 (+gather)": lambda a=call_args, s=kv_slots: prefill_attention_aten(*a, s)}
        for t in args.tiles:
            parts = t.split(":")
            tma = {"tma": True, "ld": False}.get(parts[-1]) if len(parts) == 5 else None
            tiles = tuple(int(x) for x in parts[:4])
            variants[f"triton {t}"] = (lambda a=call_args, t=tiles, m=tma:
                                       prefill_attention_triton(*a, tiles=t, tma=m))
        for label, fn in variants.items():
            try:
                out = fn()
                torch.cuda.synchronize()
                diff = (out.float() - ref.float()).abs().max().item()
                ms = median_ms(fn, calls=3, timings=7, warmup=2)
            except Exception as e:   # noqa: BLE001 - a tile this GPU cannot run is reported, not fatal
                print(f"{name:>28s} {label:>22s} failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            print(f"{name:>28s} {label:>22s} {ms:8.3f} {flops / ms / 1e9:8.1f} {diff:9.4f}")


if __name__ == "__main__":
    main()
