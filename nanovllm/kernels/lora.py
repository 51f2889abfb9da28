"""Batched LoRA for a step whose tokens run under different adapters (punica's / S-LoRA's
shrink-expand): y[t] += B[s] (A[s] x[t]) for each token t of adapter slot s = slots[t] (-1: the base
model, nothing added). A layer's adapters live in fixed slot buffers:
  a: [num_slots, R, in]  the slots' A matrices (R = the layer's slices x max_lora_rank, zero-padded)
  b: [out, num_slots, R] the slots' B matrices, scale (lora_alpha / r) folded in.

A layer of unquantized weights without a bias keeps every slot's A as extra rows under its weight
(lora/layers.py), so one cuBLAS GEMM gives x W^T and every slot's A x side by side ("folded"):
[T, out + num_slots x R].
expand_folded then writes each token's base columns plus B[s] times its slot's columns (at
Qwen3-0.6B's shapes the extra rows cost the GEMM a few % and save a shrink kernel a layer). An FP8 or
biased layer runs the shrink kernel instead: it gathers each tile's rows of x into fp32 partials
[splits, tokens, R], the input features split over several programs when the tokens are few, as
in decode (a prefill step's shrink is one cuBLAS GEMM for every slot), and the expand adds into y.

The Triton kernels group the tokens by slot once per step (LoRABatch, which also numbers each
group's tiles of block_m tokens, so the grid is the tiles there can be, not tiles x slots), the
base model's tokens last (the folded expand copies their base columns), and give each program a
tile of one group's tokens. The grid is fixed by the token count, so the decode CUDA graphs replay
it for any mix of adapters; the few programs past the last tile do no work.
The torch path (CPU, and the oracle) multiplies by every slot's matrices and masks the other slots'
columns to zero: the same sums, exact, with no host sync."""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.common import interpreted

BLOCK_K = 64    # shrink: input features per iteration
SHRINK_SPLITS = 8   # shrink: the most programs one tile's input features are split over
SHRINK_WARPS = 2    # decode's shrink programs (16 tokens x 64 features a dot)
# expand: output features per program and warps, for decode's 16-token tiles and prefill's 64-token ones
EXPAND_TILE = {16: (64, 4), 64: (128, 4)}


def block_m(num_tokens: int) -> int:
    """Tokens per program: small tiles for decode's few tokens, larger ones (each B tile read
    for more rows) for prefill."""
    return 16 if num_tokens <= 1024 else 64


