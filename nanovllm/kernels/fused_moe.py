"""Fused mixture-of-experts on the GPU in Triton: the router's choice (softmax, top-k, renormalise) in
one kernel; then the (token, expert) pairs are sorted by expert and padded so that each BLOCK_M
rows belong to one expert (both in kernels/moe_routing.py); then one grouped GEMM computes gate and
up with SiLU-and-mul for every block, a second the down projection times the router weight, and a
sum over each token's top_k rows gives the output.

    align_by_expert  decode: one program; prefill: 3 small kernels (count pairs per expert, each
                     pair's rank by an atomic add; block offsets and each block's expert; then
                     scatter the pairs to their slots)
    gate_up kernel   h[pair] = silu(x[token] @ gate[e]^T) * (x[token] @ up[e]^T)      [pairs, inter]
    down kernel      y[pair] = weight[pair] * (h[pair] @ w2[e]^T)                     [pairs, hidden]
    torch sum        out[token] = sum over k of y[token * top_k + k]                  [tokens, hidden]

FP8 experts (w13, w2 float8_e4m3fn with block scales [E, rows / bn, cols / bk] or per-channel scales
[E, rows, 1]): x is quantized per token and group of bk columns (per channel: per token) before the
gate/up GEMM, h likewise before the down GEMM (kernels/fp8_gemm.quantize_activations); the GEMMs run
on FP8 tensor cores. Block scales: each BLOCK_K slice's fp32 product scaled by its activation and
weight scales. Per channel (one scale over all of K): the dots accumulate in place and the fp32 sum
is scaled once after the loop, as vLLM's kernel does (30B-A3B FP8 shapes, H100: 6,751 tok/s against
6,599 with a scaled accumulate every slice). On Hopper the FP8 dots then accumulate over all of K in
the tensor cores' reduced precision (fast accumulation, as the dense `_scaled_mm` GEMMs run).

Nothing reads a count on the host (grids are sized by the worst case, surplus programs return at
once), so the path is CUDA-graph safe. Roundings follow transformers in the model's dtype: gate and
up rounded, silu rounded, their product rounded, the down output rounded before the weight.

Tiles: the module constants below are knobs (read at every call; benchmarks/moe_sweep.py sweeps
them). BLOCK_N counts columns of gate and of up each (a gate/up program computes 2 * BLOCK_N).
Decode has few pairs per expert (256 tokens x top 8 of 128 experts: 16 each), so its blocks are
short and the GEMMs are bound by reading each touched expert's weights once; prefill has hundreds
per expert, so its tiles are the usual compute-bound ones. The bf16 defaults are first choices for
the H200 (informed by vLLM's public tuning table for these shapes); with FP8 experts (per channel) an
H100 sweep kept the decode tiles and took 128-wide K slices for prefill.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

import nanovllm.envs as envs
from nanovllm.kernels.fp8_gemm import _DOT_F32, quantize_activations
from nanovllm.kernels.moe_routing import align_by_expert

# pairs per expert (num_tokens * top_k / num_experts) up to which the decode tiles are used
DECODE_MAX_PAIRS_PER_EXPERT = 32
DECODE_BLOCK_M, DECODE_BLOCK_N, DECODE_BLOCK_K, DECODE_WARPS, DECODE_STAGES = 16, 64, 128, 4, 3
PREFILL_BLOCK_M, PREFILL_BLOCK_N, PREFILL_BLOCK_K, PREFILL_WARPS, PREFILL_STAGES = 128, 128, 64, 8, 3
# FP8 experts' prefill K slice: 128 one-byte columns, the bytes of bf16's 64 (per channel, H100: the 30B
# shapes' 16,384-token call 1.86 ms against 2.11 at 64; moe_sweep.py --fp8 channel)
PREFILL_BLOCK_K_FP8 = envs.MOE_PREFILL_BLOCK_K_FP8.get()
# Block rows swept together per column range: an expert's second block (more than BLOCK_M pairs)
# then finds the weight tile the first one read still in L2.
GROUP_M = 8
# Per-channel FP8 experts: accumulate the dots in place and scale the sums after the loop (False: a
# scaled accumulate every BLOCK_K slice, as the block format needs). NANOVLLM_MOE_SCALE_AFTER_LOOP.
SCALE_AFTER_LOOP = envs.MOE_SCALE_AFTER_LOOP.get()


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def choose_tiles(num_pairs: int, num_experts: int, fp8_group: int = 0) -> Tiles:
    """The tile config for a step of num_pairs (token, expert) pairs: a function of the shapes only,
    so a captured CUDA graph and its replays agree. fp8_group: FP8 experts' columns per scale (a
    block's width; per channel all of K, the kernels mask K's end), 0 for bf16 ones; a K slice never
    spans two groups."""
    if num_pairs <= DECODE_MAX_PAIRS_PER_EXPERT * num_experts:
        return Tiles(DECODE_BLOCK_M, DECODE_BLOCK_N, DECODE_BLOCK_K, DECODE_WARPS, DECODE_STAGES)
    block_k = min(PREFILL_BLOCK_K_FP8, fp8_group) if fp8_group else PREFILL_BLOCK_K
    return Tiles(PREFILL_BLOCK_M, PREFILL_BLOCK_N, block_k, PREFILL_WARPS, PREFILL_STAGES)


def fp8_group_of(scales, hidden: int, inter: int) -> int:
    """choose_tiles' fp8_group for fused_moe_triton's scales: the block's width, per channel all of K
    (the larger of hidden and inter), 0 without FP8."""
    if scales is None:
        return 0
    return scales[2][1] if scales[2] is not None else max(hidden, inter)


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


@triton.jit
def _scaled_dot(a, b, acc, a_scale, b_scale, DOT_F32: tl.constexpr):
    # FP8 tiles: acc + (a . b) * a_scale[:, None] * b_scale[None, :] (fp32 tiles under the interpreter)
    if DOT_F32:
        part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        part = tl.dot(a, b)
    return acc + part * a_scale[:, None] * b_scale[None, :]


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, FP8: tl.constexpr, DOT_F32: tl.constexpr):
    # acc + a . b accumulated in place: bf16 / fp32 tiles, or FP8 tiles left unscaled
    if FP8 and DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if FP8:
        return tl.dot(a, b, acc)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs,
                    num_blocks_m, x_stride, w_stride_e, w_stride_n,
                    xs_ptr, ws_ptr, xs_groups, ws_stride_e, ws_stride_n,
                    TOP_K: tl.constexpr, INTER: tl.constexpr, HIDDEN: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP: tl.constexpr, PRECISION: tl.constexpr,
                    FP8: tl.constexpr = False, GROUP_K: tl.constexpr = 1, SCALE_N: tl.constexpr = 1,
                    DOT_F32: tl.constexpr = False, SCALE_AFTER: tl.constexpr = False):
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
    # FP8: scales of x per (token, k group) and of the gate / up rows per (row block, k group)
    xs_ptrs = xs_ptr + token * xs_groups
    gs_ptrs = ws_ptr + expert * ws_stride_e + (cols // SCALE_N) * ws_stride_n
    us_ptrs = ws_ptr + expert * ws_stride_e + ((cols + INTER) // SCALE_N) * ws_stride_n
    for k0 in range(0, HIDDEN, BLOCK_K):
        k_ok = ks < HIDDEN - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if FP8 and not SCALE_AFTER:   # this K slice's scales
            kg = k0 // GROUP_K
            sa = tl.load(xs_ptrs + kg, mask=valid, other=0.0)
            acc_g = _scaled_dot(a, g, acc_g, sa, tl.load(gs_ptrs + kg, mask=col_ok, other=0.0), DOT_F32)
            acc_u = _scaled_dot(a, u, acc_u, sa, tl.load(us_ptrs + kg, mask=col_ok, other=0.0), DOT_F32)
        else:
            acc_g = _dot(a, g, acc_g, PRECISION, FP8, DOT_F32)
            acc_u = _dot(a, u, acc_u, PRECISION, FP8, DOT_F32)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if SCALE_AFTER:   # per channel (GROUP_K: all of K): the scales once, on the fp32 sums
        sa = tl.load(xs_ptrs, mask=valid, other=0.0)[:, None]
        acc_g = acc_g * sa * tl.load(gs_ptrs, mask=col_ok, other=0.0)[None, :]
        acc_u = acc_u * sa * tl.load(us_ptrs, mask=col_ok, other=0.0)[None, :]
    dtype = h_ptr.dtype.element_ty
    gate = _rounded(acc_g, dtype)
    silu = _rounded(gate / (1.0 + tl.exp(-gate)), dtype)
    h = silu * _rounded(acc_u, dtype)
    h_ptrs = h_ptr + pair.to(tl.int64)[:, None] * INTER + cols[None, :]
    tl.store(h_ptrs, h.to(dtype), mask=valid[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
def _down_kernel(h_ptr, w_ptr, y_ptr, weights_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs,
                 num_blocks_m, w_stride_e, w_stride_n,
                 hs_ptr, ws_ptr, hs_groups, ws_stride_e, ws_stride_n,
                 INTER: tl.constexpr, HIDDEN: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP: tl.constexpr, PRECISION: tl.constexpr,
                 FP8: tl.constexpr = False, GROUP_K: tl.constexpr = 1, SCALE_N: tl.constexpr = 1,
                 DOT_F32: tl.constexpr = False, SCALE_AFTER: tl.constexpr = False):
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
    hs_ptrs = hs_ptr + pair * hs_groups
    bs_ptrs = ws_ptr + expert * ws_stride_e + (cols // SCALE_N) * ws_stride_n
    for k0 in range(0, INTER, BLOCK_K):
        k_ok = ks < INTER - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if FP8 and not SCALE_AFTER:   # this K slice's scales
            kg = k0 // GROUP_K
            acc = _scaled_dot(a, b, acc, tl.load(hs_ptrs + kg, mask=valid, other=0.0),
                              tl.load(bs_ptrs + kg, mask=col_ok, other=0.0), DOT_F32)
        else:
            acc = _dot(a, b, acc, PRECISION, FP8, DOT_F32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SCALE_AFTER:   # per channel (GROUP_K: all of K): the scales once, on the fp32 sums
        acc = (acc * tl.load(hs_ptrs, mask=valid, other=0.0)[:, None]
               * tl.load(bs_ptrs, mask=col_ok, other=0.0)[None, :])
    dtype = y_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    y = _rounded(acc, dtype) * weight[:, None]
    y_ptrs = y_ptr + pair[:, None] * HIDDEN + cols[None, :]
    tl.store(y_ptrs, y.to(dtype), mask=valid[:, None] & col_ok[None, :])


def _fp8_args(a: torch.Tensor, w_scale: torch.Tensor, block, k: int, block_k: int):
    """(a_fp8, kernel args, constexprs) of an FP8 GEMM over k columns in BLOCK_K slices."""
    group = k if block is None else block[1]
    if block is not None and group % block_k:
        raise ValueError(f"FP8 expert block {block}: its column block must be a multiple of the tile's "
                         f"BLOCK_K ({block_k})")
    aq, a_scale = quantize_activations(a, group)
    args = (a_scale, w_scale, a_scale.shape[1], w_scale.stride(0), w_scale.stride(1))
    return aq, args, dict(FP8=True, GROUP_K=group, SCALE_N=1 if block is None else block[0], DOT_F32=_DOT_F32,
                          SCALE_AFTER=block is None and SCALE_AFTER_LOOP)


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, tiles: Tiles | None = None, scales=None) -> torch.Tensor:
    """x: [num_tokens, hidden]; w13: [num_experts, 2 * inter, hidden] (gate rows, then up rows);
    w2: [num_experts, hidden, inter]; topk_weights, topk_ids: [num_tokens, top_k]
    -> sum over k of topk_weights[:, k] * expert_k(x): [num_tokens, hidden]. CUDA-graph safe.
    scales: None, or (w13_scale, w2_scale, block) of FP8 w13 and w2 (block None: per channel)."""
    num_tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    assert w13.shape == (num_experts, 2 * inter, hidden) and w2.shape == (num_experts, hidden, inter)
    assert w13.stride(2) == 1 and w2.stride(2) == 1 and x.stride(1) == 1
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    tiles = tiles or choose_tiles(num_pairs, num_experts, fp8_group_of(scales, hidden, inter))
    align = align_by_expert(topk_ids, num_experts, tiles.block_m)
    blocks_m = align.block_expert.numel()
    weights = topk_weights.reshape(-1).to(x.dtype).contiguous()
    # fp32 models on the GPU: exact products (the default would be TF32)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    launch = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP=GROUP_M,
                  PRECISION=precision, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    a, fp8_args, fp8 = x, (x, x, 0, 0, 0), {}   # unused scale arguments without FP8
    if scales is not None:
        a, fp8_args, fp8 = _fp8_args(x, scales[0], scales[2], hidden, tiles.block_k)
    _gate_up_kernel[(blocks_m * triton.cdiv(inter, tiles.block_n),)](
        a, w13, h, align.sorted_pairs, align.block_expert, align.num_padded, num_pairs, blocks_m,
        a.stride(0), w13.stride(0), w13.stride(1), *fp8_args, TOP_K=top_k, INTER=inter, HIDDEN=hidden,
        **launch, **fp8)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    a, fp8_args = h, (h, h, 0, 0, 0)
    if scales is not None:
        a, fp8_args, fp8 = _fp8_args(h, scales[1], scales[2], inter, tiles.block_k)
    _down_kernel[(blocks_m * triton.cdiv(hidden, tiles.block_n),)](
        a, w2, y, weights, align.sorted_pairs, align.block_expert, align.num_padded, num_pairs, blocks_m,
        w2.stride(0), w2.stride(1), *fp8_args, INTER=inter, HIDDEN=hidden, **launch, **fp8)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)
