"""Layers against transformers' Qwen3 modules (fp32, CPU, world size 1); the RMSNorm and SiLU-and-mul
Triton kernels against eager torch under the Triton interpreter (conftest.run_interpreted_tests)."""
import gc
import weakref

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3 import modeling_qwen3 as hf

from conftest import interp, run_interpreted_tests
from nanovllm.kernels import add_rms_norm, rms_norm, silu_and_mul
from nanovllm.kernels.reference import add_rms_norm_ref, rms_norm_ref, silu_and_mul_ref
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import get_rope
from nanovllm.models.llama import LlamaMLP

CFG = Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=256)


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def test_rmsnorm_matches_transformers_plain_and_fused():
    ref = hf.Qwen3RMSNorm(64, eps=1e-6)
    ref.weight.data.normal_()
    ours = RMSNorm(64, eps=1e-6)
    ours.weight.data.copy_(ref.weight.data)
    x, res = torch.randn(5, 64), torch.randn(5, 64)
    torch.testing.assert_close(ours(x), ref(x))
    y, new_res = ours(x, res)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(y, ref(x + res))


def test_rotary_matches_transformers():
    positions = torch.tensor([0, 1, 7, 100, 255])
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    rope = get_rope(16, 256, 10000.0)
    q_ours, k_ours = rope(positions, q, k)
    cos, sin = hf.Qwen3RotaryEmbedding(CFG)(q, positions[None])
    # transformers lays q out as [batch, heads, seq, dim]
    q_ref, k_ref = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    # (.cpu(): on a GPU machine transformers may compute cos/sin on the GPU)
    torch.testing.assert_close(q_ours.cpu(), q_ref[0].transpose(0, 1).cpu())
    torch.testing.assert_close(k_ours.cpu(), k_ref[0].transpose(0, 1).cpu())


def test_get_rope_is_cached():
    assert get_rope(16, 256, 10000.0) is get_rope(16, 256, 10000)
    assert get_rope(16, 256, 10000.0) is not get_rope(16, 256, 5000.0)


def test_get_rope_keeps_no_table_once_no_model_uses_it():
    # the cache must not keep a released model's cos/sin table (on its device) alive
    rope = get_rope(16, 300, 10000.0)
    gone = weakref.ref(rope)
    del rope
    gc.collect()
    assert gone() is None


def test_mlp_with_merged_gate_up_matches_transformers():
    ref = hf.Qwen3MLP(CFG)
    ours = LlamaMLP(CFG)
    p = ours.gate_up_proj.weight
    p.weight_loader(p, ref.gate_proj.weight.data, 0)
    p.weight_loader(p, ref.up_proj.weight.data, 1)
    ours.down_proj.weight.weight_loader(ours.down_proj.weight, ref.down_proj.weight.data)
    x = torch.randn(3, 64)
    torch.testing.assert_close(ours(x), ref(x))


def test_silu_and_mul():
    x = torch.randn(4, 10)
    torch.testing.assert_close(SiluAndMul()(x), torch.nn.functional.silu(x[:, :5]) * x[:, 5:])


def test_qkv_loader_places_q_k_v():
    layer = QKVParallelLinear(8, head_dim=2, num_heads=4, num_kv_heads=2, bias=True)
    q, k, v = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)
    for shard, w in (("q", q), ("k", k), ("v", v)):
        layer.weight.weight_loader(layer.weight, w, shard)
    torch.testing.assert_close(layer.weight.data, torch.cat([q, k, v]))
    with pytest.raises(ValueError, match="shape mismatch"):
        layer.weight.weight_loader(layer.weight, torch.randn(4, 9), "k")


def test_merged_column_and_row_shapes():
    merged = MergedColumnParallelLinear(6, [4, 4])
    assert merged.weight.shape == (8, 6)
    row = RowParallelLinear(8, 6, bias=True)
    row.weight.weight_loader(row.weight, torch.ones(6, 8))
    row.bias.weight_loader(row.bias, torch.arange(6.0))
    torch.testing.assert_close(row(torch.ones(1, 8)), 8 + torch.arange(6.0)[None])


def test_embedding_and_lm_head():
    emb = VocabParallelEmbedding(100, 64)
    w = torch.randn(100, 64)
    emb.weight.weight_loader(emb.weight, w)
    ids = torch.tensor([0, 5, 99])
    torch.testing.assert_close(emb(ids), w[ids])
    head = ParallelLMHead(100, 64)
    head.weight.weight_loader(head.weight, w)
    x = torch.randn(2, 64)
    torch.testing.assert_close(head(x), x @ w.T)


