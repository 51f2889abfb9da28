"""Attention, KV-store, q/k norm + rotary, RMSNorm and SiLU-and-mul kernels on CUDA at Qwen3-0.6B
shapes (16 query heads, 8 KV heads, head_dim 128, hidden 1024, intermediate 3072).

bf16 attention against the fp32 reference; the elementwise kernels against eager torch in the same
dtype (transformers' roundings); decode and the elementwise kernels also under CUDA-graph capture.
"""
import itertools

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from conftest import assert_nearly_equal  # noqa: E402
from nanovllm.engine.decode_graphs import longest_first  # noqa: E402
from nanovllm.kernels import (KERNELS, add_rms_norm, paged_decode_attention,  # noqa: E402
                              paged_kv_slots, prefill_attention, qk_norm_rope_store, rms_norm,
                              silu_and_mul)
from nanovllm.kernels.reference import (add_rms_norm_ref, gather_paged_kv,  # noqa: E402
                                        paged_decode_attention_ref, prefill_attention_ref,
                                        qk_norm_rope_store_ref, rms_norm_ref, silu_and_mul_ref)
from nanovllm.layers.rotary_embedding import RotaryEmbedding  # noqa: E402

H, HKV, D = 16, 8, 128
SCALE = D ** -0.5
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def make_paged(lens, block_size, dtype=torch.bfloat16, seed=0, max_blocks=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = [max(1, -(-n // block_size)) for n in lens]
    max_blocks = max_blocks or max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + 2
    k_cache = torch.randn(num_blocks, block_size, HKV, D, device="cuda", generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, HKV, D, device="cuda", generator=gen).to(dtype)
    order = torch.randperm(num_blocks, device="cuda", generator=gen)
    tables = torch.full((len(lens), max_blocks), -1, dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[used:used + n].int()
        used += n
    return k_cache, v_cache, tables


def decode_ref(q, k_cache, v_cache, tables, ctx, chunk=32):
    """The fp32 reference in batch chunks, so batch 256 fits comfortably."""
    k_cache, v_cache = k_cache.float(), v_cache.float()
    outs = [paged_decode_attention_ref(q[i:i + chunk].float(), k_cache, v_cache,
                                       tables[i:i + chunk], ctx[i:i + chunk], SCALE)
            for i in range(0, q.shape[0], chunk)]
    return torch.cat(outs)


def test_backend_is_a_gpu_backend():
    assert KERNELS == "triton"


def test_aten_flash_attention_is_usable():
    from nanovllm.kernels.flash_prefill import aten_flash_mode
    assert aten_flash_mode(torch.device("cuda")) in ("gqa", "expand")


@pytest.mark.parametrize("batch,max_ctx,block_size", [(1, 4096, 256), (7, 1500, 256), (256, 1024, 256),
                                                      (33, 700, 16)])
@pytest.mark.parametrize("entry", ["triton", "backend"])
def test_decode_matches_reference(batch, max_ctx, block_size, entry):
    from nanovllm.kernels.decode_attention import paged_decode_attention_triton
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, max_ctx + 1, (batch,), generator=gen).tolist()
    lens[0] = max_ctx
    if batch > 2:
        lens[1], lens[2] = 1, 0  # a single token and a graph padding row
    k_cache, v_cache, tables = make_paged(lens, block_size, seed=batch)
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, H, D, device="cuda").bfloat16()
    fn = paged_decode_attention_triton if entry == "triton" else paged_decode_attention
    out = fn(q, k_cache, v_cache, tables, ctx, SCALE)
    ref = decode_ref(q, k_cache, v_cache, tables, ctx)
    keep = ctx > 0
    torch.testing.assert_close(out.float()[keep], ref[keep], **BF16_TOL)


def test_decode_fp32_matches_reference():
    from nanovllm.kernels.decode_attention import paged_decode_attention_triton
    lens = [1, 300, 1000]
    k_cache, v_cache, tables = make_paged(lens, 256, dtype=torch.float32)
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(3, H, D, device="cuda")
    out = paged_decode_attention_triton(q, k_cache, v_cache, tables, ctx, SCALE)
    torch.testing.assert_close(out, decode_ref(q, k_cache, v_cache, tables, ctx), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_launch_order_gives_the_same_output(fp8):
    # The engine passes the rows longest context first; the output must be bit-identical.
    lens = [5, 0, 2000, 300, 1024, 77, 1500]
    scales = {}
    if fp8:
        k_cache, v_cache, tables, k_scale, v_scale, _, _ = fp8_paged(lens, 256)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    else:
        k_cache, v_cache, tables = make_paged(lens, 256)
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    order = torch.tensor(longest_first(lens), dtype=torch.int32, device="cuda")   # the engine's rule
    q = torch.randn(len(lens), H, D, device="cuda").bfloat16()
    plain = paged_decode_attention(q, k_cache, v_cache, tables, ctx, SCALE, **scales)
    ordered = paged_decode_attention(q, k_cache, v_cache, tables, ctx, SCALE, **scales, order=order)
    keep = ctx > 0
    assert torch.equal(ordered[keep], plain[keep])


@pytest.mark.parametrize("batch", [1, 64])
def test_decode_cuda_graph_replay_matches_eager(batch):
    max_blocks = 8  # the graph is captured for max_blocks * 256 tokens; contexts vary below that
    k_cache, v_cache, tables = make_paged([max_blocks * 256] * batch, 256, max_blocks=max_blocks)
    q = torch.randn(batch, H, D, device="cuda").bfloat16()
    ctx = torch.full((batch,), 5, dtype=torch.int32, device="cuda")
    for _ in range(2):  # warm up: compile the kernels outside the capture
        paged_decode_attention(q, k_cache, v_cache, tables, ctx, SCALE)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, SCALE)
    for step in range(3):
        q.copy_(torch.randn_like(q))
        ctx.copy_(torch.randint(0, max_blocks * 256 + 1, (batch,), device="cuda", dtype=torch.int32))
        ctx[0] = 1 + 700 * step
        graph.replay()
        eager = paged_decode_attention(q, k_cache, v_cache, tables, ctx, SCALE)
        keep = ctx > 0
        torch.testing.assert_close(out[keep], eager[keep], atol=0, rtol=0)


def prefill_case(q_lens, k_lens, block_size, dtype=torch.bfloat16, seed=0):
    """New tokens already stored in a paged cache that holds each sequence's prefix."""
    k_cache, v_cache, tables = make_paged(k_lens, block_size, dtype=dtype, seed=seed)
    q = torch.randn(sum(q_lens), H, D, device="cuda").to(dtype)
    lens = list(enumerate(zip(q_lens, k_lens)))
    new_k = torch.cat([gather_paged_kv(k_cache, tables[i], n)[n - m:] for i, (m, n) in lens])
    new_v = torch.cat([gather_paged_kv(v_cache, tables[i], n)[n - m:] for i, (m, n) in lens])
    cu_q = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
    cu_k = torch.tensor([0] + k_lens, device="cuda").cumsum(0).int()
    return (q, new_k.contiguous(), new_v.contiguous(), k_cache, v_cache, cu_q, cu_k, max(q_lens), max(k_lens),
            tables)


def check_prefill(args, tol):
    out = prefill_attention(*args, SCALE)
    ref_args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    ref = prefill_attention_ref(*ref_args, SCALE)
    torch.testing.assert_close(out.float(), ref, **tol)


def test_prefill_without_cache_matches_reference():
    lens = [1, 17, 1024, 300]
    args = list(prefill_case(lens, lens, 256))
    args[-1] = None
    check_prefill(args, BF16_TOL)


@pytest.mark.parametrize("block_size", [16, 256])
def test_prefill_with_cached_prefix_matches_reference(block_size):
    # a prefix hit, a chunk in the middle of a long prompt, a fresh prompt
    check_prefill(prefill_case([5, 512, 100], [600, 2048, 100], block_size), BF16_TOL)


def test_prefill_fp32_on_cuda_matches_reference():
    check_prefill(prefill_case([3, 40], [3, 90], 16, dtype=torch.float32), dict(atol=1e-4, rtol=1e-4))


@pytest.mark.parametrize("head_dim", [8, 64])
def test_decode_small_head_dims(head_dim):
    """head_dim below 16 needs a padded tile (tl.dot wants K >= 16): it once failed to compile."""
    from nanovllm.kernels.decode_attention import paged_decode_attention_triton
    gen = torch.Generator(device="cuda").manual_seed(3)
    lens = [1, 40, 208]   # the tables hold 13 blocks of 16 tokens
    k_cache = torch.randn(40, 16, 4, head_dim, device="cuda", generator=gen)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(40, device="cuda", generator=gen)[:3 * 13].int().view(3, 13)
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(3, 8, head_dim, device="cuda", generator=gen)
    out = paged_decode_attention_triton(q, k_cache, v_cache, tables, ctx, head_dim ** -0.5)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, head_dim ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def qk_case(num_tokens, dtype, norm, seed=0, block_size=256):
    """qk_norm_rope_store's arguments at Qwen3-0.6B's shapes (rope theta 1e6), a fifth of the slots -1."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = (torch.randn(num_tokens, (H + 2 * HKV) * D, device="cuda", generator=gen) * 2).to(dtype)
    weights = [(torch.rand(D, device="cuda", generator=gen) + 0.5).to(dtype) if norm else None
               for _ in range(2)]
    cos_sin = RotaryEmbedding(D, 40960, 1e6).cos_sin_cache.cuda()
    positions = torch.randint(0, 40960, (num_tokens,), device="cuda", generator=gen)
    num_blocks = num_tokens // block_size + 3
    slots = torch.randperm(num_blocks * block_size, device="cuda", generator=gen)[:num_tokens].int()
    slots[::5] = -1
    k_cache = torch.randn(num_blocks, block_size, HKV, D, device="cuda", generator=gen).to(dtype)
    return [qkv, *weights, 1e-6, cos_sin, positions, slots, k_cache, torch.randn_like(k_cache)]


@pytest.mark.parametrize("num_tokens", [1, 256, 16384])
@pytest.mark.parametrize("dtype,norm",
                         [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True)])
def test_qk_norm_rope_store_matches_reference(num_tokens, dtype, norm):
    """The fused kernel against the eager torch ops (transformers' roundings): equal, up to one ulp on
    a few values; the cache written only at the slots."""
    from nanovllm.kernels.qk_norm_rope import qk_norm_rope_store_triton
    *inputs, k_cache, v_cache = qk_case(num_tokens, dtype, norm)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref, kk_ref, _ = qk_norm_rope_store_ref(*inputs, k_ref, v_ref, H, HKV, D)
    for fn in (qk_norm_rope_store_triton, qk_norm_rope_store):   # the kernel, the dispatching entry point
        k_out, v_out = k_cache.clone(), v_cache.clone()
        q, k, v = fn(*inputs, k_out, v_out, H, HKV, D)
        assert_nearly_equal(q, q_ref)
        assert_nearly_equal(k, kk_ref)
        assert_nearly_equal(k_out, k_ref)
        assert torch.equal(v_out, v_ref)
        assert torch.equal(v, inputs[0][:, (H + HKV) * D:].view(-1, HKV, D))


@pytest.mark.parametrize("num_tokens", [1, 256, 16384])
def test_qk_norm_rope_store_with_a_folded_norm_matches_reference(num_tokens):
    """norm_of (the input RMSNorm folded into qkv_proj): q, k, v times rstd of norm_of's rows first;
    v comes back scaled, in its own tensor, and so reaches the cache."""
    from nanovllm.kernels.qk_norm_rope import qk_norm_rope_store_triton
    *inputs, k_cache, v_cache = qk_case(num_tokens, torch.bfloat16, True)
    h = (torch.randn(num_tokens, 1024, device="cuda") * 20).bfloat16()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref, kk_ref, v_want = qk_norm_rope_store_ref(*inputs, k_ref, v_ref, H, HKV, D, norm_of=h, norm_eps=1e-6)
    k_out, v_out = k_cache.clone(), v_cache.clone()
    q, k, v = qk_norm_rope_store_triton(*inputs, k_out, v_out, H, HKV, D, norm_of=h, norm_eps=1e-6)
    for got, want in ((q, q_ref), (k, kk_ref), (v, v_want), (k_out, k_ref), (v_out, v_ref)):
        assert_nearly_equal(got, want, max_fraction=1e-3)


def test_qk_norm_rope_store_cuda_graph_replay_matches_eager():
    from nanovllm.kernels.qk_norm_rope import qk_norm_rope_store_triton
    *inputs, k_cache, v_cache = qk_case(64, torch.bfloat16, True)
    qkv, positions, slots = inputs[0], inputs[5], inputs[6]
    qk_norm_rope_store_triton(*inputs, k_cache, v_cache, H, HKV, D)   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, k, _ = qk_norm_rope_store_triton(*inputs, k_cache, v_cache, H, HKV, D)
    for step in range(3):
        qkv.copy_(torch.randn_like(qkv))
        positions.copy_(torch.randint(0, 40960, positions.shape, device="cuda"))
        slots.copy_(torch.randperm(k_cache.shape[0] * k_cache.shape[1], device="cuda")[:64].int())
        slots[step::4] = -1
        k_eager, v_eager = k_cache.clone(), v_cache.clone()
        q_eager, kk_eager, _ = qk_norm_rope_store_triton(*inputs, k_eager, v_eager, H, HKV, D)
        graph.replay()
        assert torch.equal(q, q_eager) and torch.equal(k, kk_eager)
        assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager)


HIDDEN, INTER = 1024, 3072


def norm_act_case(num_tokens, dtype, seed=0):
    """x, residual [num_tokens, HIDDEN] (rows of magnitude 3e4, 1e-4 and 1 in turn), a weight, and
    gate_up [num_tokens, 2 * INTER]."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scale = torch.tensor([3e4, 1e-4, 1.0], device="cuda")[torch.arange(num_tokens, device="cuda") % 3, None]
    x = (torch.randn(num_tokens, HIDDEN, device="cuda", generator=gen) * 2 * scale).to(dtype)
    residual = (torch.randn(num_tokens, HIDDEN, device="cuda", generator=gen) * scale).to(dtype)
    weight = (torch.rand(HIDDEN, device="cuda", generator=gen) + 0.5).to(dtype)
    gate_up = (torch.randn(num_tokens, 2 * INTER, device="cuda", generator=gen) * 3).to(dtype)
    return x, residual, weight, gate_up


@pytest.mark.parametrize("num_tokens", [1, 256, 16384])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_and_silu_kernels_match_eager_torch(num_tokens, dtype):
    """RMSNorm: equal up to one ulp on a few values (the fp32 sum of squares adds in another order
    than torch's reduction). The residual add and SiLU-and-mul: bit for bit (libdevice's expf and an
    IEEE division, as torch's CUDA silu)."""
    from nanovllm.kernels.norm_act import add_rms_norm_triton, rms_norm_triton, silu_and_mul_triton
    x, residual, weight, gate_up = norm_act_case(num_tokens, dtype)
    assert_nearly_equal(rms_norm_triton(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), max_fraction=1e-3)
    out, res_out = add_rms_norm_triton(x, residual, weight, 1e-6)
    ref, res_ref = add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(res_out, res_ref)
    assert_nearly_equal(out, ref, max_fraction=1e-3)
    silu = silu_and_mul_triton(gate_up)
    if dtype == torch.float32:
        torch.testing.assert_close(silu, silu_and_mul_ref(gate_up), atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(silu, silu_and_mul_ref(gate_up))
    # a folded post-attention RMSNorm: gate and up times rstd(x) first (rstd: up to an ulp, as above)
    scaled = silu_and_mul_triton(gate_up, norm_of=x, eps=1e-6)
    assert_nearly_equal(scaled, silu_and_mul_ref(gate_up, norm_of=x, eps=1e-6), max_fraction=1e-3)


@pytest.mark.parametrize("rows", [64, 4096])
def test_scaled_silu_and_mul_at_qwen3_8b_widths(rows):
    """Hidden 4096, intermediate 12288: at 64 rows the scaled kernel's block widens to 4096 (16 warps),
    three programs a row; at 4096 (>= SILU_WHOLE_ROWS) one program walks a row in blocks of 1024."""
    from nanovllm.kernels.norm_act import silu_and_mul_triton
    gen = torch.Generator(device="cuda").manual_seed(8)
    h = (torch.randn(rows, 4096, device="cuda", generator=gen) * 4).bfloat16()
    gate_up = (torch.randn(rows, 2 * 12288, device="cuda", generator=gen) * 3).bfloat16()
    scaled = silu_and_mul_triton(gate_up, norm_of=h, eps=1e-6)
    assert_nearly_equal(scaled, silu_and_mul_ref(gate_up, norm_of=h, eps=1e-6), max_fraction=1e-3)
    # an FP8 gate/up GEMM's row and column scales applied in the same pass: bit for bit what
    # fp8_gemm.scale_out and then the kernel give
    from nanovllm.kernels.fp8_gemm import scale_out
    scales = (torch.rand(rows, 1, device="cuda", generator=gen) / 50,
              torch.rand(2 * 12288, device="cuda", generator=gen) / 50)
    for norm in (dict(norm_of=h, eps=1e-6), {}):   # quantized at load (folded norms), an FP8 checkpoint
        fused = silu_and_mul_triton(gate_up, fp8_scales=scales, **norm)
        two_passes = silu_and_mul_triton(scale_out(gate_up.clone(), *scales, None), **norm)
        assert torch.equal(fused, two_passes)


def test_norm_and_silu_entry_points_take_the_kernels():
    from nanovllm.kernels.norm_act import add_rms_norm_triton, rms_norm_triton, silu_and_mul_triton
    x, residual, weight, gate_up = norm_act_case(64, torch.bfloat16, seed=1)
    assert torch.equal(rms_norm(x, weight, 1e-6), rms_norm_triton(x, weight, 1e-6))
    for a, b in zip(add_rms_norm(x, residual, weight, 1e-6), add_rms_norm_triton(x, residual, weight, 1e-6)):
        assert torch.equal(a, b)
    assert torch.equal(silu_and_mul(gate_up), silu_and_mul_triton(gate_up))


@pytest.mark.parametrize("num_tokens", [1, 256])
def test_norm_and_silu_cuda_graph_replay_matches_eager(num_tokens):
    from nanovllm.kernels.norm_act import add_rms_norm_triton, rms_norm_triton, silu_and_mul_triton
    x, residual, weight, gate_up = norm_act_case(num_tokens, torch.bfloat16, seed=2)

    def step():
        return (rms_norm_triton(x, weight, 1e-6), *add_rms_norm_triton(x, residual, weight, 1e-6),
                silu_and_mul_triton(gate_up))
    step()   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in range(3):
        new = norm_act_case(num_tokens, torch.bfloat16, seed=10 + seed)
        for buf, value in zip((x, residual, weight, gate_up), new):
            buf.copy_(value)
        graph.replay()
        for out, eager in zip(outs, step(), strict=True):
            assert torch.equal(out, eager)


# ---- fused mixture-of-experts at Qwen3-30B-A3B shapes (128 experts, top 8, hidden 2048, inter 768) ----

MOE_E, MOE_K, MOE_H, MOE_I = 128, 8, 2048, 768


@pytest.fixture(scope="module")
def moe_weights():
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(MOE_E, 2 * MOE_I, MOE_H, device="cuda", generator=gen) * 0.02).bfloat16()
    w2 = (torch.randn(MOE_E, MOE_H, MOE_I, device="cuda", generator=gen) * 0.02).bfloat16()
    return w13, w2


def moe_case(num_tokens: int, seed: int, skewed: bool = False):
    """bf16 tokens and the router's top-8 choice; skewed: every token picks the same experts (as the
    engine's warm-up prefill of zeros does)."""
    from nanovllm.kernels.moe_reference import select_experts
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, MOE_H, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(num_tokens, MOE_E, device="cuda", generator=gen)
    if skewed:
        logits = logits[:1].expand(num_tokens, -1)
    weights, ids = select_experts(logits.bfloat16(), MOE_K, renormalize=True)
    return x, weights, ids


def assert_moe_close(out: torch.Tensor, x, w13, w2, weights, ids):
    """Against the fp32 reference on the same bf16 inputs: bf16 roundings of gate, up, silu, h and y."""
    from nanovllm.kernels.moe_reference import fused_moe_ref
    ref = torch.cat([fused_moe_ref(x[i:i + 512].float(), w13.float(), w2.float(), weights[i:i + 512].float(),
                                   ids[i:i + 512]) for i in range(0, x.shape[0], 512)])
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_tokens,skewed", [(1, False), (7, False), (64, False), (256, False),
                                               (2048, False), (4096, True)])
def test_fused_moe_matches_reference(moe_weights, num_tokens, skewed):
    from nanovllm.kernels.fused_moe import fused_moe_triton
    w13, w2 = moe_weights
    x, weights, ids = moe_case(num_tokens, seed=num_tokens, skewed=skewed)
    assert_moe_close(fused_moe_triton(x, w13, w2, weights, ids), x, w13, w2, weights, ids)


@pytest.mark.parametrize("one_program", [True, False], ids=["one-program", "three-kernels"])
@pytest.mark.parametrize("num_tokens,skewed", [(1, False), (64, False), (256, False), (512, True)])
def test_fused_moe_with_either_sort(moe_weights, num_tokens, skewed, one_program, monkeypatch):
    """Decode's pairs sorted in one program (moe_routing.ONE_PROGRAM_MAX_PAIRS, the default) or by the
    three kernels prefill uses: the same output, eager and replayed."""
    from nanovllm.kernels import moe_routing
    from nanovllm.kernels.fused_moe import fused_moe_triton
    monkeypatch.setattr(moe_routing, "ONE_PROGRAM_MAX_PAIRS", 4096 if one_program else 0)
    w13, w2 = moe_weights
    x, weights, ids = moe_case(num_tokens, seed=num_tokens, skewed=skewed)
    assert_moe_close(fused_moe_triton(x, w13, w2, weights, ids), x, w13, w2, weights, ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(x, w13, w2, weights, ids)
    for buf, value in zip((x, weights, ids), moe_case(num_tokens, seed=num_tokens + 1)):
        buf.copy_(value)
    graph.replay()
    assert_moe_close(out, x, w13, w2, weights, ids)


def test_fused_moe_tp2_shard_shapes(moe_weights):
    """One rank's shard under TP=2: half of every expert's intermediate columns."""
    from nanovllm.kernels.fused_moe import fused_moe_triton
    w13, w2 = moe_weights
    half = MOE_I // 2
    w13 = torch.cat([w13[:, :half], w13[:, MOE_I:MOE_I + half]], dim=1).contiguous()
    w2 = w2[:, :, :half].contiguous()
    x, weights, ids = moe_case(200, seed=5)
    assert_moe_close(fused_moe_triton(x, w13, w2, weights, ids), x, w13, w2, weights, ids)


def test_fused_moe_cuda_graph_replay_matches_eager(moe_weights):
    from nanovllm.kernels.fused_moe import fused_moe_triton
    w13, w2 = moe_weights
    x, weights, ids = moe_case(96, seed=1)
    fused_moe_triton(x, w13, w2, weights, ids)   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(x, w13, w2, weights, ids)
    for seed in (2, 3):   # new tokens and routing in the same buffers: the graph must re-sort them
        for buf, value in zip((x, weights, ids), moe_case(96, seed=seed)):
            buf.copy_(value)
        graph.replay()
        assert_moe_close(out, x, w13, w2, weights, ids)


@pytest.mark.parametrize("num_tokens", [1, 256, 4096])
def test_select_experts_kernel_matches_reference(num_tokens):
    """The router kernel against torch's softmax + topk on bf16 logits (which tie often: a tie may
    take either expert, so compare the chosen probabilities, not the indices)."""
    from nanovllm.kernels.moe_reference import select_experts
    from nanovllm.kernels.moe_routing import select_experts_triton
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    logits = torch.randn(num_tokens, MOE_E, device="cuda", generator=gen).bfloat16()
    weights, ids = select_experts_triton(logits, MOE_K, renormalize=True)
    want_weights, _ = select_experts(logits, MOE_K, renormalize=True)
    assert ids.shape == (num_tokens, MOE_K) and weights.dtype == torch.bfloat16
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all()   # distinct experts per token
    probs = torch.softmax(logits.float(), dim=-1)
    kth = probs.topk(MOE_K, dim=-1).values[:, -1:]
    assert (probs.gather(1, ids.long()) >= kth * (1 - 1e-5)).all()   # each chosen expert is in the top 8
    torch.testing.assert_close(weights.float(), want_weights.float(), atol=2e-3, rtol=1e-2)


# ---- FP8 KV cache: e4m3 with per-layer K and V scales ----

FP8_SCALES = (0.02, 0.01)   # randn * 3 / 0.02 reaches e4m3's 448: the cache uses its whole range


def fp8_paged(lens, block_size, seed=0, max_blocks=None):
    """make_paged's cache quantized to FP8, its [1] fp32 scales, and the dequantized fp32 cache."""
    from nanovllm.kernels.reference import dequantize_kv, quantize_fp8
    k_cache, v_cache, tables = make_paged(lens, block_size, dtype=torch.float32, seed=seed,
                                          max_blocks=max_blocks)
    k_scale, v_scale = (torch.tensor([s], device="cuda") for s in FP8_SCALES)
    k8, v8 = quantize_fp8(k_cache * 3, k_scale), quantize_fp8(v_cache, v_scale)
    return k8, v8, tables, k_scale, v_scale, dequantize_kv(k8, k_scale), dequantize_kv(v8, v_scale)


@pytest.mark.parametrize("batch,max_ctx,block_size", [(1, 4096, 256), (7, 1500, 256), (256, 1024, 256),
                                                      (33, 700, 16)])
@pytest.mark.parametrize("block_n", [None, 128])
def test_decode_fp8_matches_reference(batch, max_ctx, block_size, block_n):
    from nanovllm.kernels.decode_attention import paged_decode_attention_triton
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, max_ctx + 1, (batch,), generator=gen).tolist()
    lens[0] = max_ctx
    if batch > 2:
        lens[1], lens[2] = 1, 0
    k8, v8, tables, k_scale, v_scale, k_deq, v_deq = fp8_paged(lens, block_size, seed=batch)
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, H, D, device="cuda").bfloat16()
    out = paged_decode_attention_triton(q, k8, v8, tables, ctx, SCALE, block_n=block_n,
                                        k_scale=k_scale, v_scale=v_scale)
    ref = decode_ref(q, k_deq, v_deq, tables, ctx)
    keep = ctx > 0
    torch.testing.assert_close(out.float()[keep], ref[keep], **BF16_TOL)
    if block_n is None:   # the back end's entry point takes the kernel
        entry = paged_decode_attention(q, k8, v8, tables, ctx, SCALE, k_scale, v_scale)
        assert torch.equal(entry[keep], out[keep])


@pytest.mark.parametrize("block_n,num_warps", [(64, 1), (32, 1), (128, 4)])
def test_decode_fp8_tiles_match_reference(monkeypatch, block_n, num_warps):
    """FP8's tiles (FP8_BLOCK_N x FP8_NUM_WARPS: the default 64 x 1 and others): every one computes the
    same, also at block sizes that split a tile over blocks, and with splits."""
    from nanovllm.kernels import decode_attention
    monkeypatch.setattr(decode_attention, "FP8_BLOCK_N", block_n)
    monkeypatch.setattr(decode_attention, "FP8_NUM_WARPS", num_warps)
    for block_size, lens in ((256, [1, 700, 2048, 0, 1500]), (16, [3, 130, 0, 333])):
        k8, v8, tables, k_scale, v_scale, k_deq, v_deq = fp8_paged(lens, block_size, seed=5)
        ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
        q = torch.randn(len(lens), H, D, device="cuda").bfloat16()
        for num_splits in (None, 3):
            out = decode_attention.paged_decode_attention_triton(q, k8, v8, tables, ctx, SCALE,
                                                                 num_splits=num_splits, k_scale=k_scale,
                                                                 v_scale=v_scale)
            keep = ctx > 0
            torch.testing.assert_close(out.float()[keep], decode_ref(q, k_deq, v_deq, tables, ctx)[keep],
                                       **BF16_TOL)


@pytest.mark.parametrize("head_dim", [8, 64])
def test_decode_fp8_small_head_dims(head_dim):
    """Padded head_dim in the FP8 tiles (the whole tiles' loads keep a head_dim mask)."""
    from nanovllm.kernels.decode_attention import paged_decode_attention_triton
    from nanovllm.kernels.reference import quantize_fp8
    gen = torch.Generator(device="cuda").manual_seed(4)
    lens = [1, 300, 1000]
    k_cache = torch.randn(16, 256, 4, head_dim, device="cuda", generator=gen)
    v_cache = torch.randn_like(k_cache)
    scale = torch.ones(1, device="cuda")
    k8, v8 = quantize_fp8(k_cache, scale), quantize_fp8(v_cache, scale)
    tables = torch.randperm(16, device="cuda", generator=gen)[:12].int().view(3, 4)
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(3, 8, head_dim, device="cuda", generator=gen).bfloat16()
    out = paged_decode_attention_triton(q, k8, v8, tables, ctx, head_dim ** -0.5, k_scale=scale,
                                        v_scale=scale)
    ref = paged_decode_attention_ref(q.float(), k8.float(), v8.float(), tables, ctx, head_dim ** -0.5)
    torch.testing.assert_close(out.float(), ref, **BF16_TOL)


def test_decode_fp8_with_fp32_queries_matches_reference():
    from nanovllm.kernels.decode_attention import paged_decode_attention_triton
    lens = [1, 300, 1000]
    k8, v8, tables, k_scale, v_scale, k_deq, v_deq = fp8_paged(lens, 256)
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(3, H, D, device="cuda")
    out = paged_decode_attention_triton(q, k8, v8, tables, ctx, SCALE, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out, decode_ref(q, k_deq, v_deq, tables, ctx), atol=1e-4, rtol=1e-4)


def test_decode_fp8_graph_reads_the_scales_at_replay():
    """calculate_kv_scales sets the scales after the graphs are captured: replay must see them."""
    k8, v8, tables, k_scale, v_scale, _, _ = fp8_paged([2048] * 16, 256, max_blocks=8)
    q = torch.randn(16, H, D, device="cuda").bfloat16()
    ctx = torch.full((16,), 1500, dtype=torch.int32, device="cuda")
    paged_decode_attention(q, k8, v8, tables, ctx, SCALE, k_scale, v_scale)   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, k8, v8, tables, ctx, SCALE, k_scale, v_scale)
    k_scale.fill_(0.05)
    v_scale.fill_(0.003)
    graph.replay()
    assert torch.equal(out, paged_decode_attention(q, k8, v8, tables, ctx, SCALE, k_scale, v_scale))


