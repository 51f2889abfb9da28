"""Fused temperature sampling: one pass over the logits, no fp32 copy, no noise tensor.

Gumbel-max: argmax_i(logits_i / T + g_i), g_i = -log(-log(u_i)), u_i ~ U(0, 1), picks token i with
probability softmax(logits / T)_i; it is the sampler's exponential race argmax(p_i / E_i) in log
space (E_i = -log(u_i)). The uniforms come from Triton's counter-based Philox, keyed by a per-row
seed, so a row's token depends only on its logits, temperature and seed, never on the batch.

Each row's vocabulary is cut into chunks of whole loop steps, one program per (row, chunk), so that
a small batch still fills the GPU (one program per row would leave most SMs idle). Each program
keeps its chunk's best score and column; a second small kernel takes the row's best. Chunks change
neither the draws (a column's uniform depends on its index only) nor the winner (the lowest column
wins ties, within and across chunks).

An optional token bitmask (structured outputs) makes the columns it forbids -inf before scoring, so
they are never picked; a forbidden column costs the same as an allowed one, so the draws of the
allowed columns do not change.
"""
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

import nanovllm.envs as envs
from nanovllm.kernels.common import num_sms

# Columns per loop step are 4 * QUARTER: one Philox call gives four uniforms per counter. The
# draw for a given seed depends on this constant (it maps counters to columns), so keep it fixed.
QUARTER = 1024
NUM_WARPS = 8
FAST_LOG = envs.SAMPLING_FAST_LOG.get() # on CUDA, logs by the hardware approximation (lg2.approx), see _log
PHILOX_ROUNDS = envs.PHILOX_ROUNDS.get() # Philox4x32-10, as cuRAND and torch use (a tuning knob: 7 is faster)
MAX_CHUNKS = 64                      # chunks per row at most (one block in the picking kernel)
U_MIN = tl.constexpr(1e-10)          # u clamped to [U_MIN, U_MAX]: -log(-log(u)) stays finite
U_MAX = tl.constexpr(1.0 - 1e-7)


@triton.jit
def _log(x, FAST: tl.constexpr):
    # FAST: the GPU's approximate log (about 2^-22 absolute error, two instructions) instead of
    # libdevice's exact logf (about twenty). The kernel spends its time on arithmetic, and the
    # noise's own resolution is coarser: u near 1 is an fp32 with 2^-24 steps. The interpreter
    # has no libdevice.
    if FAST:
        return libdevice.fast_logf(x)
    else:
        return tl.log(x)


