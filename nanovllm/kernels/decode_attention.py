"""Paged decode attention in Triton: GQA-grouped, split over the context (flash-decoding).

Stage 1 runs one program per (sequence, kv head, split). The program loads the query heads that
share the KV head as one [BLOCK_G, D] tile, so every K/V tile is read from memory once for the whole
group, and keeps an online softmax in fp32. With one split it writes the output directly; otherwise it
writes a partial output and its log-sum-exp, and stage 2 merges the splits.

An FP8 cache (float8_e4m3fn, the FP8 constexpr) is read as it is, one byte per value, and
dequantized in registers: the layer's k_scale joins the softmax scale, v_scale multiplies the
output, and the K and V tiles are converted to fp16 (exact: every e4m3 value is an fp16 value) for
dots in fp16 with fp32 accumulation. fp16, not bf16: e4m3 -> fp16 is one hardware instruction per
two values (cvt.rn.f16x2.e4m3x2), e4m3 -> bf16 three (through fp16), and at the cache's bandwidth
the conversions alone could then outrun the SM's conversion throughput. So the query is rounded to
fp16 too (finer than bf16; it must stay below 65504, as in any fp16 model) and so are the softmax
weights (finer than the bf16 kernel's). FP8_DOT_BF16 keeps the dots in bf16 instead (to compare).
The scales are read on the device, so graphs captured before calculate_kv_scales sets them still
see them.

Everything launched here depends only on tensor shapes, so a decode step can be captured in a CUDA
graph: no host syncs, no branch on tensor values.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.common import num_sms

# Log-sum-exp of an empty split. Finite so that merging all-empty splits (context_len 0) gives 0, not NaN.
_EMPTY_LSE = tl.constexpr(-1.0e30)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, k_scale_ptr, v_scale_ptr,
    scale_log2e,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,  # k_cache and v_cache share strides (both contiguous)
    stride_bt,
    stride_ob, stride_oh,
    num_splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr, FP8: tl.constexpr, FP8_DOT_DTYPE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

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
            q = q.to(FP8_DOT_DTYPE)

    # Each split takes an equal share of this sequence's context, rounded up to whole tiles.
    context_len = tl.load(context_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, context_len)

    m_i = tl.full([BLOCK_G], _EMPTY_LSE, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_off = kv_head * stride_kh + offs_d[None, :]
    for tile in range(start, end, BLOCK_N):
        tokens = tile + offs_n
        valid = tokens < end
        if BLOCK_SIZE % BLOCK_N == 0:
            # Tiles start at multiples of BLOCK_N, so a tile lies inside one block: one table read.
            block_id = tl.load(table + tile // BLOCK_SIZE).to(tl.int64)
            rows = block_id * stride_kb + ((tile % BLOCK_SIZE) + offs_n) * stride_kt
        else:
            block_ids = tl.load(table + tokens // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            rows = block_ids * stride_kb + (tokens % BLOCK_SIZE) * stride_kt
        kv_mask = valid[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + rows[:, None] + kv_off, mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif FP8:
            k = k.to(FP8_DOT_DTYPE)
            v = v.to(FP8_DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e  # [BLOCK_G, BLOCK_N], log2 domain
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

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


@triton.jit
def _decode_reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh, num_heads,
                          NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per (sequence, query head): a log-sum-exp weighted mean of the split outputs.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM
    row = (seq * num_heads + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + row + offs_s, mask=mask_s, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    parts = tl.load(part_out_ptr + (row + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=mask_d)


# Programs per SM that the split count aims for: more splits fill the SMs at small batches, but each
# adds a partial result to merge; 8 ran bench.py fastest (the sweeps are in benchmarks/RESULTS.md).
PROGRAMS_PER_SM = 8
NUM_STAGES = 2   # software-pipelining depth of the K/V loads in the split kernel
# Context tokens per loop step and warps per program of the split kernel: the fastest pair of a sweep
# of (32|64|128) x (2|4|8) (benchmarks/RESULTS.md).
BLOCK_N = 128
NUM_WARPS = 4
# The same for an FP8 cache, whose tiles hold half the bytes: 256 tokens keep as many bytes in
# flight per step as the bf16 kernel's 128 (to be tuned: bench_kernels.py --sweep tiles_fp8).
BLOCK_N_FP8 = 256
NUM_WARPS_FP8 = 8
FP8_DOT_BF16 = False   # True: FP8 tiles converted to bf16 (three conversions per two values), see above


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
                                  v_scale: torch.Tensor | None = None) -> torch.Tensor:
    # q: [batch, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    # block_tables: [batch, max_blocks] int32; context_lens: [batch] int32 (0 allowed)
    # -> [batch, num_heads, head_dim]
    # k_scale, v_scale: [1] fp32 (an FP8 cache's scales; unused otherwise)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.stride() == v_cache.stride()
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    assert not fp8 or (k_scale is not None and v_scale is not None), "an FP8 cache needs k_scale and v_scale"
    group = num_heads // num_kv_heads
    # The interpreter's tl.dot is wrong on bf16 (fp32 there instead), right on fp16 (FP8's dots).
    dot_fp32 = q.dtype == torch.float32 or (q.device.type == "cpu" and not (fp8 and not FP8_DOT_BF16))
    # fp32 dots (fp32 queries: tests) hold twice the bytes per tile: the FP8 tile would overflow
    # shared memory on the H200 (328 KiB asked, 227 KiB there).
    block_n = block_n or (BLOCK_N_FP8 if fp8 and not dot_fp32 else BLOCK_N)
    max_context = block_tables.shape[1] * block_size
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
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        k_scale if fp8 else q, v_scale if fp8 else q, scale * 1.4426950408889634,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_splits,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=block_n, DIRECT=direct,
        DOT_FP32=dot_fp32,
        PRECISION="ieee" if q.dtype == torch.float32 else None,  # ieee: fp32 tests need exact fp32
        FP8=fp8, FP8_DOT_DTYPE=tl.bfloat16 if FP8_DOT_BF16 else tl.float16,
        num_warps=NUM_WARPS_FP8 if fp8 else NUM_WARPS, num_stages=NUM_STAGES,
    )
    if not direct:
        _decode_reduce_kernel[(batch, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_heads,
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, BLOCK_D=block_d, num_warps=4)
    return out