@pytest.mark.parametrize("num_tokens", [1, 256, 16384])
def test_qk_norm_rope_store_fp8_matches_reference(num_tokens):
    """The kernel quantizes its own k and v exactly as the reference's quantize_fp8 does; against
    the reference's whole path, a few stored keys may sit one e4m3 step away (their bf16 k differed
    by one ulp)."""
    from nanovllm.kernels.qk_norm_rope import qk_norm_rope_store_triton
    from nanovllm.kernels.reference import quantize_fp8
    *inputs, k_cache, v_cache = qk_case(num_tokens, torch.bfloat16, True)
    slots = inputs[6]
    k_scale, v_scale = torch.tensor([0.01], device="cuda"), torch.tensor([0.02], device="cuda")
    k8, v8 = quantize_fp8(k_cache, k_scale), quantize_fp8(v_cache, v_scale)
    k_ref, v_ref = k8.clone(), v8.clone()
    qk_norm_rope_store_ref(*inputs, k_ref, v_ref, H, HKV, D, k_scale, v_scale)
    for fn in (qk_norm_rope_store_triton, qk_norm_rope_store):
        k_out, v_out = k8.clone(), v8.clone()
        _, k, _ = fn(*inputs, k_out, v_out, H, HKV, D, k_scale, v_scale)
        keep = slots >= 0
        rows = slots[keep].long()
        bits = lambda c: c.view(torch.uint8).view(-1, HKV, D)  # noqa: E731
        assert torch.equal(bits(k_out)[rows], quantize_fp8(k[keep], k_scale).view(torch.uint8))
        assert torch.equal(bits(v_out), bits(v_ref))
        assert (bits(k_out) != bits(k_ref)).float().mean() <= 1e-3
        # The kernel's bf16 K differs from eager torch's in about 1 value in 10^6 (the order of the
        # fp32 sum of squares), which can move its e4m3 code by a step or two: 2 steps allowed.
        torch.testing.assert_close(k_out.float(), k_ref.float(), rtol=1 / 4, atol=2 ** -8)


