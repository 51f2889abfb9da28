"""Decode attention: FlashAttention-4 with one query per sequence over the paged cache against the
project's Triton paged decode kernel, at Qwen3-0.6B's attention shapes (16 query / 8 KV heads,
head_dim 128, bf16, block 256), batch 1-256 x context 128-8,192. Median of CUDA-event timings after
a warm-up. (FA4 has no split-KV on sm90, so on Hopper it runs one CTA per sequence and head group.)

    PYTHONPATH=. python benchmarks/fa4_decode.py [--prefill] [--json out.json]

--prefill also times prefill (8 sequences; no prefix, and a chunk after a cached prefix) through
FA4 over the pages against today's path (gather + torch's FlashAttention-2).

Needs the flash-attn-4 package (benchmarks/fa4_gpu.sh installs it on the GPU machine)."""
import argparse
import json

import torch
from flash_attn.cute import flash_attn_varlen_func

from bench_timing import median_ms
from nanovllm.kernels import paged_decode_attention, paged_kv_slots, prefill_attention
from nanovllm.kernels.fa4_prefill import prefill_attention_fa4

H, HKV, D = 16, 8, 128
SCALE = D ** -0.5
BATCHES = (1, 16, 64, 256)
CONTEXTS = (128, 1024, 4096, 8192)
ONE_CALL = dict(calls=1, timings=30, warmup=5)   # each timing one call, median of 30


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


def time_shape(batch: int, context: int, block_size: int) -> dict:
    case = paged_case(batch, context, block_size)
    diff = (paged_decode_attention(*case, SCALE).float() - fa4_decode(*case).float()).abs().max().item()
    triton_ms = median_ms(lambda: paged_decode_attention(*case, SCALE), **ONE_CALL)
    fa4_ms = median_ms(lambda: fa4_decode(*case), **ONE_CALL)
    return dict(batch=batch, context=context, triton_ms=round(triton_ms, 4), fa4_ms=round(fa4_ms, 4),
                max_abs_diff=diff)


def prefill_args(q_len: int, prefix: int, num_seqs: int, block_size: int):
    """num_seqs sequences of q_len new tokens after `prefix` cached ones (prefix 0: no block tables)."""
    k_len = prefix + q_len
    _, k_cache, v_cache, tables, _ = paged_case(num_seqs, k_len, block_size)
    q = torch.randn(num_seqs * q_len, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(num_seqs * q_len, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu_q = torch.arange(0, (num_seqs + 1) * q_len, q_len, device="cuda", dtype=torch.int32)
    cu_k = torch.arange(0, (num_seqs + 1) * k_len, k_len, device="cuda", dtype=torch.int32)
    if not prefix:
        return (q, k, v, k_cache, v_cache, cu_q, cu_k, q_len, k_len, None, SCALE)
    # the runner computes the gather's slots once per step, not per layer: so here, outside the timing
    slots = paged_kv_slots(tables, cu_k, num_seqs * k_len, block_size)
    return (q, k, v, k_cache, v_cache, cu_q, cu_k, q_len, k_len, tables, SCALE, slots)


def time_prefill(block_size: int):
    print(f"{'prefill: seqs':>14} {'new':>6} {'prefix':>7} {'today ms':>9} {'fa4 ms':>8} "
          f"{'fa4 speed-up':>13}")
    rows = []
    for num_seqs, q_len, prefix in ((8, 4096, 0), (8, 2048, 6144), (1, 16384, 16384)):
        args = prefill_args(q_len, prefix, num_seqs, block_size)
        today_ms = median_ms(lambda a=args: prefill_attention(*a), **ONE_CALL)
        fa4_ms = median_ms(lambda a=args: prefill_attention_fa4(*a), **ONE_CALL)
        rows.append(dict(num_seqs=num_seqs, new=q_len, prefix=prefix, today_ms=round(today_ms, 4),
                         fa4_ms=round(fa4_ms, 4)))
        print(f"{num_seqs:>14} {q_len:>6} {prefix:>7} {today_ms:>9.3f} {fa4_ms:>8.3f} "
              f"{today_ms / fa4_ms:>12.2f}x")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--prefill", action="store_true", help="also time prefill, FA4 against today's path")
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}; {H} query / {HKV} KV heads, head_dim {D}, bf16, "
          f"block {args.block_size}")
    print(f"{'batch':>6} {'context':>8} {'triton ms':>10} {'fa4 ms':>10} {'fa4 speed-up':>13} "
          f"{'max |diff|':>11}")
    rows = []
    for batch in BATCHES:
        for context in CONTEXTS:
            rows.append(time_shape(batch, context, args.block_size))
            r = rows[-1]
            print(f"{batch:>6} {context:>8} {r['triton_ms']:>10.4f} {r['fa4_ms']:>10.4f} "
                  f"{r['triton_ms'] / r['fa4_ms']:>12.2f}x {r['max_abs_diff']:>11.2e}")
            torch.cuda.empty_cache()
    if args.prefill:
        rows += time_prefill(args.block_size)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
