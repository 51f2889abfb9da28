"""Paged decode attention in Triton: GQA-grouped, split over the context (flash-decoding).

Stage 1 runs one program per (sequence, kv head, split). The program loads the query heads that
share the KV head as one [BLOCK_G, D] tile, so every K/V tile is read from memory once for the whole
group, and keeps an online softmax in fp32. With one split it writes the output directly; otherwise it
writes a partial output and its log-sum-exp, and stage 2 merges the splits.

An FP8 cache (float8_e4m3fn, the FP8 constexpr) is read as it is, one byte per value, and
dequantized in registers: the layer's k_scale joins the softmax scale, v_scale multiplies the
output, and the K and V tiles are converted to fp16 (exact: every e4m3 value is an fp16 value) for
dots in fp16 with fp32 accumulation. fp16, not bf16: e4m3 -> fp16 is one hardware instruction per
two values (cvt.rn.f16x2.e4m3x2), e4m3 -> bf16 three (through fp16). So the query is rounded to
fp16 too (finer than bf16; it must stay below 65504, as in any fp16 model) and so are the softmax
weights (finer than the bf16 kernel's). Where each tile is converted decides the speed: K as
Triton places it, in the dot's registers, V as it is loaded (_e4m3_to_f16); and with half the bytes
per token the loop's other work counts twice as much, so whole tiles skip the masks, and programs
are one warp of 64-token tiles: no warp of a program waits at a barrier for the others (4-warp
programs of 128 tokens, the bf16 tiles, ran 11-14% slower). And FP8's dots run transposed: the
scores as S^T = K Q^T and the output as O^T += V^T P^T, so the group's few query heads (2 for
Qwen3-0.6B) are the dots' N, which the tensor cores pad to 8, not their M, padded to 16: half the
MMAs and accumulator registers (no spills in one warp); 1.054x bench.py with the FP8 cache. The
bf16 tiles, whose loop already runs at about the copy rate, compile to more instructions a token
transposed and run no faster on an H200, so they run straight, and mask every tile. (The variants
measured and not kept: docs/benchmarks.md, "Tried and rejected".) The scales are read on the device,
so graphs captured before calculate_kv_scales sets them still see them.

Launch order. A decode batch mixes short and long contexts, and a sequence's programs take time in
proportion to its context: launched in batch order, the last long ones run nearly alone at the end
of the kernel while most SMs idle. The grid's slowest axis is therefore the sequence, and the caller
may pass the order to launch the sequences in (the engine: longest context first, computed on the
host with the step's inputs), the classic longest-first schedule. On bench.py's contexts at batch
256 this made the bf16 kernel 1.06x faster, and the FP8 kernel, with one-warp programs, 1.26x
(benchmarks/RESULTS.md).

Everything launched here depends only on tensor shapes, so a decode step can be captured in a CUDA
graph: no host syncs, no branch on tensor values.
"""
import torch
import triton
import triton.language as tl

import nanovllm.envs as envs
from nanovllm.kernels.common import interpreted as runs_interpreted, num_sms

# Log-sum-exp of an empty split. Finite so that merging all-empty splits (context_len 0) gives 0, not NaN.
_EMPTY_LSE = tl.constexpr(-1.0e30)
LOG2E = 1.4426950408889634


