"""Prefill attention in Triton: causal FlashAttention over varlen prompts, GQA native. A sequence's
earlier keys (a cached prefix, or the chunks of its prompt that earlier steps ran) are read straight
from the paged cache through its block-table row (no gather), its new keys from this step's k/v; with
an FP8 cache every key is read from the pages, dequantized tile by tile.

One program computes BLOCK_M queries of one sequence for one query head:

    for each BLOCK_N tile of earlier keys, from the pages       (every query sees them: no mask but
                                                                 the last tile's end)
    for each tile of new keys left of the query tile's diagonal (no mask)
    then each tile of new keys on the diagonal                  (causal mask, and keys past the end)
        s = q k^T;  online softmax of s * scale * log2(e) in base 2;  acc = acc * alpha + p v

The causal mask is bottom-right aligned (query j of a sequence with q_len queries and k_len keys sits
at position k_len - q_len + j), as kernels.reference.causal_mask is. A tile of keys never crosses a
cache page (BLOCK_N divides the page), so one block-table read gives its rows. Programs start with
the last (heaviest) query tiles of every sequence, so the short ones fill the tail of the grid. On
Hopper and later the K/V tiles are loaded through tensor descriptors (the TMA unit), else by plain loads.
"""
import functools
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

import nanovllm.envs as envs
from nanovllm.kernels.backend import prefill_attention
from nanovllm.kernels.common import in_threads
from nanovllm.kernels.common import interpreted as runs_interpreted

LOG2E = math.log2(math.e)


@triton.jit
def _first_key_row(bt_ptr, k_start, start_n, PAGED: tl.constexpr, PAGE: tl.constexpr):
    # The row of key start_n of a sequence (the tile's BLOCK_N rows follow it): in the paged cache
    # viewed as [num_blocks * PAGE, num_kv_heads * head_dim] (bt_ptr: its block-table row), or in the
    # varlen k/v buffers, where the sequence's keys start at row k_start.
    if PAGED:
        block = tl.load(bt_ptr + start_n // PAGE).to(tl.int64)
        return block * PAGE + (start_n % PAGE)
    return (k_start + start_n).to(tl.int64)


@triton.jit
def _load_kv(src, row, offs_n, stride, col, cols, ok, scale_ptr, DTYPE: tl.constexpr, DEQUANT: tl.constexpr,
             MASKED: tl.constexpr, TMA: tl.constexpr):
    # [BLOCK_N, HEAD_DIM] of K or V (rows row .. row + BLOCK_N) in DTYPE; an FP8 cache's values times its
    # scale (fp32, rounded once to DTYPE, as flash_prefill.gather_dequantize_kv does). MASKED: rows past
    # k_len read as 0 (uninitialised cache rows may hold NaN, and 0 * NaN would reach the output through
    # p v). TMA: src is a tensor descriptor of [rows, num_kv_heads * head_dim] (the KV head's columns
    # start at col); else a pointer already at the KV head.
    if TMA:
        x = src.load([row.to(tl.int32), col])   # descriptor coordinates are 32-bit
        if MASKED:
            x = tl.where(ok[:, None], x, 0.0)
    else:
        ptrs = src + (row + offs_n)[:, None] * stride + cols[None, :]
        if MASKED:
            x = tl.load(ptrs, mask=ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs)
    if DEQUANT:
        x = (x.to(tl.float32) * tl.load(scale_ptr)).to(DTYPE)
    return x


@triton.jit
def _soft_cap(s, cap):
    # cap * tanh(s / cap), tanh written through the sigmoid (the interpreter has no libdevice)
    return cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, k_src, v_src, bt_ptr, k_start, k_stride, v_stride, col, k_scale_ptr,
                  v_scale_ptr, lo, hi, q_pos, k_len, qk_scale, cols, window, cap_log2e,
                  MASKED: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, DEQUANT: tl.constexpr,
                  BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, TMA: tl.constexpr,
                  WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    # Keys lo .. hi (lo a multiple of BLOCK_N) into the running (acc, m_i, l_i) of the query tile q;
    # q_pos: the queries' positions, counted as the keys' are. WINDOWED: query i sees only keys after
    # q_pos[i] - window (every tile masked; the tiles before the first query's window skipped). SOFTCAP:
    # scores soft-capped at cap_log2e (the cap times log2(e)), in exp2's units.
    offs_n = tl.arange(0, BLOCK_N)
    dtype = q.dtype
    if WINDOWED:
        lo = tl.maximum(lo, tl.maximum(tl.min(q_pos, 0) - window + 1, 0) // BLOCK_N * BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        row = _first_key_row(bt_ptr, k_start, start_n, PAGED, PAGE)
        k_pos = start_n + offs_n
        k_ok = k_pos < k_len
        k = _load_kv(k_src, row, offs_n, k_stride, col, cols, k_ok, k_scale_ptr, dtype, DEQUANT, MASKED, TMA)
        if DOT_F32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        scale = qk_scale
        if SOFTCAP:
            s, scale = _soft_cap(s * qk_scale, cap_log2e), 1.0
        if MASKED or WINDOWED:
            visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
            if WINDOWED:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        # the scale applied inside exp2's argument (one FMA an element), as max(s) * scale = max(s * scale)
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
        m_exp = m_new
        if WINDOWED:   # a query with no key of its window seen yet: -inf - -inf would be NaN (p, alpha: 0)
            m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s * scale - m_exp[:, None])
        alpha = tl.math.exp2(m_i - m_exp)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _load_kv(v_src, row, offs_n, v_stride, col, cols, k_ok, v_scale_ptr, dtype, DEQUANT, MASKED, TMA)
        if DOT_F32:
            acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(p.to(dtype), v, acc)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["bt_stride"])   # the block tables' width changes from step to step
