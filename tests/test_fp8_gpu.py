"""FP8 kernels compiled on CUDA at Qwen3-8B and Qwen3-30B-A3B shapes against the torch reference
(kernels/fp8_reference.py): the activation quantization bit for bit, the block-scaled Triton GEMM
and the per-channel torch._scaled_mm path (also inside a CUDA graph), the fused MoE with FP8 experts,
an FP8 checkpoint end to end in bf16, and the kernels that write a per-channel GEMM's input in FP8
(SiLU-and-mul, the residual add): bit for bit the separate kernels', and the same tokens in a model."""
import collections

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from conftest import HFOracle, make_model, random_prompts, randomize_tensors  # noqa: E402
from nanovllm.kernels.fp8_reference import (add_quantize_ref, fp8_linear_ref,  # noqa: E402
                                            fused_moe_fp8_ref, quantize_activations, quantize_weight)
from nanovllm.kernels.moe_reference import select_experts  # noqa: E402

BLOCK = (128, 128)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("m,k,group", [(1, 4096, 128), (300, 12288, 128), (64, 4096, 4096),
                                       (7, 12288, 12288)])
def test_activation_quantization_is_the_reference_bit_for_bit(m, k, group):
    from nanovllm.kernels.fp8_gemm import quantize_activations as quantize_triton
    x = (torch.randn(m, k, device="cuda") * 3).to(torch.bfloat16)
    q, s = quantize_triton(x, group)
    want_q, want_s = quantize_activations(x, group)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
@pytest.mark.parametrize("m", [1, 16, 33, 256, 1000])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288)])
def test_fp8_linear_matches_reference(block, m, n, k):
    from nanovllm.kernels.fp8_gemm import fp8_linear
    w, scale = quantize_weight(torch.randn(n, k, device="cuda") * 0.02, block)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    out = fp8_linear(x, w, scale, block)
    ref = fp8_linear_ref(x, w, scale, block)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # same FP8 inputs; the sums differ in order (and the tensor cores' fp32 accumulation) only
    assert _relative_error(out, ref) < 5e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2 * ref.abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("m", [1, 64, 256, 1000])
def test_cublas_block_gemm_matches_reference(m, monkeypatch):
    """BLOCK_GEMM = "cublas": torch._scaled_mm with 1x128 x 128x128 block scales (cuBLASLt 12.9+)."""
    from nanovllm.kernels import fp8_gemm
    monkeypatch.setattr(fp8_gemm, "BLOCK_GEMM", "cublas")
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


@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
def test_fp8_linear_in_a_cuda_graph(block):
    from nanovllm.kernels.fp8_gemm import fp8_linear
    w, scale = quantize_weight(torch.randn(2048, 4096, device="cuda") * 0.02, block)
    x = torch.randn(64, 4096, device="cuda").to(torch.bfloat16)
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


@pytest.mark.parametrize("fmt", ["block", "compressed-tensors"])
def test_fp8_checkpoint_on_cuda_stays_near_transformers(fmt, tmp_path):
    """bf16 activations quantized per token group: each greedy token within 0.75 logits of
    transformers' maximum on the dequantized model (fp32; logits about 7: the CPU emulation of the
    kernels' roundings in bf16, fp8_linear_ref, stays within 0.31)."""
    from test_fp8 import SHAPES, save_fp8

    from nanovllm import LLM, SamplingParams
    src = make_model(str(tmp_path / "src"), "qwen3", **SHAPES)
    path = save_fp8(src, str(tmp_path / fmt), fmt)
    llm = LLM(path, device="cuda", dtype="bfloat16", kvcache_block_size=16, num_kvcache_blocks=64,
              gpu_memory_utilization=0.3)
    oracle = HFOracle(path + "-dequantized")
    prompts = random_prompts(4, [1, 9, 17, 40], seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        for prompt, out in zip(prompts, llm.generate(prompts, greedy, use_tqdm=False)):
            oracle.assert_greedy(prompt, out.outputs[0].token_ids, atol=0.75)
    finally:
        llm.shutdown()


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float8_e4m3fn and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "folded-norm"])
@pytest.mark.parametrize("m", [1, 7, 256, 1000])
def test_silu_and_mul_fp8_is_silu_and_mul_then_quantization(m, scaled):
    """Qwen3-8B's widths (intermediate 12288, hidden 4096): one kernel gives the reference's
    quantization of SiLU-and-mul's bf16 output, bit for bit (bytes and scales)."""
    from nanovllm.kernels.norm_act import silu_and_mul_fp8_triton, silu_and_mul_triton
    d, hidden = 12288, 4096
    g = torch.Generator(device="cuda").manual_seed(m)
    gate_up = (torch.randn(m, 2 * d, device="cuda", generator=g) * 3).to(torch.bfloat16)
    h = (torch.randn(m, hidden, device="cuda", generator=g) * 10).to(torch.bfloat16)
    scale_rows = dict(norm_of=h, eps=1e-6) if scaled else {}
    rows = silu_and_mul_fp8_triton(gate_up, **scale_rows)
    want_q, want_s = quantize_activations(silu_and_mul_triton(gate_up, **scale_rows), d)
    assert rows.dtype == torch.bfloat16 and rows.scale.shape == (m, 1)
    assert torch.equal(rows.scale, want_s)
    assert _same_bytes(rows.q, want_q)


