"""FP8 kernels compiled on CUDA at Qwen3-8B and Qwen3-30B-A3B shapes against the torch reference
(kernels/fp8_reference.py): the activation quantization bit for bit, the block-scaled Triton GEMM
and the per-channel torch._scaled_mm path (also inside a CUDA graph), the fused MoE with FP8 experts,
and an FP8 checkpoint end to end in bf16."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from conftest import HFOracle, make_model, random_prompts  # noqa: E402
from nanovllm.kernels.fp8_reference import (fp8_linear_ref, fused_moe_fp8_ref,  # noqa: E402
                                            quantize_activations, quantize_weight)
from nanovllm.kernels.moe_reference import select_experts  # noqa: E402

BLOCK = (128, 128)


# fp8_linear's GEMM paths: the block format, per channel with row-wise scales at every size, and per
# channel through the unit-scaled GEMM and scale_out at every size (fp8_gemm.UNIT_SCALE_MAX_M; by
# default the first up to 512 rows, the second above)
PATHS = pytest.mark.parametrize("path", [BLOCK, None, "unit"],
                                ids=["block", "channel", "channel-unit-scales"])


def _layer(path, m: int, n: int, k: int, monkeypatch):
    """(block, w, scale, x) for a path of PATHS: an [n, k] FP8 weight in that format and m bf16 rows."""
    from nanovllm.kernels import fp8_gemm
    block = None if path == "unit" else path
    monkeypatch.setattr(fp8_gemm, "UNIT_SCALE_MAX_M", 1 << 30 if path == "unit" else 0)
    w, scale = quantize_weight(torch.randn(n, k, device="cuda") * 0.02, block)
    return block, w, scale, torch.randn(m, k, device="cuda").to(torch.bfloat16)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("m,k,group,m_major", [(1, 4096, 128, True), (300, 12288, 128, False),
                                               (33, 12288, 128, True), (64, 4096, 4096, False),
                                               (7, 12288, 12288, False)])
@pytest.mark.parametrize("ub", [None, 4.0])
def test_activation_quantization_is_the_reference_bit_for_bit(m, k, group, m_major, ub):
    """m_major: cuBLASLt's block scales, rows padded to a multiple of 4 (the padding unwritten); ub:
    fbgemm_fp8's activation_scale_ub, under every group's amax (about 8 for 128 columns)."""
    from nanovllm.kernels.fp8_gemm import quantize_activations as quantize_triton
    x = (torch.randn(m, k, device="cuda") * 3).to(torch.bfloat16)
    rows = -(-m // 4) * 4 if m_major else m
    q, s = quantize_triton(x, group, m_major=m_major, rows=rows, scale_ub=ub)
    assert q.shape[0] == s.shape[0] == rows and (not m_major or s.stride() == (1, rows))
    q, s = q[:m], s[:m]
    want_q, want_s = quantize_activations(x, group, ub)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@PATHS
@pytest.mark.parametrize("m", [1, 16, 33, 256, 1000])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288), (200, 640)])   # the last: the Triton GEMM
@pytest.mark.parametrize("ub", [None, 1.0])
def test_fp8_linear_matches_reference(path, m, n, k, ub, monkeypatch):
    """ub: an activation_scale_ub under the rows' amax (about 4), per channel only (fbgemm_fp8's)."""
    from nanovllm.kernels.fp8_gemm import fp8_linear
    if ub is not None and path == BLOCK:
        pytest.skip("activation_scale_ub is per token: per-channel weights only")
    block, w, scale, x = _layer(path, m, n, k, monkeypatch)
    out = fp8_linear(x, w, scale, block, scale_ub=ub)
    ref = fp8_linear_ref(x, w, scale, block, scale_ub=ub)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # same FP8 inputs; the sums differ in order (and the tensor cores' fp32 accumulation) only
    assert _relative_error(out, ref) < 5e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2 * ref.abs().max().item(), rtol=2e-2)


@PATHS
@pytest.mark.parametrize("m", [3, 256])
def test_fp8_linear_adds_into_the_residual_in_place(path, m, monkeypatch):
    """into=: RowParallelLinear's residual stream (o_proj, down_proj), the output added into it."""
    from nanovllm.kernels import fp8_gemm
    block, w, scale, x = _layer(path, m, 4096, 12288, monkeypatch)
    h = torch.randn(m, 4096, device="cuda").to(torch.bfloat16)
    into = h.clone()
    out = fp8_gemm.fp8_linear(x, w, scale, block, into=into)
    assert out is into
    assert _relative_error(out.float() - h.float(), fp8_linear_ref(x, w, scale, block)) < 5e-3


@pytest.mark.parametrize("m", [1, 256, 1000])
def test_fp8_linear_unscaled_leaves_the_scales_that_give_fp8_linears_output(m):
    """Up to UNIT_SCALE_MAX_M (512) rows the scales are left to the caller (SiLU-and-mul), and
    scale_out with them is fp8_linear's output bit for bit; above it, fp8_linear's output and no scales."""
    from nanovllm.kernels import fp8_gemm
    w, scale = quantize_weight(torch.randn(2 * 12288, 4096, device="cuda") * 0.02, None)
    x = torch.randn(m, 4096, device="cuda").to(torch.bfloat16)
    y, scales = fp8_gemm.fp8_linear_unscaled(x, w, scale, None)
    assert (scales is not None) == (m <= fp8_gemm.UNIT_SCALE_MAX_M)
    if scales is not None:
        y = fp8_gemm.scale_out(y, *scales, None)
    assert torch.equal(y, fp8_gemm.fp8_linear(x, w, scale, None))