@pytest.mark.parametrize("block_size", [16, 256])
def test_prefill_fp8_with_cached_prefix_matches_reference(block_size):
    from nanovllm.kernels.reference import dequantize_kv, quantize_fp8
    q_lens, k_lens = [5, 512, 100], [600, 2048, 100]
    q, _, _, k_cache, v_cache, cu_q, cu_k, max_q, max_k, tables = prefill_case(q_lens, k_lens, block_size)
    k_scale, v_scale = torch.tensor([0.01], device="cuda"), torch.tensor([0.004], device="cuda")
    k8, v8 = quantize_fp8(k_cache, k_scale), quantize_fp8(v_cache, v_scale)
    k_deq, v_deq = dequantize_kv(k8, k_scale), dequantize_kv(v8, v_scale)
    ends = list(enumerate(zip(q_lens, k_lens)))
    new_k = torch.cat([gather_paged_kv(k_deq, tables[i], n)[n - m:] for i, (m, n) in ends])
    new_v = torch.cat([gather_paged_kv(v_deq, tables[i], n)[n - m:] for i, (m, n) in ends])
    out = prefill_attention(q, new_k.bfloat16(), new_v.bfloat16(), k8, v8, cu_q, cu_k, max_q, max_k, tables,
                            SCALE, None, k_scale, v_scale)
    ref = prefill_attention_ref(q.float(), new_k, new_v, k_deq, v_deq, cu_q, cu_k, max_q, max_k, tables,
                                SCALE)
    torch.testing.assert_close(out.float(), ref, **BF16_TOL)


def test_gather_dequantize_kv_equals_the_torch_ops():
    from nanovllm.kernels.flash_prefill import gather_dequantize_kv, gather_kv_varlen
    from nanovllm.kernels.reference import dequantize_kv
    k_lens = [600, 2048, 100, 3]
    k8, v8, tables, k_scale, v_scale, _, _ = fp8_paged(k_lens, 256, seed=3)
    cu_k = torch.tensor([0, *itertools.accumulate(k_lens)], dtype=torch.int32, device="cuda")
    slots = paged_kv_slots(tables, cu_k, sum(k_lens), 256)
    k, v = gather_dequantize_kv(k8, v8, slots, k_scale, v_scale, torch.bfloat16)
    k_ref, v_ref = gather_kv_varlen(k8, v8, slots)
    assert torch.equal(k, dequantize_kv(k_ref, k_scale).bfloat16())
    assert torch.equal(v, dequantize_kv(v_ref, v_scale).bfloat16())
