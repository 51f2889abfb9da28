"""The skinny decode GEMM (kernels/gemv.py): under the Triton interpreter on the CPU against torch's
matmul, and which layers take it."""
import pytest
import torch

from conftest import interp, run_interpreted_tests
from nanovllm.kernels import gemv as gemv_module


def test_gemv_kernels_under_interpreter():
    run_interpreted_tests(__file__)


@interp
@pytest.mark.parametrize("mode", ["dot", "fma"])
@pytest.mark.parametrize("M,N,K,block_k",
                         [(1, 40, 64, 32), (2, 33, 96, 64), (4, 16, 80, 32), (3, 64, 128, 128)])
def test_interp_gemv_matches_matmul(mode, M, N, K, block_k):
    # N not a multiple of BLOCK_N (masked columns), K not a multiple of BLOCK_K (80, 96 with 64: masked
    # tail), M below the tile's rows (masked rows)
    torch.manual_seed(M * N + K)
    x, w, c = torch.randn(M, K), torch.randn(N, K), torch.randn(M, N)
    config = (mode, 16, block_k, 4, 2)
    torch.testing.assert_close(gemv_module.gemv(x, w, config=config), x @ w.T, atol=1e-4, rtol=1e-4)
    into = c.clone()
    out = gemv_module.gemv(x, w, into, config)
    assert out is into   # the product is added into C in place, as addmm_ with beta 1
    torch.testing.assert_close(into, c + x @ w.T, atol=1e-4, rtol=1e-4)


@interp
def test_interp_gemv_reads_strided_rows():
    # a view whose rows are further apart than K (the kernel takes x's row stride)
    x = torch.randn(2, 96)[:, :64]
    w = torch.randn(24, 64)
    torch.testing.assert_close(gemv_module.gemv(x, w, config=("dot", 16, 32, 4, 2)), x @ w.T,
                               atol=1e-4, rtol=1e-4)


def test_gemv_config_only_for_swept_shapes_and_small_batches(monkeypatch):
    monkeypatch.setattr(gemv_module, "CONFIGS", {(8, 16, 2): ("dot", 16, 16, 4, 2)})
    w = torch.empty(8, 16)
    assert gemv_module.gemv_config(torch.empty(2, 16), w) is None   # the CPU: never
    meta = torch.device("meta")

    class FakeCuda(torch.Tensor):
        is_cuda = True
    x2 = torch.empty(2, 16, device=meta).as_subclass(FakeCuda)
    x3 = torch.empty(3, 16, device=meta).as_subclass(FakeCuda)
    x8 = torch.empty(8, 16, device=meta).as_subclass(FakeCuda)
    assert gemv_module.gemv_config(x2, w) == ("dot", 16, 16, 4, 2)
    assert gemv_module.gemv_config(x3, w) is None        # M not swept for this shape
    assert gemv_module.gemv_config(x8, w) is None        # past GEMV_MAX_M
    assert gemv_module.gemv_config(x2, torch.empty(8, 32)) is None   # another shape