@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
def test_fp8_linear_of_no_rows(block):
    """A step with no tokens for a layer (torch._scaled_mm's checks reject cuBLASLt's block scales
    for 0 rows, before its own early return)."""
    from nanovllm.kernels.fp8_gemm import fp8_linear
    w, scale = quantize_weight(torch.randn(256, 4096, device="cuda") * 0.02, block)
    out = fp8_linear(torch.zeros(0, 4096, device="cuda", dtype=torch.bfloat16), w, scale, block)
    assert out.shape == (0, 256) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("m", [1, 64, 256, 1000])
def test_triton_block_gemm_matches_reference(m, monkeypatch):
    """BLOCK_GEMM = "triton": the Triton kernel with 1x128 x 128x128 block scales (the default,
    cuBLASLt's block-scaled torch._scaled_mm, runs in test_fp8_linear_matches_reference)."""
    from nanovllm.kernels import fp8_gemm
    monkeypatch.setattr(fp8_gemm, "BLOCK_GEMM", "triton")
    w, scale = quantize_weight(torch.randn(6144, 4096, device="cuda") * 0.02, BLOCK)
    x = torch.randn(m, 4096, device="cuda").to(torch.bfloat16)
    out = fp8_gemm.fp8_linear(x, w, scale, BLOCK)
    assert _relative_error(out, fp8_linear_ref(x, w, scale, BLOCK)) < 5e-3


def test_per_channel_triton_gemm_matches_scaled_mm():
    """fp16 (and fp32) take the Triton kernel with one group over K; bf16 cuBLASLt's row-wise GEMM."""
    from nanovllm.kernels.fp8_gemm import fp8_linear
    w, scale = quantize_weight(torch.randn(1024, 2048, device="cuda") * 0.02, None)
    x = torch.randn(40, 2048, device="cuda")
    for dtype in (torch.float16, torch.float32):   # the same inputs (x in that dtype) on both sides
        xd = x.to(dtype)
        assert _relative_error(fp8_linear(xd, w, scale, None), fp8_linear_ref(xd, w, scale, None)) < 5e-3


@PATHS
@pytest.mark.parametrize("m", [3, 64])
def test_fp8_linear_in_a_cuda_graph(path, m, monkeypatch):
    from nanovllm.kernels.fp8_gemm import fp8_linear
    block, w, scale, x = _layer(path, m, 2048, 4096, monkeypatch)
    eager = fp8_linear(x, w, scale, block)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, w, scale, block)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, fp8_linear(x, w, scale, block), atol=0, rtol=0)
    assert not torch.equal(out, eager)


@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
@pytest.mark.parametrize("num_tokens", [1, 64, 700])
def test_fused_moe_fp8_matches_reference(block, num_tokens):
    """Qwen3-30B-A3B's experts: 128 of them, top 8, hidden 2048, intermediate 768."""
    from nanovllm.kernels.fused_moe import fused_moe_triton
    hidden, inter, experts, top_k = 2048, 768, 128, 8
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    w13, s13 = quantize_weight(torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * 0.02,
                               block)
    w2, s2 = quantize_weight(torch.randn(experts, hidden, inter, device="cuda", generator=g) * 0.02, block)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(num_tokens, experts, device="cuda", generator=g), top_k, True)
    out = fused_moe_triton(x, w13, w2, weights, ids, scales=(s13, s2, block))
    ref = fused_moe_fp8_ref(x, w13, s13, w2, s2, block, weights, ids)
    assert out.dtype == torch.bfloat16
    assert _relative_error(out, ref) < 2e-2


@pytest.mark.parametrize("fmt,kv", [("block", "auto"), ("compressed-tensors", "auto"), ("fbgemm", "auto"),
                                    ("fbgemm-ub", "auto"), ("autofp8-static", "auto"),
                                    ("autofp8-static", "fp8")])
def test_fp8_checkpoint_on_cuda_stays_near_transformers(fmt, kv, tmp_path):
    """bf16 activations quantized per token group: each greedy token within 0.75 logits of
    transformers' maximum on the dequantized model (fp32; logits about 7: the CPU emulation of the
    kernels' roundings in bf16, fp8_linear_ref, stays within 0.31); with an FP8 cache scaled by the
    checkpoint's static KV scales (0.05), within 0.25 more (test_fp8_kv's tolerance). fbgemm-ub: an
    activation_scale_ub of 0.25, the oracle's projections seeing their inputs clipped to +-0.25."""
    from test_fp8 import FBGEMM_CONFIG, SHAPES, _set_quantization_config, clip_projection_inputs, save_fp8

    from nanovllm import LLM, SamplingParams
    src = make_model(str(tmp_path / "src"), "qwen3", **SHAPES)
    path = save_fp8(src, str(tmp_path / fmt), fmt.removesuffix("-ub"))
    ub = 0.25 if fmt.endswith("-ub") else None
    if ub:
        _set_quantization_config(path, {**FBGEMM_CONFIG, "activation_scale_ub": ub})
    llm = LLM(path, device="cuda", dtype="bfloat16", kvcache_block_size=16, num_kvcache_blocks=64,
              gpu_memory_utilization=0.3, kv_cache_dtype=kv)
    if kv == "fp8":
        assert torch.allclose(llm.model_runner.kv_scales, torch.full_like(llm.model_runner.kv_scales, 0.05))
    oracle = HFOracle(path + "-dequantized")
    if ub:
        clip_projection_inputs(oracle, ub)
    prompts = random_prompts(4, [1, 9, 17, 40], seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        for prompt, out in zip(prompts, llm.generate(prompts, greedy, use_tqdm=False)):
            oracle.assert_greedy(prompt, out.outputs[0].token_ids, atol=0.75 + (0.25 if kv == "fp8" else 0))
    finally:
        llm.shutdown()