@triton.jit
def _e4m3_to_f16(x):
    """An e4m3 tile, bitcast to uint8, as fp16 (exact): two values per cvt.rn.f16x2.e4m3x2, on the
    registers the tile was loaded into. Inline assembly marked impure, so that Triton keeps the
    conversion here: its own cast (.to) is moved behind the shared-memory read of a dot operand, and
    for V, whose dot sums over tokens (rows of the tile), that read takes one byte per instruction;
    converted here, V reaches the dot as fp16 through ldmatrix.trans, as a bf16 cache does."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
        "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _load_tile(ptrs, token_mask, dim_mask, MASKED: tl.constexpr, WHOLE_DIMS: tl.constexpr):
    """A K or V tile: token_mask applied when MASKED, dim_mask (head_dim padding) unless WHOLE_DIMS."""
    if MASKED:
        tile = tl.load(ptrs, mask=token_mask & dim_mask, other=0.0)
    elif WHOLE_DIMS:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=dim_mask, other=0.0)
    return tile


@triton.jit
def _soft_cap(s, cap):
    # cap * tanh(s / cap), tanh written through the sigmoid (the interpreter has no libdevice)
    return cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)


@triton.jit
def _attend_tile(q, k_cache_ptr, v_cache_ptr, table, tile, lo, end, offs_n, offs_d, kv_off, tile_off,
                 scale_log2e, cap_log2e, m_i, l_i, acc, stride_kb, stride_kt,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_FP32: tl.constexpr,
                 PRECISION: tl.constexpr, FP8: tl.constexpr, V_CVT_ASM: tl.constexpr,
                 WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    """The online softmax over the context tokens [tile, tile + BLOCK_N). MASKED: tokens from end on
    (and, WINDOWED, those before lo: outside the sliding window) are not loaded and weigh 0;
    otherwise the whole tile lies in [lo, end) (no masks to compute). SOFTCAP: scores (log2 units)
    soft-capped at cap_log2e (the cap times log2(e)).
    FP8: everything transposed, the query heads as the dots' N (a few rows, not 16 padded ones):
    q is Q^T [BLOCK_D, BLOCK_G], S^T = K Q^T [BLOCK_N, BLOCK_G], acc is O^T += V^T P^T
    [BLOCK_D, BLOCK_G]; m_i, l_i as for the other caches."""
    tokens = tile + offs_n
    valid = tokens < end
    if WINDOWED:
        valid = valid & (tokens >= lo)
    if BLOCK_SIZE % BLOCK_N == 0:
        # Tiles start at multiples of BLOCK_N, so a tile lies inside one block: one table read, and
        # a scalar base plus the offsets every tile shares (tile_off).
        block_id = tl.load(table + tile // BLOCK_SIZE).to(tl.int64)
        base = block_id * stride_kb + tl.multiple_of(tile % BLOCK_SIZE, 16) * stride_kt
        k_ptrs = k_cache_ptr + base + tile_off
        v_ptrs = v_cache_ptr + base + tile_off
    else:
        block_ids = tl.load(table + tokens // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = block_ids * stride_kb + (tokens % BLOCK_SIZE) * stride_kt
        k_ptrs = k_cache_ptr + rows[:, None] + kv_off
        v_ptrs = v_cache_ptr + rows[:, None] + kv_off
    d_mask = (offs_d < HEAD_DIM)[None, :]
    k = _load_tile(k_ptrs, valid[:, None], d_mask, MASKED, HEAD_DIM == BLOCK_D)
    v = _load_tile(v_ptrs, valid[:, None], d_mask, MASKED, HEAD_DIM == BLOCK_D)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    elif FP8:
        # K's dot sums over head_dim, contiguous in the cache: Triton's own cast converts it in the
        # dot's registers, four bytes per shared-memory read.
        k = k.to(tl.float16)
        if V_CVT_ASM:
            v = _e4m3_to_f16(v.to(tl.uint8, bitcast=True))
        else:   # the interpreter (no inline assembly), or a tile too small for groups of 4 values a thread
            v = v.to(tl.float16)
    if FP8:
        s = tl.dot(k, q, input_precision=PRECISION) * scale_log2e   # [BLOCK_N, BLOCK_G]
        if SOFTCAP:
            s = _soft_cap(s, cap_log2e)
        if MASKED:
            s = tl.where(valid[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p.to(v.dtype), input_precision=PRECISION)
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e  # [BLOCK_G, BLOCK_N], log2
        if SOFTCAP:
            s = _soft_cap(s, cap_log2e)
        if MASKED:
            s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, order_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, k_scale_ptr, v_scale_ptr,
    scale_log2e, window, cap_log2e,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,  # k_cache and v_cache share strides (both contiguous)
    stride_bt,
    stride_ob, stride_oh,
    num_splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr, FP8: tl.constexpr, V_CVT_ASM: tl.constexpr, INTERPRETED: tl.constexpr,
    ORDERED: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
):
    # The grid's slowest axis is the sequence, so a sequence's programs start together, in the
    # order of order_ptr (ORDERED: the longest contexts first) or of the batch.
    seq = tl.program_id(2)
    if ORDERED:
        seq = tl.load(order_ptr + seq)
    kv_head = tl.program_id(1)
    split = tl.program_id(0)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g

    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    if FP8:
        scale_log2e = scale_log2e * tl.load(k_scale_ptr)   # scores of the stored K / k_scale
        if not DOT_FP32:
            q = q.to(tl.float16)

    # Each split takes an equal share of this sequence's context, rounded up to whole tiles. With a
    # sliding window the context is its last `window` tokens, from lo on (the splits start at the tile
    # lo falls in, so tiles stay aligned to BLOCK_N; the tokens before lo are masked).
    context_len = tl.load(context_lens_ptr + seq)
    lo = 0
    if WINDOWED:
        lo = tl.maximum(context_len - window, 0)
    first = lo // BLOCK_N * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(context_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * per_split
    end = tl.minimum(start + per_split, context_len)

    m_i = tl.full([BLOCK_G], _EMPTY_LSE, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    if FP8:   # the dots transposed (_attend_tile)
        q = tl.trans(q)
        acc = tl.zeros([BLOCK_D, BLOCK_G], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_off = kv_head * stride_kh + offs_d[None, :]
    tile_off = offs_n[:, None] * stride_kt + kv_off   # [BLOCK_N, BLOCK_D], the same in every tile
    # FP8: the whole tiles first, without masks, then the partial one, if any (the other caches mask
    # every tile: their loop already runs at the copy rate; so does FP8 with a window).
    whole_end = end
    if FP8 and not WINDOWED:
        whole_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    if INTERPRETED:
        # Triton 3.6's interpreter cannot run range() over tensor bounds (it calls int() on a
        # 1-element array, which numpy 2 refuses); the compiled loop must stay a for (pipelining).
        tile = start
        while tile < whole_end:
            m_i, l_i, acc = _attend_tile(
                q, k_cache_ptr, v_cache_ptr, table, tile, lo, end, offs_n, offs_d, kv_off, tile_off,
                scale_log2e, cap_log2e, m_i, l_i, acc, stride_kb, stride_kt, HEAD_DIM, BLOCK_D, BLOCK_SIZE,
                BLOCK_N, not FP8 or WINDOWED, DOT_FP32, PRECISION, FP8, V_CVT_ASM, WINDOWED, SOFTCAP)
            tile += BLOCK_N
    else:
        for tile in range(start, whole_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, k_cache_ptr, v_cache_ptr, table, tile, lo, end, offs_n, offs_d, kv_off, tile_off,
                scale_log2e, cap_log2e, m_i, l_i, acc, stride_kb, stride_kt, HEAD_DIM, BLOCK_D, BLOCK_SIZE,
                BLOCK_N, not FP8 or WINDOWED, DOT_FP32, PRECISION, FP8, V_CVT_ASM, WINDOWED, SOFTCAP)
    if FP8 and not WINDOWED:
        if whole_end < end:
            m_i, l_i, acc = _attend_tile(
                q, k_cache_ptr, v_cache_ptr, table, whole_end, lo, end, offs_n, offs_d, kv_off, tile_off,
                scale_log2e, cap_log2e, m_i, l_i, acc, stride_kb, stride_kt, HEAD_DIM, BLOCK_D, BLOCK_SIZE,
                BLOCK_N, True, DOT_FP32, PRECISION, FP8, V_CVT_ASM, WINDOWED, SOFTCAP)

    if FP8:
        acc = tl.trans(acc)
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = acc / safe_l[:, None]
    if FP8:
        out = out * tl.load(v_scale_ptr)   # the mean of the stored V / v_scale, scaled back
    out_mask = mask_g[:, None] & mask_d[None, :]
    if DIRECT:
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials: out [batch, num_heads, num_splits, HEAD_DIM], lse [batch, num_heads, num_splits] (log2).
        row = (seq * (tl.num_programs(1) * GROUP) + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), _EMPTY_LSE)
        tl.store(part_lse_ptr + row, lse, mask=mask_g)


# num_splits is not specialised on: the split count changes with the batch size, and one compiled
# variant per power of two (BLOCK_S) serves every count up to it (fewer compiles at graph capture).
@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh, num_heads,
                          num_splits, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    # One program per (sequence, query head): a log-sum-exp weighted mean of the split outputs.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    row = (seq * num_heads + head) * num_splits
    lse = tl.load(part_lse_ptr + row + offs_s, mask=mask_s, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    parts = tl.load(part_out_ptr + (row + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=mask_d)


# Programs per SM that the split count aims for: more splits fill the SMs at small batches, but each
# adds a partial result to merge. 8 ran bench.py fastest in batch order; launched longest first,
# fewer splits balance as well, and 4 ran it fastest (benchmarks/RESULTS.md).
PROGRAMS_PER_SM = envs.DECODE_PROGRAMS_PER_SM.get()
NUM_STAGES = 2   # software-pipelining depth of the K/V loads in the split kernel
# Context tokens per loop step and warps per program of the split kernel: the fastest pair of a sweep
# of (32|64|128) x (2|4|8) (benchmarks/RESULTS.md).
BLOCK_N = 128
NUM_WARPS = 4
# The same over an FP8 cache: one-warp programs of 64-token tiles (the module's docstring says why).
FP8_BLOCK_N = 64
FP8_NUM_WARPS = 1


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, block_n: int,
                      device: torch.device) -> int:
    """Enough splits to give every SM about PROGRAMS_PER_SM programs, from shapes only (graph-safe)."""
    programs = batch * num_kv_heads
    want = triton.cdiv(PROGRAMS_PER_SM * num_sms(device), programs)
    # Short splits cost more (merge, loop start) than they win in parallelism: at least 4 tiles of
    # the longest context the block table can hold.
    most = max(1, triton.cdiv(max_context, 4 * block_n))
    return max(1, min(want, most, 32))


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                                  scale: float, num_splits: int | None = None,
                                  block_n: int | None = None, k_scale: torch.Tensor | None = None,
                                  v_scale: torch.Tensor | None = None,
                                  order: torch.Tensor | None = None, *, window: int = 0,
                                  softcap: float = 0.0) -> torch.Tensor:
    # q: [batch, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    # block_tables: [batch, max_blocks] int32; context_lens: [batch] int32 (0 allowed)
    # -> [batch, num_heads, head_dim]
    # k_scale, v_scale: [1] fp32 (an FP8 cache's scales; unused otherwise)
    # order: [batch] int32, a permutation of the rows: the order the sequences' programs are launched
    # in (longest context first is fastest: no long program is left to run alone at the end)
    # window > 0: the last `window` keys only; softcap > 0: scores soft-capped (reference.soft_cap)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.stride() == v_cache.stride()
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    assert not fp8 or (k_scale is not None and v_scale is not None), "an FP8 cache needs k_scale and v_scale"
    group = num_heads // num_kv_heads
    interpreted = runs_interpreted(q.device)
    # The interpreter's tl.dot is wrong on bf16 (fp32 there instead), right on fp16 (FP8's dots).
    dot_fp32 = q.dtype == torch.float32 or (interpreted and not fp8)
    # fp32 dots (fp32 queries: tests) hold twice the bytes per tile: they take the bf16 cache's
    # tile (FP8's could overflow shared memory).
    fp8_tiles = fp8 and not dot_fp32
    block_n = block_n or (FP8_BLOCK_N if fp8_tiles else BLOCK_N)
    num_warps = FP8_NUM_WARPS if fp8_tiles else NUM_WARPS
    max_context = block_tables.shape[1] * block_size
    if window > 0:   # the keys a window reads span at most one tile more than it
        max_context = min(max_context, window + (block_n or BLOCK_N))
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, block_n, q.device)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    direct = num_splits == 1
    if direct:
        part_out = part_lse = out  # unused
    else:
        part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))   # tl.dot needs K >= 16; masks cover the padding
    _decode_split_kernel[(num_splits, num_kv_heads, batch)](
        q, k_cache, v_cache, block_tables, context_lens, context_lens if order is None else order,
        out, part_out, part_lse,
        k_scale if fp8 else q, v_scale if fp8 else q, scale * LOG2E, window, (softcap or 1.0) * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_splits,
        # FP8's transposed dots pad the group to 8 (the dots' N), the others' to 16 (their M)
        GROUP=group, BLOCK_G=max(8 if fp8 else 16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=block_n, DIRECT=direct,
        DOT_FP32=dot_fp32,
        PRECISION="ieee" if q.dtype == torch.float32 else None,  # ieee: fp32 tests need exact fp32
        FP8=fp8,
        # The inline assembly needs the GPU, and whole groups of 4 values per thread.
        V_CVT_ASM=fp8_tiles and not interpreted and block_n * block_d >= 4 * 32 * num_warps,
        INTERPRETED=interpreted, ORDERED=order is not None, WINDOWED=window > 0, SOFTCAP=softcap > 0,
        num_warps=num_warps, num_stages=NUM_STAGES,
    )
    if not direct:
        _decode_reduce_kernel[(batch, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_heads, num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, BLOCK_D=block_d, num_warps=4)
    return out