def test_norm_and_activation_on_cpu_are_the_reference():
    # CPU tensors take the plain torch code whatever the back end: CPU results never depend on Triton.
    x, r = torch.randn(3, 64).bfloat16(), torch.randn(3, 64).bfloat16()
    w = torch.rand(64).bfloat16()
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    assert all(torch.equal(a, b)
               for a, b in zip(add_rms_norm(x, r, w, 1e-6), add_rms_norm_ref(x, r, w, 1e-6)))
    assert torch.equal(silu_and_mul(x), silu_and_mul_ref(x))


def test_triton_kernels_under_interpreter():
    run_interpreted_tests(__file__)


# ---- RMSNorm and SiLU-and-mul kernels under the Triton interpreter, against eager torch ----

def norm_inputs(num_tokens, hidden, dtype, seed=0):
    """x and residual rows of large (3e4), tiny (1e-4: mean square below eps) and unit magnitude,
    and a weight in [0.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([3e4, 1e-4, 1.0])[torch.arange(num_tokens) % 3, None]
    x = (torch.randn(num_tokens, hidden, generator=g) * 2 * scale).to(dtype)
    residual = (torch.randn(num_tokens, hidden, generator=g) * scale).to(dtype)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    return x, residual, weight


def assert_same(out, ref):
    """16-bit: bit for bit; fp32: within 1e-6 (numpy's and torch's fp32 sums add in another order)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(out, ref), f"{int((out != ref).sum())} of {out.numel()} values differ"


@interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 3, 64])
@pytest.mark.parametrize("hidden", [64, 96, 1024])
def test_interp_rms_norm_matches_eager_torch(dtype, num_tokens, hidden):
    from nanovllm.kernels.norm_act import add_rms_norm_triton, rms_norm_triton
    x, residual, weight = norm_inputs(num_tokens, hidden, dtype)
    assert_same(rms_norm_triton(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))
    out, res_out = add_rms_norm_triton(x, residual, weight, 1e-6)
    ref, res_ref = add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(res_out, res_ref)   # one rounded add: exact in every dtype
    assert_same(out, ref)


@interp
def test_interp_rms_norm_matches_transformers_in_bf16():
    from nanovllm.kernels.norm_act import rms_norm_triton
    x, _, weight = norm_inputs(9, 96, torch.bfloat16, seed=1)
    ref = hf.Qwen3RMSNorm(96, eps=1e-6).bfloat16()
    ref.weight.data.copy_(weight)
    assert torch.equal(rms_norm_triton(x, weight, 1e-6), ref(x))


@interp
def test_interp_rms_norm_strided_rows_and_fp32_weight():
    # A row stride wider than hidden (a column slice) is read in place; a bf16 x with an fp32
    # weight gives fp32, as eager torch's type promotion does.
    from nanovllm.kernels.norm_act import add_rms_norm_triton, rms_norm_triton
    wide, residual, _ = norm_inputs(5, 160, torch.bfloat16, seed=2)
    x, weight = wide[:, 32:128], torch.rand(96) + 0.5
    out = rms_norm_triton(x, weight, 1e-5)
    assert out.dtype == torch.float32
    assert torch.equal(out, rms_norm_ref(x, weight, 1e-5))
    out, res_out = add_rms_norm_triton(x, residual[:, :96], weight, 1e-5)
    ref, res_ref = add_rms_norm_ref(x, residual[:, :96], weight, 1e-5)
    assert torch.equal(out, ref) and torch.equal(res_out, res_ref)
    assert rms_norm_triton(x[:0], weight, 1e-5).shape == (0, 96)   # no rows: no launch


@interp
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")   # exp(-gate) for gate < -88: inf, silu -0
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 3, 64])
@pytest.mark.parametrize("d", [64, 96, 1536])
def test_interp_silu_and_mul_matches_eager_torch(dtype, num_tokens, d):
    # d = 1536: two column blocks of 1024, the second one half masked
    from nanovllm.kernels.norm_act import silu_and_mul_triton
    g = torch.Generator().manual_seed(d)
    scale = torch.tensor([30.0, 1e-3, 3.0])[torch.arange(num_tokens) % 3, None]
    x = (torch.randn(num_tokens, 2 * d, generator=g) * scale).to(dtype)
    assert_same(silu_and_mul_triton(x), silu_and_mul_ref(x))


@interp
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_interp_silu_and_mul_leading_dims_and_extremes():
    from nanovllm.kernels.norm_act import silu_and_mul_triton
    x = torch.randn(2, 3, 2 * 40).bfloat16()
    x[0, 0, :6] = torch.tensor([-200.0, 200.0, 0.0, -0.0, 88.0, -88.0])   # exp overflow and underflow
    out = silu_and_mul_triton(x)
    assert out.shape == (2, 3, 40)
    assert torch.equal(out, silu_and_mul_ref(x))
