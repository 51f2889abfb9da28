"""Decode attention: FlashAttention-4 with one query per sequence over the paged cache against the
project's Triton paged decode kernel, at Qwen3-0.6B's attention shapes (16 query / 8 KV heads,
head_dim 128, bf16, block 256), batch 1-256 x context 128-8,192. Median of CUDA-event timings after
a warm-up. (FA4 has no split-KV on sm90, so on Hopper it runs one CTA per sequence and head group.)

    PYTHONPATH=. python benchmarks/fa4_decode.py [--json out.json]

Needs the flash-attn-4 package (benchmarks/fa4_gpu.sh installs it on the GPU machine)."""
import argparse
import json
import statistics

import torch
from flash_attn.cute import flash_attn_varlen_func

from nanovllm.kernels import paged_decode_attention

H, HKV, D = 16, 8, 128
SCALE = D ** -0.5
BATCHES = (1, 16, 64, 256)
CONTEXTS = (128, 1024, 4096, 8192)


def median_ms(fn, warmup: int = 5, reps: int = 30) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def paged_case(batch: int, context: int, block_size: int):
    """Every sequence holds `context` tokens in its own shuffled blocks."""
    blocks = -(-context // block_size)
    num_blocks = batch * blocks
    k_cache = torch.randn(num_blocks, block_size, HKV, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device="cuda").int().view(batch, blocks)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
    return q, k_cache, v_cache, tables, context_lens


def fa4_decode(q, k_cache, v_cache, tables, context_lens):
    # q: [batch, num_heads, head_dim] -> one query per sequence: [batch, 1, num_heads, head_dim]
    out, _ = flash_attn_varlen_func(q.unsqueeze(1), k_cache, v_cache, seqused_k=context_lens,
                                    page_table=tables, softmax_scale=SCALE, causal=True)
    return out.squeeze(1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}; {H} query / {HKV} KV heads, head_dim {D}, bf16, "
          f"block {args.block_size}")
    print(f"{'batch':>6} {'context':>8} {'triton ms':>10} {'fa4 ms':>10} {'fa4 speed-up':>13} {'max |diff|':>11}")
    rows = []
    for batch in BATCHES:
        for context in CONTEXTS:
            case = paged_case(batch, context, args.block_size)
            ours = paged_decode_attention(*case, SCALE)
            theirs = fa4_decode(*case)
            diff = (ours.float() - theirs.float()).abs().max().item()
            triton_ms = median_ms(lambda: paged_decode_attention(*case, SCALE))
            fa4_ms = median_ms(lambda: fa4_decode(*case))
            rows.append(dict(batch=batch, context=context, triton_ms=round(triton_ms, 4),
                             fa4_ms=round(fa4_ms, 4), max_abs_diff=diff))
            print(f"{batch:>6} {context:>8} {triton_ms:>10.4f} {fa4_ms:>10.4f} {triton_ms / fa4_ms:>12.2f}x "
                  f"{diff:>11.2e}")
            del case
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
