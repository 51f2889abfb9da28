"""A decoder layer's non-attention kernels, RMSNorms folded (models.llama.FOLD_NORMS) against not,
at decode batch sizes, in CUDA graphs on one GPU: where the fold gains or loses, per model shape.

Per shape (Qwen3-0.6B and Qwen3-8B: hidden, intermediate, heads) and batch M it times
  unfolded: add_rms_norm -> qkv GEMM -> q/k norm + rotary + store -> o GEMM -> add_rms_norm ->
            gate_up GEMM -> SiLU-and-mul -> down GEMM  (today's path without the fold)
  folded:   qkv GEMM -> q/k kernel scaling by rstd(h) -> o GEMM into h (addmm_) -> gate_up GEMM ->
            SiLU-and-mul scaling by rstd(h) -> down GEMM into h
and each part alone. Attention is left out (the same in both): o_proj takes q as its input.

    PYTHONPATH=. python benchmarks/fold_parts.py [--batches 256 64]
"""
import argparse

import torch
import torch.nn.functional as F

from bench_kernels import median_ms
from nanovllm.kernels.norm_act import add_rms_norm_triton, silu_and_mul_triton
from nanovllm.kernels.qk_norm_rope import qk_norm_rope_store_triton
from nanovllm.layers.rotary_embedding import RotaryEmbedding

SHAPES = {"0.6B": (1024, 3072, 16, 8), "8B": (4096, 12288, 32, 8)}   # hidden, inter, heads, kv heads
D, BLOCK = 128, 256


def layer_cases(hidden, inter, heads, kv_heads, m):
    """name -> a no-argument callable, on random bf16 weights and inputs of batch m."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    w_qkv = torch.randn((heads + 2 * kv_heads) * D, hidden, **bf16) * hidden ** -0.5
    w_o = torch.randn(hidden, heads * D, **bf16) * (heads * D) ** -0.5
    w_gu = torch.randn(2 * inter, hidden, **bf16) * hidden ** -0.5
    w_down = torch.randn(hidden, inter, **bf16) * inter ** -0.5
    norm_w = torch.rand(hidden, **bf16) + 0.5
    qk_w = torch.rand(D, **bf16) + 0.5
    x, res = torch.randn(m, hidden, **bf16), torch.randn(m, hidden, **bf16)
    h = x + res
    cos_sin = RotaryEmbedding(D, 40960, 1e6).cos_sin_cache.cuda()
    positions = torch.randint(0, 4096, (m,), device="cuda")
    blocks = m // BLOCK + 2
    slots = torch.randperm(blocks * BLOCK, device="cuda")[:m].int()
    k_cache = torch.zeros(blocks, BLOCK, kv_heads, D, **bf16)
    v_cache = torch.zeros_like(k_cache)
    qkv = F.linear(x, w_qkv)
    attn_out = torch.randn(m, heads * D, **bf16)
    gate_up = F.linear(x, w_gu)
    act = torch.randn(m, inter, **bf16)

    def qk(inp, **scale):
        return qk_norm_rope_store_triton(inp, qk_w, qk_w, 1e-6, cos_sin, positions, slots, k_cache,
                                         v_cache, heads, kv_heads, D, **scale)

    def unfolded():
        y, r = add_rms_norm_triton(x, res, norm_w, 1e-6)
        q, _, _ = qk(F.linear(y, w_qkv))
        y, r = add_rms_norm_triton(F.linear(q.flatten(1), w_o), r, norm_w, 1e-6)
        return F.linear(silu_and_mul_triton(F.linear(y, w_gu)), w_down)

    def folded():
        hh = h.clone()   # the stream is updated in place, as the engine's is
        q, _, _ = qk(F.linear(hh, w_qkv), norm_of=hh, norm_eps=1e-6)
        hh.addmm_(q.flatten(1), w_o.t())
        return hh.addmm_(silu_and_mul_triton(F.linear(hh, w_gu), norm_of=hh, eps=1e-6), w_down.t())

    return {
        "layer unfolded": unfolded,
        "layer folded": folded,
        "add_rms_norm": lambda: add_rms_norm_triton(x, res, norm_w, 1e-6),
        "qk plain": lambda: qk(qkv),
        "qk scaled": lambda: qk(qkv, norm_of=h, norm_eps=1e-6),
        "silu plain": lambda: silu_and_mul_triton(gate_up),
        "silu scaled": lambda: silu_and_mul_triton(gate_up, norm_of=h, eps=1e-6),
        "o linear": lambda: F.linear(attn_out, w_o),
        "o addmm_": lambda: h.addmm_(attn_out, w_o.t()),
        "down linear": lambda: F.linear(act, w_down),
        "down addmm_": lambda: h.addmm_(act, w_down.t()),
        "h clone": lambda: h.clone(),
    }


def timed(fn):
    fn()   # compile outside the capture
    return median_ms(fn, graph=True) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[256, 64])
    args = p.parse_args()
    for shape, dims in SHAPES.items():
        for m in args.batches:
            cases = layer_cases(*dims, m)
            print(f"== {shape} M={m} (us, CUDA graph medians; 'layer folded' includes a clone of h)")
            for name, fn in cases.items():
                print(f"  {name:16s} {timed(fn):8.2f}")


if __name__ == "__main__":
    main()