@triton.jit
def _scan(row_ptr, mask_row_ptr, cols, vocab, bits, best, best_col, inv_t, noise_weight,
          FAST_LOG: tl.constexpr, HAS_MASK: tl.constexpr):
    """Score the columns `cols` (logits / T + Gumbel noise from the random `bits`) and keep each
    lane's best. Strict >: a lane sees its columns in increasing order, so the lowest index wins
    ties, like torch.argmax. With HAS_MASK, columns whose bit is 0 score -inf."""
    x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        word = tl.load(mask_row_ptr + cols // 32, mask=cols < vocab, other=0)
        x = tl.where(((word >> (cols % 32)) & 1) != 0, x, float("-inf"))
    u = tl.minimum(tl.maximum(tl.uint_to_uniform_float(bits), U_MIN), U_MAX)
    score = x * inv_t + noise_weight * -_log(-_log(u, FAST_LOG), FAST_LOG)
    take = score > best
    return tl.where(take, score, best), tl.where(take, cols, best_col)


# Not specialised on steps_per_chunk (it changes with the batch size), so a run compiles no new
# variant when its batch shrinks.
@triton.jit(do_not_specialize=["steps_per_chunk"])
def _gumbel_max_kernel(logits_ptr, temp_ptr, seed_ptr, best_ptr, col_ptr, mask_ptr, vocab, stride,
                       mask_stride, offset, steps_per_chunk, QUARTER: tl.constexpr,
                       FAST_LOG: tl.constexpr, ROUNDS: tl.constexpr, HAS_MASK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temp = tl.load(temp_ptr + row)
    seed = tl.load(seed_ptr + row)
    # Greedy rows (T = 0) score the plain logits: scale 1, no noise.
    inv_t = 1.0 / tl.where(temp > 0, temp, 1.0)
    noise_weight = tl.where(temp > 0, 1.0, 0.0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    mask_row_ptr = mask_ptr + row.to(tl.int64) * mask_stride
    lanes = tl.arange(0, QUARTER)
    zero = tl.zeros([QUARTER], tl.uint32)
    best = tl.full([QUARTER], float("-inf"), tl.float32)
    best_col = tl.zeros([QUARTER], tl.int32)
    first = chunk * steps_per_chunk * 4 * QUARTER
    for start in range(first, tl.minimum(first + steps_per_chunk * 4 * QUARTER, vocab), 4 * QUARTER):
        # Philox counter (start / 4 + lane, offset) gives the four uniforms of columns
        # start + k * QUARTER + lane, k = 0..3: every column has its own counter and word.
        counter = (start // 4 + lanes).to(tl.uint32)
        r0, r1, r2, r3 = tl.philox(seed, counter, zero + offset, zero, zero, ROUNDS)
        best, best_col = _scan(row_ptr, mask_row_ptr, start + lanes, vocab, r0, best, best_col,
                               inv_t, noise_weight, FAST_LOG, HAS_MASK)
        best, best_col = _scan(row_ptr, mask_row_ptr, start + QUARTER + lanes, vocab, r1, best, best_col,
                               inv_t, noise_weight, FAST_LOG, HAS_MASK)
        best, best_col = _scan(row_ptr, mask_row_ptr, start + 2 * QUARTER + lanes, vocab, r2, best, best_col,
                               inv_t, noise_weight, FAST_LOG, HAS_MASK)
        best, best_col = _scan(row_ptr, mask_row_ptr, start + 3 * QUARTER + lanes, vocab, r3, best, best_col,
                               inv_t, noise_weight, FAST_LOG, HAS_MASK)
    top = tl.max(best, axis=0)
    tl.store(best_ptr + row * tl.num_programs(1) + chunk, top)
    tl.store(col_ptr + row * tl.num_programs(1) + chunk,
             tl.min(tl.where(best == top, best_col, vocab), axis=0))


@triton.jit(do_not_specialize=["num_chunks"])
def _pick_chunk_kernel(best_ptr, col_ptr, out_ptr, vocab, num_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < num_chunks
    best = tl.load(best_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"))
    col = tl.load(col_ptr + row * num_chunks + offs, mask=mask, other=vocab)
    top = tl.max(best, axis=0)
    # A row whose scores are all -inf picks column 0, as torch.argmax does.
    token = tl.min(tl.where(best == top, col, vocab), axis=0)
    tl.store(out_ptr + row, tl.where(token < vocab, token, 0).to(tl.int64))


def gumbel_max_sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                      offset: int = 0, quarter: int = QUARTER, num_chunks: int | None = None,
                      bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [n, vocab] bf16/fp16/fp32, rows contiguous; temperatures: [n] fp32, 0 = greedy
    (argmax); seeds: [n] int64, the row's Philox key; offset: a second counter word, so one seed
    can serve independent draws (the sampler passes 0: its seeds are already per step); quarter:
    a power of two, columns per Philox stream per loop step (tests shrink it for the interpreter);
    num_chunks: programs per row (None: about four programs per SM in all); bitmask: [n,
    ceil(vocab / 32)] int32 or None, bit j of word w allows column 32w + j. Returns token_ids: [n]
    int64. No host sync."""
    n, vocab = logits.shape
    assert logits.stride(1) == 1 and temperatures.shape == (n,) and seeds.shape == (n,)
    assert temperatures.dtype == torch.float32 and seeds.dtype == torch.int64
    assert temperatures.is_contiguous() and seeds.is_contiguous()   # read as row-indexed arrays
    assert 0 <= offset < 2 ** 31 and quarter & (quarter - 1) == 0
    if bitmask is not None:
        assert bitmask.dtype == torch.int32 and bitmask.shape == (n, triton.cdiv(vocab, 32))
        assert bitmask.stride(1) == 1
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    steps = triton.cdiv(vocab, 4 * quarter)
    if num_chunks is None:
        num_chunks = triton.cdiv(4 * num_sms(logits.device), n)
    steps_per_chunk = triton.cdiv(steps, max(1, min(num_chunks, steps, MAX_CHUNKS)))
    num_chunks = triton.cdiv(steps, steps_per_chunk)   # none empty
    best = torch.empty(n, num_chunks, dtype=torch.float32, device=logits.device)
    cols = torch.empty(n, num_chunks, dtype=torch.int32, device=logits.device)
    mask = bitmask if bitmask is not None else seeds   # a pointer the kernel never reads
    _gumbel_max_kernel[(n, num_chunks)](logits, temperatures, seeds, best, cols, mask, vocab,
                                        logits.stride(0), mask.stride(0), offset, steps_per_chunk,
                                        QUARTER=quarter, FAST_LOG=FAST_LOG and logits.is_cuda,
                                        ROUNDS=PHILOX_ROUNDS, HAS_MASK=bitmask is not None,
                                        num_warps=NUM_WARPS)
    _pick_chunk_kernel[(n,)](best, cols, out, vocab, num_chunks, BLOCK=MAX_CHUNKS, num_warps=1)
    return out