class LoRABatch(NamedTuple):
    """One step's tokens by adapter slot, computed once and read by every LoRA layer. Group s <
    num_slots is slot s's tokens, group num_slots the base model's."""
    slots: torch.Tensor        # [T] slot of each token, -1: base model
    order: torch.Tensor        # [T] int64 the tokens grouped by slot, the base model's last
    starts: torch.Tensor       # [num_slots + 2] int32 group g's tokens are order[starts[g]:starts[g + 1]]
    tile_starts: torch.Tensor  # [num_slots + 2] int32 group g's token tiles are programs
                               # tile_starts[g]..tile_starts[g + 1] - 1 (block_m tokens each)
    block_m: int

    @classmethod
    def of(cls, slots: torch.Tensor, num_slots: int) -> "LoRABatch":
        """Elementwise ops and cumulative sums only (no sort, no host sync): recorded into the
        decode CUDA graphs with slots as their input."""
        num_tokens, bm, dev = slots.numel(), block_m(slots.numel()), slots.device
        group = torch.where(slots >= 0, slots, num_slots)
        mask = group.reshape(-1, 1) == torch.arange(num_slots + 1, device=dev)   # [T, groups]
        cum = mask.cumsum(0)
        starts = torch.zeros(num_slots + 2, dtype=torch.int64, device=dev)
        starts[1:] = cum[-1].cumsum(0)
        tile_starts = torch.zeros(num_slots + 2, dtype=torch.int64, device=dev)
        tile_starts[1:] = ((cum[-1] + bm - 1) // bm).cumsum(0)
        # token t of group g goes to starts[g] + (its rank among group g's tokens)
        dest = ((starts[:-1] + cum - 1) * mask).sum(1)
        order = torch.empty(num_tokens, dtype=torch.int64, device=dev)
        order.scatter_(0, dest, torch.arange(num_tokens, device=dev))
        return cls(slots, order, starts.to(torch.int32), tile_starts.to(torch.int32), bm)

    @staticmethod
    def max_tiles(num_tokens: int, num_groups: int) -> int:
        """The programs that cover the first num_groups groups' tiles, whatever the mix: each
        group's last tile may be partial."""
        return triton.cdiv(num_tokens, block_m(num_tokens)) + num_groups


@triton.jit
def _tile(pid, order_ptr, starts_ptr, tile_starts_ptr, NUM_GROUPS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program pid's group (slot; num_slots: the base model) and tokens among the first NUM_GROUPS
    groups: (group, token ids, row mask, whether it has any)."""
    s = pid * 0
    for j in tl.static_range(1, NUM_GROUPS):
        s += (pid >= tl.load(tile_starts_ptr + j)).to(tl.int32)
    first = tl.load(starts_ptr + s) + (pid - tl.load(tile_starts_ptr + s)) * BLOCK_M
    end = tl.load(starts_ptr + s + 1)
    active = pid < tl.load(tile_starts_ptr + NUM_GROUPS)   # programs past the last tile: none
    end = tl.where(active, end, first)
    idx = first + tl.arange(0, BLOCK_M)
    rmask = idx < end
    tok = tl.load(order_ptr + idx, mask=rmask, other=0).to(tl.int64)
    return s, tok, rmask, first < end


@triton.jit(do_not_specialize=["num_tokens"])
def _shrink_kernel(x_ptr, a_ptr, h_ptr, order_ptr, starts_ptr, tile_starts_ptr, num_tokens, K, R, x_stride,
                   a_stride_s, a_stride_r, h_stride, h_stride_split, K_PER_SPLIT, NUM_SLOTS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, FP32: tl.constexpr):
    # Program (token tile, K split): its share of the input features, into its own partial of h
    # (the expand kernel sums the partials: no atomics, and the same sums whatever the timing).
    s, tok, rmask, active = _tile(tl.program_id(0), order_ptr, starts_ptr, tile_starts_ptr, NUM_SLOTS,
                                  BLOCK_M)   # the slots' groups only
    split = tl.program_id(1)
    r = tl.arange(0, BLOCK_R)
    k_begin = split * K_PER_SPLIT
    k_end = tl.where(active, tl.minimum(k_begin + K_PER_SPLIT, K), k_begin)   # no tokens: no work
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    a_base = a_ptr + s.to(tl.int64) * a_stride_s
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < k_end
        x = tl.load(x_ptr + tok[:, None] * x_stride + k[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0)
        a = tl.load(a_base + r[None, :] * a_stride_r + k[:, None], mask=(r < R)[None, :] & kmask[:, None],
                    other=0.0)
        if FP32:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x.to(a.dtype), a)
    tl.store(h_ptr + split * h_stride_split + tok[:, None] * h_stride + r[None, :], acc,
             mask=rmask[:, None] & (r < R)[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _expand_kernel(h_ptr, b_ptr, base_ptr, y_ptr, order_ptr, starts_ptr, tile_starts_ptr, num_tokens, N, R,
                   h_stride, h_stride_split, h_stride_slot, splits, b_stride_n, b_stride_s, base_stride,
                   y_stride, NUM_SLOTS: tl.constexpr, NUM_GROUPS: tl.constexpr, ADD_Y: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, FP32: tl.constexpr):
    # Program (token tile, block of output features): y = base + h B^T for the tile's rows (ADD_Y:
    # y += that). h: the shrink's fp32 partials, or every slot's columns side by side (h_stride_slot
    # = R: this tile's slot's are read). A base-model tile (group NUM_SLOTS) adds nothing.
    s, tok, rmask, active = _tile(tl.program_id(0), order_ptr, starts_ptr, tile_starts_ptr, NUM_GROUPS,
                                  BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < tl.where(active, N, 0)   # no tokens: no loads
    rvalid = r < tl.where(s < NUM_SLOTS, R, 0)   # a base-model tile: no h or B
    hmask = rmask[:, None] & rvalid[None, :]
    h_rows = h_ptr + s.to(tl.int64) * h_stride_slot + tok[:, None] * h_stride + r[None, :]
    h = tl.load(h_rows, mask=hmask, other=0.0).to(tl.float32)
    for split in range(1, splits):
        h += tl.load(h_rows + split * h_stride_split, mask=hmask, other=0.0)
    b = tl.load(b_ptr + s.to(tl.int64) * b_stride_s + n[None, :] * b_stride_n + r[:, None],
                mask=rvalid[:, None] & nmask[None, :], other=0.0)
    if FP32:
        acc = tl.dot(h, b.to(tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(h.to(b.dtype), b)
    mask = rmask[:, None] & nmask[None, :]
    acc += tl.load(base_ptr + tok[:, None] * base_stride + n[None, :], mask=mask, other=0.0).to(tl.float32)
    y_ptrs = y_ptr + tok[:, None] * y_stride + n[None, :]
    if ADD_Y:
        acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def lora_triton(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch):
    """y += the slots' LoRA of x, in place (see the module docstring). x: [T, in], y: [T, out]
    with unit column stride."""
    x2 = _rows(x)
    num_tokens, num_slots, R, K = x2.size(0), a.size(0), a.size(1), a.size(2)
    assert y.stride(-1) == 1 and a.stride(2) == 1 and b.stride(2) == 1
    fp32 = a.dtype == torch.float32   # fp32 weights: exact fp32 dots; else the dtype's tensor cores
    tiles, bm = LoRABatch.max_tiles(num_tokens, num_slots), batch.block_m
    if bm == 64 and not fp32:
        # prefill: one cuBLAS GEMM for every slot's A (num_slots x R columns, a few % of the layer's
        # own GEMM) beats the gathered shrink; the expand reads each tile's slot's columns
        h = x2.to(a.dtype) @ a.view(num_slots * R, K).t()
        h_strides, splits = (h.stride(0), 0, R), 1
    else:
        # Few tokens (decode): split the input features over programs too, so more SMs share the work.
        splits = max(1, min(SHRINK_SPLITS, triton.cdiv(K, 4 * BLOCK_K), triton.cdiv(1024, tiles)))
        per_split = triton.cdiv(triton.cdiv(K, splits), BLOCK_K) * BLOCK_K
        splits = triton.cdiv(K, per_split)
        h = torch.empty(splits, num_tokens, R, dtype=torch.float32, device=x.device)   # [split, token, r]
        _shrink_kernel[(tiles, splits)](
            x2, a, h, batch.order, batch.starts, batch.tile_starts, num_tokens, K, R, x2.stride(0),
            a.stride(0), a.stride(1), h.stride(1), h.stride(0), per_split, NUM_SLOTS=num_slots, BLOCK_M=bm,
            BLOCK_R=max(16, triton.next_power_of_2(R)), BLOCK_K=BLOCK_K, FP32=fp32, num_warps=SHRINK_WARPS)
        h_strides = (h.stride(1), h.stride(0), 0)
    _expand(h, h_strides, splits, b, y, y, batch, num_slots, add_y=False)
    return y


def _expand(h, h_strides, splits, b, base, y, batch: LoRABatch, num_groups: int, add_y: bool):
    """The expand kernel over the first num_groups groups' tiles: y (+)= base + h B^T."""
    num_tokens, N, num_slots, R = y.size(0), y.size(1), b.size(1), b.size(2)
    block_n, warps = EXPAND_TILE[batch.block_m]
    _expand_kernel[(LoRABatch.max_tiles(num_tokens, num_groups), triton.cdiv(N, block_n))](
        h, b, base, y, batch.order, batch.starts, batch.tile_starts, num_tokens, N, R, *h_strides, splits,
        b.stride(0), b.stride(1), base.stride(0), y.stride(0), NUM_SLOTS=num_slots, NUM_GROUPS=num_groups,
        ADD_Y=add_y, BLOCK_M=batch.block_m, BLOCK_R=max(16, triton.next_power_of_2(R)), BLOCK_N=block_n,
        FP32=b.dtype == torch.float32, num_warps=warps)


def expand_folded_triton(yf: torch.Tensor, b: torch.Tensor, batch: LoRABatch,
                         y: torch.Tensor | None = None) -> torch.Tensor:
    """expand_folded's kernel: the base-model tokens' tiles run too (they copy their base columns)."""
    num_slots, R, out = b.size(1), b.size(2), b.size(0)
    assert yf.stride(-1) == 1 and b.stride(2) == 1 and (y is None or y.stride(-1) == 1)
    dest = torch.empty(yf.size(0), out, dtype=yf.dtype, device=yf.device) if y is None else y
    _expand(yf[:, out:], (yf.stride(0), 0, R), 1, b, yf, dest, batch, num_slots + 1, add_y=y is not None)
    return dest


def expand_folded(yf: torch.Tensor, b: torch.Tensor, batch: LoRABatch,
                  y: torch.Tensor | None = None) -> torch.Tensor:
    """yf = x [W; A_0; ...; A_last]^T: [T, out + num_slots x R], the base output and then every
    slot's A x. Returns each token's base columns plus B[slot] times its slot's columns, [T, out]:
    a new tensor, or added into y when given (a residual; in place on CUDA). Triton on CUDA, torch
    elsewhere."""
    if interpreted(yf.device):
        out = b.size(0)
        lora = yf[:, :out] + _lora_of(yf[:, out:], b, batch.slots).to(yf.dtype)
        return lora if y is None else y + lora
    return expand_folded_triton(yf, b, batch, y)


def _lora_of(h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The torch path's sum: each token's B[slot] times its slot's columns of h [T, num_slots x R]
    (every slot's A x), the other slots' columns masked to zero."""
    num_slots, R = b.size(1), b.size(2)
    mask = (slots.reshape(-1, 1) == torch.arange(num_slots, device=h.device)).to(h.dtype)   # [T, slots]
    h = (h.reshape(-1, num_slots, R) * mask.unsqueeze(-1)).reshape(-1, num_slots * R)
    return h @ b.reshape(b.size(0), num_slots * R).t()


def lora_reference(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
    """The torch path: y + the slots' LoRA of x (a new tensor)."""
    num_slots, R, K = a.shape
    h = x.reshape(-1, K).to(a.dtype) @ a.reshape(num_slots * R, K).t()   # [T, num_slots * R]
    return y + _lora_of(h, b, slots).to(y.dtype)


def apply_lora(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               batch: LoRABatch) -> torch.Tensor:
    """y plus the slots' LoRA of x: Triton on CUDA (in place), torch elsewhere."""
    if interpreted(x.device):
        return lora_reference(x, y, a, b, batch.slots)
    return lora_triton(x, y, a, b, batch)
