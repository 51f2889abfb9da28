"""The W4A16 / W8A16 Triton GEMM under the interpreter (fp32, tiny shapes) against the torch reference
(kernels/wna16_reference.py: W dequantized, then a float GEMM); tests/test_int4_gpu.py runs it compiled."""
import pytest
import torch
import torch.nn.functional as F
from conftest import interp, run_interpreted_tests

from nanovllm.kernels.wna16_reference import dequantize, pack


def test_int4_kernels_under_interpreter():
    run_interpreted_tests(__file__)


def random_packed(n: int, k: int, bits: int, group: int | None, act_order: bool, seed: int):
    """A random packed weight (values, zero points, scales, g_idx) in the reference's form."""
    g = torch.Generator().manual_seed(seed)
    top = 2 ** bits
    groups = 1 if group is None else -(-k // group)
    values = torch.randint(0, top, (k, n), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, top, (groups, n), generator=g, dtype=torch.int32)
    scales = torch.rand(groups, n, generator=g) * 0.02 + 0.001
    g_idx = torch.randint(0, groups, (k,), generator=g, dtype=torch.int32) if act_order else None
    return pack(values, bits, 0), scales, zeros, g_idx


def check_gemm(m, n, k, bits, group, act_order, dtype=torch.float32, device="cpu", **blocks):
    from nanovllm.kernels.wna16_gemm import wna16_linear
    packed = random_packed(n, k, bits, group, act_order, m + k)
    q, s, z, g_idx = (t if t is None else t.to(device) for t in packed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)).to(device, dtype)
    out = wna16_linear(x, q, s, z, g_idx, bits, group, **blocks)
    ref = F.linear(x, dequantize(q, s, z, g_idx, bits, group, dtype))
    assert out.dtype == dtype and out.shape == (m, n)
    return out, ref


@interp
@pytest.mark.parametrize("m,n,k,bits,group,act_order", [
    (1, 64, 64, 4, 32, False), (5, 48, 96, 4, 32, False), (17, 64, 128, 4, 64, True),
    (3, 40, 64, 8, 16, False), (2, 64, 64, 4, None, False), (4, 64, 96, 8, None, True)])
def test_interp_wna16_gemm_matches_the_reference(m, n, k, bits, group, act_order):
    out, ref = check_gemm(m, n, k, bits, group, act_order, block_n=32, block_k=32)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)


@interp
def test_interp_the_gemm_sees_a_wrong_zero_point():
    """The check above can fail: the reference with every zero point one larger differs."""
    from nanovllm.kernels.wna16_gemm import wna16_linear
    q, s, z, _ = random_packed(32, 64, 4, 32, False, 0)
    x = torch.randn(3, 64)
    wrong = F.linear(x, dequantize(q, s, z + 1, None, 4, 32, torch.float32))
    assert not torch.allclose(wna16_linear(x, q, s, z, None, 4, 32), wrong)