def _prefill_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, o_ptr, cu_q_ptr, cu_k_ptr, bt_ptr, k_scale_ptr,
                    v_scale_ptr, q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                    kc_stride_t, kc_stride_h, vc_stride_t, vc_stride_h, o_stride_t, o_stride_h, bt_stride,
                    qk_scale, window, cap_log2e, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
                    DEQUANT: tl.constexpr, FROM_PAGES: tl.constexpr, DOT_F32: tl.constexpr, TMA: tl.constexpr,
                    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    # grid: (num_heads, num_seqs, query tiles of the longest sequence), the last tiles first.
    # k/v: this step's new keys, in the rows of q; kc/vc: the paged cache (PAGED). A paged step reads
    # each sequence's earlier keys from the pages and its new ones from k/v, unless FROM_PAGES (an FP8
    # cache: the new keys too are read back from the pages, rounded through e4m3 as decode sees them).
    # TMA: k, v, kc, vc are tensor descriptors of [rows, num_kv_heads * head_dim] (Hopper's bulk copies)
    # rather than pointers; a KV head's keys are its HEAD_DIM columns.
    head = tl.program_id(0)
    seq = tl.program_id(1)
    m_block = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    k_len = tl.load(cu_k_ptr + seq + 1) - tl.load(cu_k_ptr + seq)
    kv_head = head // GROUP
    bt_ptr += seq.to(tl.int64) * bt_stride
    col = kv_head * HEAD_DIM   # the KV head's columns in a descriptor's rows
    if not TMA:   # pointers: at the KV head
        k_ptr += kv_head * k_stride_h
        v_ptr += kv_head * v_stride_h
        kc_ptr += kv_head * kc_stride_h
        vc_ptr += kv_head * vc_stride_h
    prefix = k_len - q_len   # keys before this step's queries: a cached prefix or earlier chunks

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    q_ok = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * q_stride_t + head * q_stride_h + cols[None, :],
                mask=q_ok[:, None], other=0.0)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PAGED:
        if not FROM_PAGES:   # the earlier keys, from the pages: every query sees all of them
            full = prefix // BLOCK_N * BLOCK_N
            acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, kc_ptr, vc_ptr, bt_ptr, 0, kc_stride_t,
                                          vc_stride_t, col, k_scale_ptr, v_scale_ptr, 0, full,
                                          prefix + offs_m, prefix, qk_scale, cols, window, cap_log2e, False,
                                          True, PAGE, DEQUANT, BLOCK_N, DOT_F32, TMA, WINDOWED, SOFTCAP)
            acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, kc_ptr, vc_ptr, bt_ptr, 0, kc_stride_t,
                                          vc_stride_t, col, k_scale_ptr, v_scale_ptr, full, prefix,
                                          prefix + offs_m, prefix, qk_scale, cols, window, cap_log2e, True,
                                          True, PAGE, DEQUANT, BLOCK_N, DOT_F32, TMA, WINDOWED, SOFTCAP)
    # Then the new keys, counted from base: from k/v (base 0), or with an FP8 cache all keys from the
    # pages (base = prefix: the loops below cover the earlier keys too). Every key left of the tile's
    # first query is seen by all its queries (no mask); the tiles on the diagonal are masked.
    base = 0
    if FROM_PAGES:
        base, k_ptr, v_ptr, k_stride_t, v_stride_t = prefix, kc_ptr, vc_ptr, kc_stride_t, vc_stride_t
    q_pos = base + offs_m
    diag = (base + m_block * BLOCK_M) // BLOCK_N * BLOCK_N
    end = tl.minimum(base + q_len, base + (m_block + 1) * BLOCK_M)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_ptr, v_ptr, bt_ptr, q_start, k_stride_t, v_stride_t,
                                  col, k_scale_ptr, v_scale_ptr, 0, diag, q_pos, base + q_len, qk_scale,
                                  cols, window, cap_log2e, False, FROM_PAGES, PAGE, DEQUANT, BLOCK_N, DOT_F32,
                                  TMA, WINDOWED, SOFTCAP)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_ptr, v_ptr, bt_ptr, q_start, k_stride_t, v_stride_t,
                                  col, k_scale_ptr, v_scale_ptr, diag, end, q_pos, base + q_len, qk_scale,
                                  cols, window, cap_log2e, True, FROM_PAGES, PAGE, DEQUANT, BLOCK_N, DOT_F32,
                                  TMA, WINDOWED, SOFTCAP)
    out = acc / l_i[:, None]
    tl.store(o_ptr + q_rows[:, None] * o_stride_t + head * o_stride_h + cols[None, :],
             out.to(o_ptr.dtype.element_ty), mask=q_ok[:, None])


