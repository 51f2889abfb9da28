"""The router's choice and the sort of (token, expert) pairs by expert, in Triton, for the fused MoE
GEMMs of kernels/fused_moe.py. No count is read on the host: CUDA-graph safe."""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

import nanovllm.envs as envs

# Up to this many pairs (decode: 512 tokens x top 8), sort them in one program (one launch) rather than
# two fills and three kernels (30B-A3B FP8 shapes, H100: 6,809 and 6,829 tok/s against 6,752 and 6,754
# with 0, a variant compiled per power-of-two pair count). NANOVLLM_MOE_ONE_PROGRAM_MAX_PAIRS (0: off).
ONE_PROGRAM_MAX_PAIRS = envs.MOE_ONE_PROGRAM_MAX_PAIRS.get()

# ---- the router's choice -----------------------------------------------------------------------

@triton.jit(do_not_specialize=["num_tokens"])
def _select_experts_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, logits_stride,
                           NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                           BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    # ROWS tokens a program: softmax in fp32, top_k by repeated max (the lowest index wins a tie, as
    # in torch.topk), optional renormalisation, weights rounded to the logits' dtype.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    e = tl.arange(0, BLOCK_E)[None, :]
    row_ok = rows < num_tokens
    logits = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * logits_stride + e,
                     mask=row_ok[:, None] & (e < NUM_EXPERTS), other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    k = tl.arange(0, BLOCK_K)[None, :]
    top_w = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([ROWS, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 1)[:, None]
        index = tl.min(tl.where(p == best, e, BLOCK_E), 1)[:, None]
        top_w = tl.where(k == j, best, top_w)
        top_i = tl.where(k == j, index, top_i)
        p = tl.where(e == index, -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 1)[:, None]
    out = rows.to(tl.int64)[:, None] * TOP_K + k
    out_ok = row_ok[:, None] & (k < TOP_K)
    tl.store(weights_ptr + out, top_w.to(weights_ptr.dtype.element_ty), mask=out_ok)
    tl.store(ids_ptr + out, top_i, mask=out_ok)


def select_experts_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """kernels/moe_reference.select_experts in one kernel: router_logits: [num_tokens, num_experts]
    -> (weights: [num_tokens, top_k] in the logits' dtype, ids: [num_tokens, top_k] int32)."""
    num_tokens, num_experts = router_logits.shape
    assert router_logits.stride(1) == 1
    weights = torch.empty(num_tokens, top_k, dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        block_e = triton.next_power_of_2(num_experts)
        rows = max(1, 2048 // block_e)
        _select_experts_kernel[(triton.cdiv(num_tokens, rows),)](
            router_logits, weights, ids, num_tokens, router_logits.stride(0), NUM_EXPERTS=num_experts,
            TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
            ROWS=rows, num_warps=4)
    return weights, ids


# ---- sorting pairs by expert -------------------------------------------------------------------

@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(ids_ptr, counts_ptr, ranks_ptr, num_pairs, BLOCK: tl.constexpr):
    # Each pair's rank among its expert's pairs (in no particular order: only the blocks' sums,
    # never their order, reach the output).
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=mask, other=0)
    rank = tl.atomic_add(counts_ptr + expert, tl.full([BLOCK], 1, tl.int32), mask=mask)
    tl.store(ranks_ptr + offs, rank, mask=mask)


@triton.jit
def _block_layout(counts_ptr, starts_ptr, block_expert_ptr, num_padded_ptr, num_blocks,
                  NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                  CHUNK: tl.constexpr):
    # Expert e's pairs occupy rows [starts[e], starts[e] + counts[e]) of a layout in which every
    # expert's rows are padded to a multiple of BLOCK_M; each block's expert, and the rows in use.
    e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + e, mask=e < NUM_EXPERTS, other=0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(starts_ptr + e, ends - padded, mask=e < NUM_EXPERTS)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    # block b belongs to the number of experts that end at or before its first row (NUM_EXPERTS:
    # past the last expert, a block its program skips)
    # (a while loop, not `range(num_blocks)`: triton 3.6's interpreter cannot take a runtime scalar
    # argument as a range bound)
    b0 = 0
    while b0 < num_blocks:
        b = b0 + tl.arange(0, CHUNK)
        ended = (ends[None, :] <= (b * BLOCK_M)[:, None]) & (e < NUM_EXPERTS)[None, :]
        tl.store(block_expert_ptr + b, tl.sum(ended.to(tl.int32), 1), mask=b < num_blocks)
        b0 += CHUNK


@triton.jit(do_not_specialize=["num_blocks"])
def _offsets_kernel(counts_ptr, starts_ptr, block_expert_ptr, num_padded_ptr, num_blocks,
                    NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                    CHUNK: tl.constexpr):
    _block_layout(counts_ptr, starts_ptr, block_expert_ptr, num_padded_ptr, num_blocks,
                  NUM_EXPERTS, BLOCK_E, BLOCK_M, CHUNK)


@triton.jit(do_not_specialize=["num_pairs"])
def _scatter_kernel(ids_ptr, ranks_ptr, starts_ptr, sorted_ptr, num_pairs, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=mask, other=0)
    dest = tl.load(starts_ptr + expert, mask=mask, other=0) + tl.load(ranks_ptr + offs, mask=mask, other=0)
    tl.store(sorted_ptr + dest, offs.to(tl.int32), mask=mask)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_one_program_kernel(ids_ptr, counts_ptr, starts_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                              num_pairs, num_blocks, NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, CHUNK: tl.constexpr):
    # The three kernels and two fills of align_by_expert in one program (num_pairs <= BLOCK_P); each
    # barrier makes the program's global writes before it visible to all its threads after it.
    e = tl.arange(0, BLOCK_E)
    tl.store(counts_ptr + e, tl.zeros([BLOCK_E], dtype=tl.int32))
    rows = num_blocks * BLOCK_M
    r0 = 0
    while r0 < rows:   # every row padding to start with
        r = r0 + tl.arange(0, BLOCK_P)
        tl.store(sorted_ptr + r, tl.full([BLOCK_P], 0, tl.int32) + num_pairs, mask=r < rows)
        r0 += BLOCK_P
    tl.debug_barrier()
    pair = tl.arange(0, BLOCK_P)
    mask = pair < num_pairs
    expert = tl.load(ids_ptr + pair, mask=mask, other=0)
    rank = tl.atomic_add(counts_ptr + expert, tl.full([BLOCK_P], 1, tl.int32), mask=mask)
    tl.debug_barrier()
    _block_layout(counts_ptr, starts_ptr, block_expert_ptr, num_padded_ptr, num_blocks,
                  NUM_EXPERTS, BLOCK_E, BLOCK_M, CHUNK)
    tl.debug_barrier()
    dest = tl.load(starts_ptr + expert, mask=mask, other=0) + rank
    tl.store(sorted_ptr + dest, pair, mask=mask)


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the padded blocks: each touched expert adds at most one partial block."""
    return num_pairs // block_m + min(num_experts, num_pairs)


@dataclass
class Alignment:
    sorted_pairs: torch.Tensor    # [max_blocks * block_m] int32: pair (token * top_k + k); num_pairs: padding
    block_expert: torch.Tensor    # [max_blocks] int32: the expert of each block (num_experts: unused block)
    num_padded: torch.Tensor      # [1] int32: rows in use (a multiple of block_m)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """topk_ids: [num_tokens, top_k] -> the pairs grouped by expert in blocks of block_m rows."""
    ids = topk_ids.reshape(-1)
    num_pairs, device = ids.numel(), ids.device
    blocks = max_blocks(num_pairs, num_experts, block_m)
    block_e = triton.next_power_of_2(num_experts)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    layout = dict(NUM_EXPERTS=num_experts, BLOCK_E=block_e, BLOCK_M=block_m, CHUNK=32)
    if num_pairs <= ONE_PROGRAM_MAX_PAIRS:   # the kernel zeroes counts and fills sorted_pairs itself
        counts = torch.empty(block_e, dtype=torch.int32, device=device)
        _align_one_program_kernel[(1,)](ids, counts, starts, sorted_pairs, block_expert, num_padded,
                                        num_pairs, blocks,
                                        BLOCK_P=triton.next_power_of_2(num_pairs),
                                        **layout, num_warps=8)
        return Alignment(sorted_pairs, block_expert, num_padded)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    ranks = torch.empty(num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.fill_(num_pairs)
    grid = (triton.cdiv(num_pairs, 1024),)
    _count_kernel[grid](ids, counts, ranks, num_pairs, BLOCK=1024)
    _offsets_kernel[(1,)](counts, starts, block_expert, num_padded, blocks, **layout)
    _scatter_kernel[grid](ids, ranks, starts, sorted_pairs, num_pairs, BLOCK=1024)
    return Alignment(sorted_pairs, block_expert, num_padded)
