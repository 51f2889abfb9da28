"""The FP8 Triton kernels under the interpreter (fp32 models, tiny shapes) against the torch
reference (kernels/fp8_reference.py): the activation quantization bit for bit, the block-scaled and
per-channel GEMMs, and the fused MoE with FP8 experts. tests/test_fp8_gpu.py runs them compiled."""
import pytest
import torch
import torch.nn.functional as F
from conftest import interp, run_interpreted_tests

from nanovllm.kernels.fp8_reference import (dequantize_weight, fp8_linear_ref, fused_moe_fp8_ref,
                                            quantize_activations, quantize_weight)
from nanovllm.kernels.moe_reference import select_experts


def test_fp8_kernels_under_interpreter():
    run_interpreted_tests(__file__)


@interp
@pytest.mark.parametrize("m,k,group", [(3, 256, 128), (4, 300, 128), (2, 200, 200), (1, 2500, 2500),
                                       (2, 1100, 100)])
@pytest.mark.parametrize("one_pass_max,group_tile", [(16384, 4096), (16384, 256), (0, 4096)],
                         ids=["one-pass", "two-groups-a-program", "two-pass"])
def test_interp_activation_quantization_is_the_reference_bit_for_bit(m, k, group, one_pass_max, group_tile,
                                                                     monkeypatch):
    from nanovllm.kernels import fp8_gemm
    monkeypatch.setattr(fp8_gemm, "ONE_PASS_MAX", one_pass_max)
    monkeypatch.setattr(fp8_gemm, "GROUP_TILE", group_tile)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * torch.logspace(-2, 2, k)
    x[0, :group] = 0.0   # an all-zero group
    check_quantization(x, group)


def check_quantization(x, group, m_major=False, rows=None, scale_ub=None):
    from nanovllm.kernels.fp8_gemm import quantize_activations as quantize_triton
    m = x.shape[0]
    q, s = quantize_triton(x, group, m_major=m_major, rows=rows, scale_ub=scale_ub)
    assert q.shape[0] == s.shape[0] == (rows or m)
    assert not m_major or s.stride() == (1, rows or m)
    q, s = q[:m], s[:m]
    want_q, want_s = quantize_activations(x, group, scale_ub)
    assert torch.equal(s, want_s)
    # The interpreter's fp32 -> e4m3 cast is off for a value just under a power of two (-7.95 to -4)
    # and for subnormals: those few may differ, by at most half the value or a subnormal step (the
    # GPU's cast is the reference's: tests/test_fp8_gpu.py compares them bit for bit).
    q, want_q = q.float(), want_q.float()
    bad = q != want_q
    assert bad.float().mean() < 0.1
    assert ((q - want_q).abs()[bad] <= 0.5 * want_q.abs()[bad] + 2 ** -8).all()


@interp
@pytest.mark.parametrize("one_pass_max", [16384, 0], ids=["one-pass", "two-pass"])
def test_interp_activation_scale_ub_bounds_the_scales_and_saturates(one_pass_max, monkeypatch):
    """fbgemm_fp8's activation_scale_ub: a token whose amax passes it gets the scale ub / 448, and its
    values past ub saturate at +-448; a token under it is quantized as without it."""
    from nanovllm.kernels import fp8_gemm
    from nanovllm.kernels.fp8_gemm import quantize_activations as quantize_triton
    monkeypatch.setattr(fp8_gemm, "ONE_PASS_MAX", one_pass_max)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    x[:2] *= 100.0   # amax far past the bound
    x[2] *= 0.01     # under it
    ub = 8.0
    check_quantization(x, 256, scale_ub=ub)
    q, s = quantize_triton(x, 256, scale_ub=ub)
    assert s[0, 0] == torch.tensor(ub) / 448 and s[1, 0] == s[0, 0]
    assert q[0].float().abs().max() == 448 and (q[0].float().abs() == 448).sum() > 10
    unbounded_q, unbounded_s = quantize_triton(x, 256)
    assert torch.equal(s[2], unbounded_s[2]) and torch.equal(q[2].float(), unbounded_q[2].float())
    assert (s[:2] < unbounded_s[:2]).all()


