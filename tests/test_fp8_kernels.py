"""The FP8 Triton kernels under the interpreter (fp32 models, tiny shapes) against the torch
reference (kernels/fp8_reference.py): the activation quantization bit for bit, the block-scaled and
per-channel GEMMs, the fused MoE with FP8 experts, and the kernels that write a per-channel GEMM's
input in FP8 (SiLU-and-mul, the residual add), alone and in a model. tests/test_fp8_gpu.py runs them
compiled."""
import collections

import pytest
import torch
from conftest import interp, make_model, random_prompts, randomize_tensors, run_interpreted_tests

from nanovllm.kernels.fp8_reference import (Fp8Rows, add_quantize_ref, fp8_linear_ref, fused_moe_fp8_ref,
                                            quantize_activations, quantize_weight)
from nanovllm.kernels.moe_reference import select_experts


def test_fp8_kernels_under_interpreter():
    # NANOVLLM_KERNELS=triton: the model test takes the CUDA path's FP8 layers on CPU tensors
    run_interpreted_tests(__file__, NANOVLLM_KERNELS="triton")


def assert_fp8_near(q: torch.Tensor, want_q: torch.Tensor):
    """The interpreter's fp32 -> e4m3 cast is off for a value just under a power of two (-7.95 to -4)
    and for subnormals: those few may differ from the reference's cast, by at most half the value or a
    subnormal step (the GPU's cast is the reference's: tests/test_fp8_gpu.py compares bit for bit)."""
    q, want_q = q.float(), want_q.float()
    bad = q != want_q
    assert bad.float().mean() < 0.1
    assert ((q - want_q).abs()[bad] <= 0.5 * want_q.abs()[bad] + 2 ** -8).all()


def assert_same_bytes(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype == torch.float8_e4m3fn and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@interp
@pytest.mark.parametrize("m,k,group", [(3, 256, 128), (4, 300, 128), (2, 200, 200), (1, 2500, 2500)])
def test_interp_activation_quantization_is_the_reference_bit_for_bit(m, k, group):
    from nanovllm.kernels.fp8_gemm import quantize_activations as quantize_triton
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * torch.logspace(-2, 2, k)
    x[0, :group] = 0.0   # an all-zero group
    q, s = quantize_triton(x, group)
    want_q, want_s = quantize_activations(x, group)
    assert torch.equal(s, want_s)
    assert_fp8_near(q, want_q)


@interp
@pytest.mark.parametrize("m,n,k,block", [(1, 256, 256, (128, 128)), (5, 200, 300, (128, 128)),
                                         (3, 64, 96, (32, 32)), (17, 48, 80, None)])
def test_interp_fp8_gemm_matches_reference(m, n, k, block, monkeypatch):
    from nanovllm.kernels import fp8_gemm
    g = torch.Generator().manual_seed(m + n)
    w, scale = quantize_weight(torch.randn(n, k, generator=g) * 0.1, block)
    x = torch.randn(2, m, k, generator=g)
    bias = torch.randn(n, generator=g)
    # the reference's activation quantization (the interpreter's FP8 cast is off: see above)
    monkeypatch.setattr(fp8_gemm, "quantize_activations", quantize_activations)
    out = fp8_gemm.fp8_linear(x, w, scale, block, bias)
    assert out.shape == (2, m, n)
    want = fp8_linear_ref(x.view(-1, k), w, scale, block, bias).view(2, m, n)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


@interp
@pytest.mark.parametrize("num_tokens,block", [(1, (128, 128)), (13, (128, 128)), (37, None), (5, (32, 32))])
def test_interp_fused_moe_fp8_matches_reference(num_tokens, block, monkeypatch):
    from nanovllm.kernels import fused_moe
    from nanovllm.kernels.fused_moe import Tiles, fused_moe_triton
    monkeypatch.setattr(fused_moe, "quantize_activations", quantize_activations)
    g = torch.Generator().manual_seed(num_tokens)
    hidden, inter, experts, top_k = 256, 256, 4, 2
    x = torch.randn(num_tokens, hidden, generator=g)
    w13, s13 = quantize_weight(torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1, block)
    w2, s2 = quantize_weight(torch.randn(experts, hidden, inter, generator=g) * 0.1, block)
    logits = torch.randn(num_tokens, experts, generator=g)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    tiles = Tiles(16, 32, 32, 4, 1)
    out = fused_moe_triton(x, w13, w2, weights, ids, tiles, scales=(s13, s2, block))
    want = fused_moe_fp8_ref(x, w13, s13, w2, s2, block, weights, ids)
    # h is quantized between the GEMMs: a last-bit difference in h can move it one FP8 step
    torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("block", [4096, 16])   # 16: three column blocks a row, the last one partial
def test_interp_silu_and_mul_fp8_is_silu_and_mul_then_quantization(dtype, scaled, block, monkeypatch):
    """One kernel: the FP8 bytes and scales of SiLU-and-mul's output (in the dtype) quantized per row;
    the scales are the reference quantization's of those values bit for bit."""
    from nanovllm.kernels import norm_act
    from nanovllm.kernels.fp8_gemm import quantize_activations as quantize_triton
    from nanovllm.kernels.norm_act import silu_and_mul_fp8_triton, silu_and_mul_triton
    monkeypatch.setattr(norm_act, "SILU_FP8_BLOCK", block)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 2 * 40, generator=g) * 3).to(dtype)
    x[2] = 0.0   # an all-zero row: scale 1e-12, zeros
    scale_rows = dict(norm_of=(torch.randn(6, 24, generator=g) * 20).to(dtype), eps=1e-6) if scaled else {}
    rows = silu_and_mul_fp8_triton(x, **scale_rows)
    assert rows.q.shape == (6, 40) and rows.scale.shape == (6, 1) and rows.dtype == dtype
    out = silu_and_mul_triton(x, **scale_rows)
    q, s = quantize_triton(out, 40)
    assert_same_bytes(rows.q, q)
    assert torch.equal(rows.scale, s)
    want_q, want_s = quantize_activations(out, 40)
    assert torch.equal(rows.scale, want_s)
    assert_fp8_near(rows.q, want_q)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [64, 200])
