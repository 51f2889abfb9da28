"""FP8 (e4m3) weights in plain torch: quantizing a weight (block or per-channel scales), dequantizing
it, and quantizing activations per token group. The CPU path runs dequantize_weight + F.linear on
unquantized activations (what transformers computes on the dequantized model; fbgemm_fp8's
activation_scale_ub clips them); fp8_linear_ref adds the activation rounding of the GPU kernels and is
their oracle.

Scales are dequantization factors (w = w_fp8 * scale; HF names them weight_scale_inv). Shapes:
  block (bn, bk):  scale [ceil(N / bn), ceil(K / bk)], one per block of W [N, K]
  per channel:     scale [N, 1]
"""
import torch
import torch.nn.functional as F

from nanovllm.kernels.reference import FP8_MAX, quantize_fp8

MIN_SCALE = 1e-12                # an all-zero group keeps scale > 0 (its values quantize to 0)


def _expand(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """A block scale [ceil(N/bn), ceil(K/bk)] repeated to W's shape [N, K]."""
    bn, bk = block
    return scale.repeat_interleave(bn, 0)[:shape[0]].repeat_interleave(bk, 1)[:, :shape[1]]


def dequantize_weight(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                      dtype: torch.dtype) -> torch.Tensor:
    """w: [..., N, K] in FP8 (a leading expert dim too), scale as in the module notes -> w in dtype."""
    if w.dim() == 3:
        return torch.stack([dequantize_weight(we, se, block, dtype) for we, se in zip(w, scale)])
    s = scale.float() if block is None else _expand(scale.float(), w.shape, block)
    return (w.float() * s).to(dtype)


def _over_fp8_max(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448, correctly rounded as the kernels' div_rn (on CUDA, torch divides by a Python number
    as a multiplication by its reciprocal, which can differ in the last bit), at least MIN_SCALE."""
    return (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)


def quantize_weight(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [..., N, K] -> (w_fp8, scale float32): the scale of each block (or row) is its amax / 448."""
    if w.dim() == 3:
        pairs = [quantize_weight(we, block) for we in w]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    w = w.float()
    if block is None:
        scale = _over_fp8_max(w.abs().amax(dim=1, keepdim=True))
        return quantize_fp8(w, scale), scale
    n, k = w.shape
    bn, bk = block
    padded = F.pad(w, (0, -k % bk, 0, -n % bn))
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = _over_fp8_max(blocks.abs().amax(dim=(1, 3)))
    return quantize_fp8(w, _expand(scale, w.shape, block)), scale


def quantize_activations(x: torch.Tensor, group: int, scale_ub: float | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (x_fp8 [M, K], scale float32 [M, ceil(K / group)]): each token's groups of `group`
    columns scaled by their amax / 448 (group = K: one scale per token); scale_ub (fbgemm_fp8's
    activation_scale_ub): the amax taken as at most that, so larger values saturate at +-448."""
    m, k = x.shape
    xg = F.pad(x.float(), (0, -k % group)).view(m, -1, group)
    amax = xg.abs().amax(dim=2)
    scale = _over_fp8_max(amax if scale_ub is None else amax.clamp(max=scale_ub))
    q = quantize_fp8(xg, scale[:, :, None])
    return q.view(m, -1)[:, :k].contiguous(), scale


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """quantize_activations' output back to float32 [M, K]."""
    m, k = q.shape
    return (F.pad(q.float(), (0, -k % group)).view(m, -1, group) * scale[:, :, None]).view(m, -1)[:, :k]


def round_trip_activations(x: torch.Tensor, group: int, scale_ub: float | None = None) -> torch.Tensor:
    """x as the FP8 kernels see it: quantized per token group, back in float32."""
    return dequantize_activations(*quantize_activations(x, group, scale_ub), group)


def fp8_linear_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                   bias: torch.Tensor | None = None, scale_ub: float | None = None) -> torch.Tensor:
    """The GPU kernels' arithmetic: x quantized per token group (block) or per token (per channel), the
    products of the FP8 values summed in fp32 and scaled, the output rounded once to x's dtype."""
    x_deq = round_trip_activations(x, block[1] if block is not None else x.shape[1], scale_ub)
    y = x_deq @ dequantize_weight(w, scale, block, torch.float32).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fused_moe_fp8_ref(x, w13, w13_scale, w2, w2_scale, block, topk_weights, topk_ids) -> torch.Tensor:
    """kernels/fused_moe.py's FP8 arithmetic (shapes as in moe_reference.fused_moe_ref): x and then h
    quantized per token group (per token for per-channel weights), fp32 products of the dequantized
    values, and the kernel's roundings to x's dtype (gate, up, silu, h, the down output)."""
    dtype, hidden, inter = x.dtype, x.shape[1], w2.shape[2]
    xd = round_trip_activations(x, hidden if block is None else block[1])
    w13d = dequantize_weight(w13, w13_scale, block, torch.float32)
    w2d = dequantize_weight(w2, w2_scale, block, torch.float32)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    r = lambda t: t.to(dtype).float()   # noqa: E731 (one rounding to the model's dtype)
    for expert in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == expert)
        gate, up = (xd[token] @ w13d[expert].t()).chunk(2, dim=-1)
        gate = r(gate)
        h = r(r(gate / (1 + torch.exp(-gate))) * r(up))
        hd = round_trip_activations(h, inter if block is None else block[1])
        y = r(r(hd @ w2d[expert].t()) * topk_weights[token, slot, None].to(dtype).float())
        out.index_add_(0, token, y)
    return out.to(dtype)