@interp
@pytest.mark.parametrize("k,group", [(17000, 17000), (1000, 128)])   # over ONE_PASS_MAX: two passes
def test_interp_activation_quantization_of_strided_rows_with_m_major_scales(k, group):
    # rows 40 columns apart (a slice of a wider tensor), scales stored M-major (cuBLASLt's block
    # scales) in 4 rows, as cuBLASLt's block-scaled GEMM takes them (the fourth left unwritten)
    wide = torch.randn(3, k + 40, generator=torch.Generator().manual_seed(k)) * torch.logspace(-2, 2, k + 40)
    check_quantization(wide[:, :k], group, m_major=True, rows=4)


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
@pytest.mark.parametrize("m", [0, 1, 3, 4, 6])
def test_interp_cublas_block_path_pads_rows_and_lays_scales_out_as_cublaslt_takes_them(m, monkeypatch):
    """fp8_linear's torch._scaled_mm call for the block format, checked on the CPU against a stand-in
    that asserts what torch's 1x128 x 128x128 check and cuBLASLt require (rows a multiple of 4,
    activation scales [rows, K/128] M-major, weight scales [K/128, N/128] K-major) and computes the
    block-scaled product; the padding's rows must not reach the output."""
    from nanovllm.kernels import fp8_gemm
    n, k = 256, 512
    g = torch.Generator().manual_seed(m)
    w, scale = quantize_weight(torch.randn(n, k, generator=g) * 0.1, (128, 128))
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    calls = []

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        rows = a.shape[0]
        assert rows % 4 == 0 and rows >= m and b.shape == (k, n) and b.stride() == (1, k)
        assert scale_a.shape == (rows, k // 128) and scale_a.stride() == (1, rows)
        assert scale_b.shape == (k // 128, n // 128) and scale_b.stride() == (1, k // 128)
        a_deq = (a.float().view(rows, -1, 128) * scale_a[:, :, None]).view(rows, k)
        calls.append(rows)
        return (a_deq @ dequantize_weight(b.t(), scale_b.t(), (128, 128), torch.float32).t()).to(out_dtype)
    def reference_quantization(x, group, m_major=False, rows=None, scale_ub=None):
        # (the interpreter's FP8 cast is off for a few values: see check_quantization, which tests the
        # kernel's m_major and rows layouts)
        if not len(x):
            groups = -(-x.shape[1] // group)
            return torch.empty(0, x.shape[1], dtype=torch.float8_e4m3fn), torch.empty(0, groups)
        q, s = quantize_activations(x, group, scale_ub)
        q, s = (F.pad(t.float(), (0, 0, 0, (rows or len(x)) - len(x))) for t in (q, s))
        return q.to(torch.float8_e4m3fn), (s.t().contiguous().t() if m_major else s)
    monkeypatch.setattr(fp8_gemm, "quantize_activations", reference_quantization)
    monkeypatch.setattr(fp8_gemm, "_DOT_F32", False)   # the cuBLASLt branch
    monkeypatch.setattr(fp8_gemm, "_cublaslt_block_scales", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    out = fp8_gemm.fp8_linear(x.view(1, m, k), w, scale, (128, 128), bias)
    assert out.shape == (1, m, n) and out.dtype == torch.bfloat16
    assert calls == ([-(-m // 4) * 4] if m else [])   # no rows: the Triton path, no _scaled_mm
    if m:
        want = fp8_linear_ref(x, w, scale, (128, 128), bias)
        torch.testing.assert_close(out[0], want, atol=1e-2, rtol=1e-2)


@pytest.fixture
def cublas_stand_in(monkeypatch):
    """fp8_linear's cuBLASLt branches on the CPU: torch._scaled_mm a stand-in that asserts unit
    per-tensor scales or row-wise ones and computes the FP8 product; the activations quantized by
    the reference. Returns the list of the stand-in's calls ("unit" / "row-wise")."""
    from nanovllm.kernels import fp8_gemm
    calls = []

    def scaled_mm(a, w_t, scale_a, scale_b, out_dtype, use_fast_accum):
        calls.append("unit" if scale_a.dim() == 0 else "row-wise")
        assert scale_a.dim() == 0 or scale_a.shape == (a.shape[0], 1)
        assert scale_a.dim() != 0 or (scale_a.item() == scale_b.item() == 1.0 and scale_b.dim() == 0)
        return ((a.float() * scale_a) @ (w_t.float() * scale_b)).to(out_dtype)
    monkeypatch.setattr(fp8_gemm, "quantize_activations",   # the reference's (see above)
                        lambda x, group, scale_ub=None: quantize_activations(x, group, scale_ub)
                        if len(x) else
                        (x.to(torch.float8_e4m3fn), torch.empty(0, 1)))
    monkeypatch.setattr(fp8_gemm, "_DOT_F32", False)   # the cuBLASLt branch
    monkeypatch.setattr(fp8_gemm, "_unit_scale", lambda device: torch.ones(()))
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    return calls


@interp
@pytest.mark.parametrize("m,n,bias,residual", [(0, 48, False, True), (1, 48, True, False),
                                              (5, 2112, False, True), (3, 2112, True, False),
                                              (4, 64, False, False)])
@pytest.mark.parametrize("ub", [None, 2.0])
def test_interp_unit_scale_path_scales_rows_and_channels_after_the_gemm(m, n, bias, residual, ub,
                                                                         cublas_stand_in, monkeypatch):
    """fp8_linear's per-channel path at most UNIT_SCALE_MAX_M rows: the unit-scaled GEMM then
    scale_out, the rows' and channels' scales (and the bias) applied in place, or added into the
    residual (into=) in place: the reference's output. Above it: row-wise scales. ub: an
    activation_scale_ub under the rows' amax (about 9), on both paths as in the reference."""
    from nanovllm.kernels import fp8_gemm
    k = 64
    g = torch.Generator().manual_seed(m + n)
    w, scale = quantize_weight(torch.randn(n, k, generator=g) * 0.1, None)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    calls = cublas_stand_in
    want = (fp8_linear_ref(x.float(), w, scale, None, None if b is None else b.float(), ub) if m
            else torch.empty(0, n))
    h = torch.randn(m, n, generator=g).to(torch.bfloat16)
    for max_m, path in ((8, "unit"), (0, "row-wise")):
        monkeypatch.setattr(fp8_gemm, "UNIT_SCALE_MAX_M", max_m)
        calls.clear()
        into = h.clone().view(1, m, n) if residual else None
        out = fp8_gemm.fp8_linear(x.view(1, m, k), w, scale, None, b, into, scale_ub=ub)
        assert out.shape == (1, m, n) and out.dtype == torch.bfloat16
        assert calls == ([path] if m else [])
        assert into is None or out is into
        # (the unit path rounds the unscaled product to bf16 first: twice a bf16 rounding at most)
        torch.testing.assert_close(out[0].float(), want + (h.float() if residual else 0), atol=3e-2,
                                   rtol=2 ** -7)
        # fp8_linear_unscaled (no bias): on the unit path the scales are left to the caller, and
        # applying them gives fp8_linear's output bit for bit; elsewhere (or DEFER_SCALES off) it is
        # fp8_linear's output, no scales
        want_unbiased = fp8_gemm.fp8_linear(x.view(1, m, k), w, scale, None, scale_ub=ub)
        for defer in (True, False):
            monkeypatch.setattr(fp8_gemm, "DEFER_SCALES", defer)
            y, scales = fp8_gemm.fp8_linear_unscaled(x.view(1, m, k), w, scale, None, ub)
            assert (scales is not None) == (defer and path == "unit" and m > 0)
            if scales is not None:
                assert scales[0].shape == (m, 1) and scales[1].shape == (n,)
                y = fp8_gemm.scale_out(y.view(m, n), *scales, None).view(1, m, n)
            assert torch.equal(y, want_unbiased)


@interp
@pytest.mark.parametrize("folded,bias", [(False, False), (True, False), (False, True)])
def test_interp_mlp_leaves_gate_up_scales_to_silu_and_mul_with_the_same_output(folded, bias, cublas_stand_in,
                                                                               monkeypatch):
    """LlamaMLP with FP8 gate/up and down (per channel) at decode sizes: gate_up_proj.forward_unscaled
    hands its scales to SiLU-and-mul (DEFER_SCALES), and the MLP's output is the same bit for bit as
    with scale_out before SiLU-and-mul; folded: a folded RMSNorm (norm_of) and down adding into the
    residual. A bias (or LoRA) keeps the scales in the layer."""
    from types import SimpleNamespace

    from nanovllm.kernels import fp8_gemm
    from nanovllm.models.llama import LlamaMLP
    from nanovllm.quantization import fp8_methods as fp8_layers
    monkeypatch.setattr(fp8_layers, "_on_gpu_kernels", lambda x: True)   # (imported with the kernels on)
    for name in ("fp8_linear", "fp8_linear_unscaled"):
        monkeypatch.setattr(fp8_layers, name, getattr(fp8_gemm, name), raising=False)
    g = torch.Generator().manual_seed(7)
    mlp = LlamaMLP(SimpleNamespace(hidden_size=64, intermediate_size=96, hidden_act="silu", mlp_bias=bias))
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        n, k = layer.weight.shape
        w, scale = quantize_weight(torch.randn(n, k, generator=g) * 0.1, None)
        layer.quant = fp8_layers.Fp8LinearMethod(None)
        layer.quant.create_weights(layer)
        layer.weight.data, layer.weight_scale.data = w, scale
        if bias:
            layer.bias.data = torch.randn(n, generator=g).to(torch.bfloat16)
    x = (torch.randn(5, 64, generator=g) * 3).to(torch.bfloat16)
    outs = []
    for defer in (True, False):
        monkeypatch.setattr(fp8_gemm, "DEFER_SCALES", defer)
        y, scales = mlp.gate_up_proj.forward_unscaled(x)
        assert (scales is not None) == (defer and not bias)
        outs.append(mlp(x.clone(), norm_eps=1e-6) if folded else mlp(x))
    assert cublas_stand_in and set(cublas_stand_in) == {"unit"}
    assert torch.equal(outs[0], outs[1])


@interp
@pytest.mark.parametrize("num_tokens,block,scale_after,block_k", [
    (1, (128, 128), True, 32), (13, (128, 128), True, 32), (37, None, True, 32), (37, None, False, 32),
    (5, (32, 32), True, 32), (13, (128, 128), True, 128), (37, None, True, 128)])
def test_interp_fused_moe_fp8_matches_reference(num_tokens, block, scale_after, block_k, monkeypatch):
    """scale_after: fused_moe.SCALE_AFTER_LOOP (per channel: the scales after the K loop, or every slice);
    block_k 128: FP8 prefill's K slice (a whole 128-column scale group a slice)."""
    from nanovllm.kernels import fused_moe
    from nanovllm.kernels.fused_moe import Tiles, fused_moe_triton
    monkeypatch.setattr(fused_moe, "quantize_activations", quantize_activations)
    monkeypatch.setattr(fused_moe, "SCALE_AFTER_LOOP", scale_after)
    g = torch.Generator().manual_seed(num_tokens)
    hidden, inter, experts, top_k = 256, 256, 4, 2
    x = torch.randn(num_tokens, hidden, generator=g)
    w13, s13 = quantize_weight(torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1, block)
    w2, s2 = quantize_weight(torch.randn(experts, hidden, inter, generator=g) * 0.1, block)
    logits = torch.randn(num_tokens, experts, generator=g)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    tiles = Tiles(16, 32, block_k, 4, 1)
    out = fused_moe_triton(x, w13, w2, weights, ids, tiles, scales=(s13, s2, block))
    want = fused_moe_fp8_ref(x, w13, s13, w2, s2, block, weights, ids)
    # h is quantized between the GEMMs: a last-bit difference in h can move it one FP8 step
    torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