# (BLOCK_M, BLOCK_N, num_warps, num_stages). head_dim 128, from benchmarks/prefill_attn_probe.py
# (docs/attention.md): steps that read pages (a cached prefix or earlier chunks) and new prompts of a
# few thousand tokens run best with 128 x 128 tiles, 8 warps, 3 stages (H100, 2026-12-06: chunks after
# prefixes 377 TFLOP/s against 354 with 2 stages); short ones (bench.py's 100-1,024) with 64 x 64 tiles
# and 4 warps. Other head dims: untimed first choices.
TILES_128 = {"paged": (128, 128, 8, 3), "long": (128, 128, 8, 3), "short": (64, 64, 4, 3)}
TILES = {64: (128, 64, 4, 3), 256: (64, 32, 4, 2)}
# Keys and values read through tensor descriptors (the TMA unit's bulk copies) on Hopper and later
# (compute capability 9+), where the rows are laid out as the descriptors need; else plain loads. H100,
# 2026-12-06: steps over pages 403 against 372 TFLOP/s, the long workload 1.024x (docs/attention.md).
TMA = envs.PREFILL_TMA.get()
# compile_variants in threads beside the warm-up forward (Triton's compiler releases the GIL). Cold
# start-up of the 0.6B engine on an H100 (startup_compiles.py, empty Triton cache): 10.4 s one after
# another, 7.1 s in threads.
PARALLEL_COMPILE = envs.PARALLEL_COMPILE.get()
SHORT_PROMPT = 2048   # the longest query span that takes the "short" tile


