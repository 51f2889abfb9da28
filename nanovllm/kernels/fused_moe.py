"""Fused mixture-of-experts on the GPU in Triton: the router's choice (softmax, top-k, renormalise) in
one kernel; then the (token, expert) pairs are sorted by expert and padded so that each BLOCK_M
rows belong to one expert (both in kernels/moe_routing.py); then one grouped GEMM computes gate and
up with SiLU-and-mul for every block, a second the down projection times the router weight, and a
sum over each token's top_k rows gives the output.

    align_by_expert  3 small kernels: count pairs per expert (each pair's rank by an atomic add),
                     block offsets and each block's expert, then scatter the pairs to their slots
    gate_up kernel   h[pair] = silu(x[token] @ gate[e]^T) * (x[token] @ up[e]^T)      [pairs, inter]
    down kernel      y[pair] = weight[pair] * (h[pair] @ w2[e]^T)                     [pairs, hidden]
    torch sum        out[token] = sum over k of y[token * top_k + k]                  [tokens, hidden]

Nothing reads a count on the host (grids are sized by the worst case, surplus programs return at
once), so the path is CUDA-graph safe. Roundings follow transformers in the model's dtype: gate and
up rounded, silu rounded, their product rounded, the down output rounded before the weight.

Tiles: the module constants below are knobs (read at every call; benchmarks/moe_sweep.py sweeps
them). BLOCK_N counts columns of gate and of up each (a gate/up program computes 2 * BLOCK_N).
Decode has few pairs per expert (256 tokens x top 8 of 128 experts: 16 each), so its blocks are
short and the GEMMs are bound by reading each touched expert's weights once; prefill has hundreds
per expert, so its tiles are the usual compute-bound ones. The defaults are untimed first choices
for the H200 (informed by vLLM's public tuning table for these shapes), to be replaced by the sweep.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels.moe_routing import align_by_expert

# pairs per expert (num_tokens * top_k / num_experts) up to which the decode tiles are used
DECODE_MAX_PAIRS_PER_EXPERT = 32
DECODE_BLOCK_M, DECODE_BLOCK_N, DECODE_BLOCK_K, DECODE_WARPS, DECODE_STAGES = 16, 64, 128, 4, 3
PREFILL_BLOCK_M, PREFILL_BLOCK_N, PREFILL_BLOCK_K, PREFILL_WARPS, PREFILL_STAGES = 128, 128, 64, 8, 3
# Block rows swept together per column range: an expert's second block (more than BLOCK_M pairs)
# then finds the weight tile the first one read still in L2.
GROUP_M = 8


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def choose_tiles(num_pairs: int, num_experts: int) -> Tiles:
    """The tile config for a step of num_pairs (token, expert) pairs: a function of the shapes only,
    so a captured CUDA graph and its replays agree."""
    if num_pairs <= DECODE_MAX_PAIRS_PER_EXPERT * num_experts:
        return Tiles(DECODE_BLOCK_M, DECODE_BLOCK_N, DECODE_BLOCK_K, DECODE_WARPS, DECODE_STAGES)
    return Tiles(PREFILL_BLOCK_M, PREFILL_BLOCK_N, PREFILL_BLOCK_K, PREFILL_WARPS, PREFILL_STAGES)


# ---- the two grouped GEMMs ---------------------------------------------------------------------

@triton.jit
def _rounded(x, dtype: tl.constexpr):
    return x.to(dtype).to(tl.float32)


@triton.jit
def _block_ids(num_blocks_m, num_blocks_n, GROUP: tl.constexpr):
    # Program -> (block row, block column), GROUP block rows at a time per column sweep.
    pid = tl.program_id(0)
    per_group = GROUP * num_blocks_n
    first_m = (pid // per_group) * GROUP
    group_size = tl.minimum(num_blocks_m - first_m, GROUP)
    return first_m + (pid % per_group) % group_size, (pid % per_group) // group_size


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs,
                    num_blocks_m, x_stride, w_stride_e, w_stride_n,
                    TOP_K: tl.constexpr, INTER: tl.constexpr, HIDDEN: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP: tl.constexpr, PRECISION: tl.constexpr):
    # h[pair, n] = silu(x[token] . gate[e, n]) * (x[token] . up[e, n]) for the block's pairs and
    # columns n; w: [E, 2 * INTER, HIDDEN] (gate rows, then up rows), h: [num_pairs, INTER].
    pid_m, pid_n = _block_ids(num_blocks_m, tl.cdiv(INTER, BLOCK_N), GROUP)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * x_stride + ks[None, :]
    g_ptrs = w_ptr + expert * w_stride_e + cols[None, :].to(tl.int64) * w_stride_n + ks[:, None]   # [K, N]
    u_ptrs = g_ptrs + INTER * w_stride_n
    col_ok = cols < INTER
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        k_ok = ks < HIDDEN - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    dtype = h_ptr.dtype.element_ty
    gate = _rounded(acc_g, dtype)
    silu = _rounded(gate / (1.0 + tl.exp(-gate)), dtype)
    h = silu * _rounded(acc_u, dtype)
    h_ptrs = h_ptr + pair.to(tl.int64)[:, None] * INTER + cols[None, :]
    tl.store(h_ptrs, h.to(dtype), mask=valid[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
def _down_kernel(h_ptr, w_ptr, y_ptr, weights_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs,
                 num_blocks_m, w_stride_e, w_stride_n,
                 INTER: tl.constexpr, HIDDEN: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP: tl.constexpr, PRECISION: tl.constexpr):
    # y[pair, n] = weight[pair] * (h[pair] . w2[e, n]); w: [E, HIDDEN, INTER], y: [num_pairs, HIDDEN].
    pid_m, pid_n = _block_ids(num_blocks_m, tl.cdiv(HIDDEN, BLOCK_N), GROUP)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    pair = pair.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + pair[:, None] * INTER + ks[None, :]
    b_ptrs = w_ptr + expert * w_stride_e + cols[None, :].to(tl.int64) * w_stride_n + ks[:, None]   # [K, N]
    col_ok = cols < HIDDEN
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        k_ok = ks < INTER - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    dtype = y_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    y = _rounded(acc, dtype) * weight[:, None]
    y_ptrs = y_ptr + pair[:, None] * HIDDEN + cols[None, :]
    tl.store(y_ptrs, y.to(dtype), mask=valid[:, None] & col_ok[None, :])


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, tiles: Tiles | None = None) -> torch.Tensor:
    """x: [num_tokens, hidden]; w13: [num_experts, 2 * inter, hidden] (gate rows, then up rows);
    w2: [num_experts, hidden, inter]; topk_weights, topk_ids: [num_tokens, top_k]
    -> sum over k of topk_weights[:, k] * expert_k(x): [num_tokens, hidden]. CUDA-graph safe."""
    num_tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    assert w13.shape == (num_experts, 2 * inter, hidden) and w2.shape == (num_experts, hidden, inter)
    assert w13.stride(2) == 1 and w2.stride(2) == 1 and x.stride(1) == 1
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    tiles = tiles or choose_tiles(num_pairs, num_experts)
    align = align_by_expert(topk_ids, num_experts, tiles.block_m)
    blocks_m = align.block_expert.numel()
    weights = topk_weights.reshape(-1).to(x.dtype).contiguous()
    # fp32 models on the GPU: exact products (the default would be TF32)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    launch = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP=GROUP_M,
                  PRECISION=precision, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks_m * triton.cdiv(inter, tiles.block_n),)](
        x, w13, h, align.sorted_pairs, align.block_expert, align.num_padded, num_pairs, blocks_m,
        x.stride(0), w13.stride(0), w13.stride(1), TOP_K=top_k, INTER=inter, HIDDEN=hidden, **launch)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(blocks_m * triton.cdiv(hidden, tiles.block_n),)](
        h, w2, y, weights, align.sorted_pairs, align.block_expert, align.num_padded, num_pairs, blocks_m,
        w2.stride(0), w2.stride(1), INTER=inter, HIDDEN=hidden, **launch)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)
