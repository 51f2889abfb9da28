"""Integer weights packed into int32 words: the one form every W4A16 / W8A16 format is turned into
after loading (quantization/wna16.py), and the torch reference of kernels/wna16_gemm.py. Values v in
[0, 2^bits) with a zero point z in the same range and a float scale s, w = (v - z) * s, one (z, s)
per group of input rows and output column.

Packing: word j along a dim holds entries j * p + i (p = 32 / bits) in bits [i * bits, (i + 1) * bits)
(GPTQ's qweight along the input dim and qzeros along the output dim; compressed-tensors' weight_packed
and zero points). AWQ's GEMM layout permutes the entries inside each word (quantization/awq.py)."""
import torch


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their values in [0, 2^bits), int32, dim p times as long."""
    p = 32 // bits
    dim = dim % packed.dim()
    shape = [1] * (packed.dim() + 1)
    shape[dim + 1] = p
    shifts = (torch.arange(p, device=packed.device, dtype=torch.int32) * bits).view(shape)
    values = (packed.unsqueeze(dim + 1) >> shifts) & ((1 << bits) - 1)   # >> is arithmetic: mask after
    return values.flatten(dim, dim + 1)


def pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Values in [0, 2^bits) -> int32 words along dim (its length a multiple of 32 / bits)."""
    p = 32 // bits
    dim = dim % values.dim()
    assert values.shape[dim] % p == 0
    grouped = values.to(torch.int64).unflatten(dim, (values.shape[dim] // p, p))
    shape = [1] * grouped.dim()
    shape[dim + 1] = p
    shifts = (torch.arange(p, device=values.device, dtype=torch.int64) * bits).view(shape)
    words = (grouped << shifts).sum(dim + 1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)   # two's complement


def group_of_rows(g_idx: torch.Tensor | None, k: int, group: int | None, device) -> torch.Tensor:
    """[k] the scale group of each input row: g_idx (act order), row // group, or 0 (per channel)."""
    if g_idx is not None:
        return g_idx.long()
    rows = torch.arange(k, device=device)
    return rows // group if group is not None else torch.zeros_like(rows)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor | None,
               bits: int, group: int | None, dtype: torch.dtype) -> torch.Tensor:
    """The weight W [N, K] in dtype from the packed form: qweight [K / p, N] int32 (packed along K),
    scales [G, N] float32, zeros [G, N] int32, g_idx [K] or None. (v - z) is a small integer and s a
    float32, so the product is exact in float32, rounded once to dtype."""
    v = unpack(qweight, bits, 0)                                   # [K, N]
    groups = group_of_rows(g_idx, v.shape[0], group, v.device)
    w = (v - zeros[groups]).to(torch.float32) * scales[groups]    # [K, N]
    return w.t().to(dtype)


def quantize_symmetric(w: torch.Tensor, bits: int, group: int | None):
    """Round-to-nearest with zero point 2^(bits-1) (dummy weights, benchmarks): w [N, K] ->
    (qweight [K / p, N], scales [G, N] float32, zeros [G, N] int32)."""
    n, k = w.shape
    g = group or k
    mid = 1 << (bits - 1)
    wg = w.float().t().reshape(k // g, g, n)                        # [G, g, N]
    scales = (wg.abs().amax(dim=1) / (mid - 1)).clamp(min=1e-8)     # [G, N]
    v = (torch.round(wg / scales.unsqueeze(1)) + mid).clamp(0, 2 * mid - 1).to(torch.int32).reshape(k, n)
    return pack(v, bits, 0), scales, torch.full_like(scales, mid, dtype=torch.int32)