def tiles_for(head_dim: int, page: int | None, interpreted: bool,
              max_seqlen_q: int = 0) -> tuple[int, int, int, int]:
    """The kernel's tile for this head_dim and step; page: the cache page when the step reads the pages
    (BLOCK_N then shrinks until it divides it), None when it reads the new tokens' k, v."""
    if interpreted:
        return 16, 16, 4, 1
    if head_dim == 128:
        kind = "paged" if page else "long" if max_seqlen_q > SHORT_PROMPT else "short"
        block_m, block_n, warps, stages = TILES_128[kind]
    else:
        block_m, block_n, warps, stages = TILES.get(head_dim, (64, 32, 4, 2))
    while page and page % block_n:
        block_n //= 2
    return block_m, block_n, warps, stages


def fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """What the kernel runs: fp16/bf16 queries, head_dim a power of two from 16 to 256, and a cache
    page of a multiple of 16 tokens (FP8 caches included)."""
    head_dim = q.shape[-1]
    page_ok = k_cache.dim() != 4 or k_cache.shape[1] % 16 == 0
    return (q.dtype in (torch.float16, torch.bfloat16) and 16 <= head_dim <= 256
            and head_dim & (head_dim - 1) == 0 and page_ok)


def _descriptors(block_n: int, *kv: torch.Tensor) -> list | None:
    """Each [rows, num_kv_heads, head_dim] (or [num_blocks, page, num_kv_heads, head_dim]) tensor as a
    descriptor of [rows, num_kv_heads * head_dim] tiles of [block_n, head_dim]; None where one can't be."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    out = []
    for x in kv:
        x2 = x.view(-1, x.shape[-2], x.shape[-1]) if x.dim() == 4 else x
        rows, heads, head_dim = x2.shape
        if x2.stride(2) != 1 or x2.stride(1) != head_dim or (x2.stride(0) * x2.element_size()) % 16 \
                or x2.data_ptr() % 16:
            return None
        out.append(TensorDescriptor(x2, [rows, heads * head_dim], [x2.stride(0), 1], [block_n, head_dim]))
    return out


def prefill_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             k_cache: torch.Tensor, v_cache: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                             max_seqlen_q: int, max_seqlen_k: int,
                             block_tables: torch.Tensor | None, scale: float,
                             kv_slots: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                             v_scale: torch.Tensor | None = None, tiles: tuple | None = None,
                             tma: bool | None = None, *, window: int = 0,
                             softcap: float = 0.0) -> torch.Tensor:
    # The interface of kernels.prefill_attention: q: [total_q, num_heads, head_dim]; k, v: [total_q,
    # num_kv_heads, head_dim], already stored in the cache; k_cache, v_cache: [num_blocks, block_size,
    # num_kv_heads, head_dim] -> [total_q, num_heads, head_dim]. Only where fits(q, k_cache).
    # kv_slots is not needed: the pages are read through block_tables. window > 0: a sliding window
    # of that many keys; softcap > 0: scores soft-capped (reference.soft_cap).
    total_q, num_heads, head_dim = q.shape
    num_seqs = cu_seqlens_q.numel() - 1
    out = torch.empty_like(q)
    if total_q == 0 or num_seqs == 0:
        return out
    paged = block_tables is not None
    num_kv_heads = k.shape[1]
    if paged:
        page = k_cache.shape[1]
        k_pages, v_pages = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
        bt, bt_stride = block_tables, block_tables.stride(0)
    else:
        page, k_pages, v_pages, bt, bt_stride = None, k, v, cu_seqlens_q, 0
    dequant = k_pages.dtype == torch.float8_e4m3fn
    if dequant and (k_scale is None or v_scale is None):
        raise ValueError("an FP8 KV cache needs k_scale and v_scale")
    # Under the interpreter (CPU tests) a bf16 tl.dot is not emulated correctly: the tiles go through fp32.
    interpreted = runs_interpreted(q.device)
    block_m, block_n, warps, stages = tiles or tiles_for(head_dim, page, interpreted, max_seqlen_q)
    if paged and page % block_n:
        raise ValueError(f"BLOCK_N {block_n} must divide the cache page ({page} tokens): a tile of keys "
                         "may not cross a page")
    grid = (num_heads, num_seqs, triton.cdiv(max_seqlen_q, block_m))
    kv = (k, v, k_pages, v_pages)
    # tma: None follows TMA where the GPU has the unit (the interpreter runs descriptors only when asked)
    if tma is None:
        tma = TMA and not interpreted and torch.cuda.get_device_capability(q.device)[0] >= 9
    # descriptors of k and v, and of the pages where the step reads them (else the pages are k and v)
    descs = _descriptors(block_n, *kv[:4 if paged else 2]) if tma else None
    if descs and not paged:
        descs *= 2
    _prefill_kernel[grid](
        q, *(descs or kv), out, cu_seqlens_q, cu_seqlens_k, bt,
        k_scale if dequant else q, v_scale if dequant else q,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pages.stride(0), k_pages.stride(1), v_pages.stride(0), v_pages.stride(1),
        out.stride(0), out.stride(1), bt_stride, scale * LOG2E, window, (softcap or 1.0) * LOG2E,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        PAGED=paged, PAGE=page or 1, DEQUANT=dequant, FROM_PAGES=paged and dequant, DOT_F32=interpreted,
        TMA=descs is not None, WINDOWED=window > 0, SOFTCAP=softcap > 0,
        num_warps=warps, num_stages=stages)
    return out


def prefill_attention_triton_or_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                      k_cache: torch.Tensor, v_cache: torch.Tensor, *args) -> torch.Tensor:
    """kernels.prefill_attention's interface: the Triton kernel where it fits (CUDA, fp16/bf16, ...),
    else kernels.prefill_attention (torch's FlashAttention-2, or the reference)."""
    fn = prefill_attention_triton if q.is_cuda and fits(q, k_cache) else prefill_attention
    return fn(q, k, v, k_cache, v_cache, *args)


def compile_variants(num_heads: int, num_kv_heads: int, head_dim: int, page: int, dtype: torch.dtype,
                     kv_dtype: torch.dtype, device: torch.device,
                     forward_max_q: int = 0) -> Callable[[], None]:
    """Run each tile variant a step may take once, on tiny inputs with the engine's strides (new short
    and long prompts, and a step that reads the pages in kv_dtype), so that none compiles mid-run.
    Variants that share a tile run once, and the one of new prompts of forward_max_q tokens is left
    out: the caller's own forward (the warm-up's) compiles it. Returns the function that waits for
    them: with PARALLEL_COMPILE on CUDA they run in threads, beside whatever the caller does next
    (the warm-up forward); else here, one after another."""
    q = torch.zeros(2, num_heads, head_dim, dtype=dtype, device=device)
    k = torch.zeros(2, num_kv_heads, head_dim, dtype=dtype, device=device)
    cache = torch.zeros(1, page, num_kv_heads, head_dim, dtype=kv_dtype, device=device)
    if not fits(q, cache):
        return lambda: None
    cu, table, one = (torch.tensor(x, dtype=dt, device=device) for x, dt in
                      (([0, 2], torch.int32), ([[0]], torch.int32), ([1.0], torch.float32)))

    def run(max_q: int, paged: bool):
        prefill_attention_triton(q, k, k, cache, cache, cu, cu, max_q, max_q, table if paged else None,
                                 1.0, None, one, one)

    def tile(max_q: int, paged: bool):   # what tells the compiled variants apart (on the GPU)
        return tiles_for(head_dim, page if paged else None, False, max_q), paged
    seen = {tile(forward_max_q, False)} if forward_max_q else set()
    variants = []
    for v in ((2, False), (SHORT_PROMPT + 1, False), (2, True)):
        if tile(*v) not in seen:
            seen.add(tile(*v))
            variants.append(v)
    if PARALLEL_COMPILE and device.type == "cuda":
        return in_threads([functools.partial(run, *v) for v in variants], device)
    for v in variants:
        run(*v)
    return lambda: None