def test_interp_add_quantize_is_the_add_then_quantization(dtype, k):
    """h += y in h's dtype (torch's add_), and h's new rows quantized per row, from one kernel."""
    from nanovllm.kernels.fp8_gemm import add_quantize
    from nanovllm.kernels.fp8_gemm import quantize_activations as quantize_triton
    g = torch.Generator().manual_seed(k)
    h = (torch.randn(5, k, generator=g) * 30).to(dtype)
    y = torch.randn(5, k, generator=g).to(dtype)
    h[1], y[1] = 0.0, 0.0   # an all-zero row
    fused_h, want_h = h.clone(), h.clone()
    rows = add_quantize(fused_h, y)
    want = add_quantize_ref(want_h, y)
    assert torch.equal(fused_h, want_h)
    assert rows.dtype == dtype and rows.scale.shape == (5, 1)
    assert torch.equal(rows.scale, want.scale)
    assert_fp8_near(rows.q, want.q)
    q, s = quantize_triton(want_h, k)
    assert_same_bytes(rows.q, q)


@interp
def test_interp_fp8_linear_takes_fp8_rows():
    """Fp8Rows of x into the per-channel GEMM: what fp8_linear(x) computes (it quantizes x first)."""
    from nanovllm.kernels.fp8_gemm import fp8_linear
    from nanovllm.kernels.fp8_gemm import quantize_activations as quantize_triton
    g = torch.Generator().manual_seed(3)
    w, scale = quantize_weight(torch.randn(48, 80, generator=g) * 0.1, None)
    x, bias = torch.randn(7, 80, generator=g), torch.randn(48, generator=g)
    rows = Fp8Rows(*quantize_triton(x, 80), x.dtype)
    assert torch.equal(fp8_linear(rows, w, scale, None, bias), fp8_linear(x, w, scale, None, bias))
    with pytest.raises(AssertionError, match="per-channel"):
        fp8_linear(rows, w, scale, (16, 16))


@interp
def test_interp_fused_quantization_in_a_model_gives_the_unfused_numbers(tmp_path, monkeypatch):
    """A per-channel FP8 model (quantization='fp8' on a bf16 checkpoint: the norms folded, then
    quantized) on the CUDA path's FP8 layers, their kernels interpreted on CPU tensors: with
    FUSE_QUANTIZATION the same tokens and log-probabilities bit for bit as without. Of the 4 separate
    activation quantizations a layer (8 a step), 3 a step remain: o_proj's input (the attention
    output) in each layer, and layer 0's qkv_proj's (the embeddings); SiLU-and-mul quantizes for
    down_proj (2 a step), the adds after o_proj (2) and layer 0's down_proj (1) for the GEMM after
    them; layer 1's down_proj adds alone (the final norm reads h)."""
    from test_fp8 import SHAPES

    from nanovllm import LLM, SamplingParams
    from nanovllm.kernels import KERNELS, fp8_gemm
    from nanovllm.layers import fp8
    assert KERNELS == "triton"
    monkeypatch.setattr(fp8, "_on_gpu_kernels", lambda x: True)   # CPU tensors take the CUDA path
    calls = collections.Counter()

    def count(module, name):
        fn = getattr(module, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    count(fp8_gemm, "quantize_activations")
    count(fp8, "add_quantize")
    count(fp8, "silu_and_mul_fp8_triton")
    path = make_model(str(tmp_path / "qwen3"), "qwen3", **SHAPES)
    g = torch.Generator().manual_seed(0)   # RMSNorm weights other than 1: folding changes the weights
    randomize_tensors(path, "layernorm.weight", lambda shape: 1 + 0.3 * torch.randn(shape, generator=g))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)
    prompts = random_prompts(2, [5, 19], seed=2)
    results, counts = {}, {}
    for fuse in (False, True):
        monkeypatch.setattr(fp8, "FUSE_QUANTIZATION", fuse)
        calls.clear()
        llm = LLM(path, quantization="fp8", device="cpu", dtype="bfloat16", kvcache_block_size=16,
                  num_kvcache_blocks=16)
        assert llm.model_runner.model.model.layers[1].folded
        results[fuse] = [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                         for o in llm.generate(prompts, params, use_tqdm=False)]
        counts[fuse] = dict(calls)
        llm.shutdown()
    assert results[True] == results[False]
    unfused, fused = counts[False], counts[True]
    assert "add_quantize" not in unfused and "silu_and_mul_fp8_triton" not in unfused
    steps = fused["silu_and_mul_fp8_triton"] // 2
    assert steps >= 3 and unfused["quantize_activations"] == 8 * steps
    assert fused == {"quantize_activations": 3 * steps, "add_quantize": 3 * steps,
                     "silu_and_mul_fp8_triton": 2 * steps}