@pytest.mark.parametrize("m", [1, 256, 1000])
def test_add_quantize_is_the_add_then_quantization(m):
    """h += y (bf16, in place) and h's rows quantized: the reference's bit for bit, at hidden 4096."""
    from nanovllm.kernels.fp8_gemm import add_quantize
    g = torch.Generator(device="cuda").manual_seed(m)
    h = (torch.randn(m, 4096, device="cuda", generator=g) * 20).to(torch.bfloat16)
    y = torch.randn(m, 4096, device="cuda", generator=g).to(torch.bfloat16)
    fused_h, want_h = h.clone(), h.clone()
    rows = add_quantize(fused_h, y)
    want = add_quantize_ref(want_h, y)
    assert torch.equal(fused_h, want_h)
    assert torch.equal(rows.scale, want.scale)
    assert _same_bytes(rows.q, want.q)


def test_fp8_output_kernels_in_a_cuda_graph():
    from nanovllm.kernels.fp8_gemm import add_quantize
    from nanovllm.kernels.norm_act import silu_and_mul_fp8_triton
    gate_up = torch.randn(64, 2 * 12288, device="cuda").to(torch.bfloat16)
    h = (torch.randn(64, 4096, device="cuda") * 10).to(torch.bfloat16)
    y = torch.randn(64, 4096, device="cuda").to(torch.bfloat16)
    start = h.clone()

    def step():
        return silu_and_mul_fp8_triton(gate_up, norm_of=h, eps=1e-6), add_quantize(h, y)
    step()   # compile outside the capture
    h.copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        silu, added = step()
    for t in (gate_up, y, start):
        t.copy_(torch.randn_like(t) * 5)
    h.copy_(start)
    graph.replay()
    h_graph = h.clone()
    h.copy_(start)
    eager_silu, eager_added = step()
    assert torch.equal(h_graph, h) and torch.equal(silu.scale, eager_silu.scale)
    assert _same_bytes(silu.q, eager_silu.q) and _same_bytes(added.q, eager_added.q)
    assert torch.equal(added.scale, eager_added.scale)


def _count_calls(monkeypatch, counts: collections.Counter, module, name: str):
    fn = getattr(module, name)

    def counted(*args, **kwargs):
        counts[name] += 1
        return fn(*args, **kwargs)
    monkeypatch.setattr(module, name, counted)


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("case", ["quantized-at-load", "compressed-tensors"])
def test_fused_quantization_gives_the_unfused_tokens(case, eager, tmp_path, monkeypatch):
    """A tiny random Qwen3 in bf16 with per-channel FP8 weights: quantization='fp8' on a bf16
    checkpoint (RMSNorm weights other than 1, folded: SiLU-and-mul and the residual adds write the
    next GEMM's FP8 input) and a compressed-tensors checkpoint (unfolded: SiLU-and-mul only). With
    layers/fp8.FUSE_QUANTIZATION the same FP8 inputs reach the same GEMMs: the unfused run's greedy
    tokens and log-probabilities, in CUDA graphs and eager."""
    from test_fp8 import SHAPES, save_fp8

    from nanovllm import LLM, SamplingParams
    from nanovllm.layers import fp8
    src = make_model(str(tmp_path / "src"), "qwen3", **SHAPES)
    g = torch.Generator().manual_seed(0)
    randomize_tensors(src, "layernorm.weight", lambda shape: 1 + 0.3 * torch.randn(shape, generator=g))
    if case == "quantized-at-load":
        path, options = src, dict(quantization="fp8")
    else:
        path, options = save_fp8(src, str(tmp_path / case), case), {}
    calls = collections.Counter()
    for name in ("add_quantize", "silu_and_mul_fp8_triton"):
        _count_calls(monkeypatch, calls, fp8, name)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = random_prompts(4, [1, 9, 17, 40], seed=3)
    results, counts = {}, {}
    for fuse in (False, True):
        monkeypatch.setattr(fp8, "FUSE_QUANTIZATION", fuse)
        calls.clear()
        llm = LLM(path, device="cuda", dtype="bfloat16", kvcache_block_size=16, num_kvcache_blocks=64,
                  gpu_memory_utilization=0.3, enforce_eager=eager, **options)
        try:
            assert llm.model_runner.model.model.layers[0].folded == (case == "quantized-at-load")
            results[fuse] = [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                             for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()
        counts[fuse] = dict(calls)
    assert counts[False] == {}
    assert counts[True]["silu_and_mul_fp8_triton"] > 0
    assert ("add_quantize" in counts[True]) == (case == "quantized-at-load")
    assert [t for t, _ in results[True]] == [t for t, _ in results[False]]
    assert results[True] == results[False]   # the log-probabilities too: the same numbers throughout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_fused_quantization_stays_near_transformers(tmp_path):
    """TP=2, quantization='fp8': SiLU-and-mul writes each rank's FP8 down_proj input (its shard of
    the intermediate, quantized per token as the unfused GEMM would); the adds stay separate (rank 0
    adds h before the all-reduce). Each greedy token within 0.75 logits of transformers' maximum on
    the model quantized per channel, as test_fp8_checkpoint_on_cuda_stays_near_transformers."""
    from test_fp8 import SHAPES, dequantized_copy

    from nanovllm import LLM, SamplingParams
    path = make_model(str(tmp_path / "src"), "qwen3", **SHAPES)   # RMSNorm weights 1: folding keeps W
    oracle = HFOracle(dequantized_copy(path, str(tmp_path / "dequantized"), None, torch.float32))
    llm = LLM(path, quantization="fp8", tensor_parallel_size=2, device="cuda", dtype="bfloat16",
              kvcache_block_size=16, num_kvcache_blocks=64, gpu_memory_utilization=0.3)
    prompts = random_prompts(4, [1, 9, 17, 40], seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        for prompt, out in zip(prompts, llm.generate(prompts, greedy, use_tqdm=False)):
            oracle.assert_greedy(prompt, out.outputs[0].token_ids, atol=0.75)
    finally:
        llm.shutdown()
