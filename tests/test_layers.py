"""Layers against transformers' Qwen3 modules (fp32, CPU, world size 1)."""
import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3 import modeling_qwen3 as hf

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
    torch.testing.assert_close(q_ours, q_ref[0].transpose(0, 1))
    torch.testing.assert_close(k_ours, k_ref[0].transpose(0, 1))


def test_get_rope_is_cached():
    assert get_rope(16, 256, 10000.0) is get_rope(16, 256, 10000)
    assert get_rope(16, 256, 10000.0) is not get_rope(16, 256, 5000.0)


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


@pytest.mark.parametrize("name", ["rms_norm", "add_rms_norm", "silu_and_mul"])
def test_compiled_ops_round_like_eager_torch(name):
    """The CUDA path compiles these ops with COMPILE_OPTIONS; compiled the same way here (inductor's
    CPU back end), bf16 outputs must equal eager torch's bit for bit: without
    emulate_precision_casts about a quarter of them are one ulp off."""
    from nanovllm.layers import activation, layernorm
    from nanovllm.layers.compile import COMPILE_OPTIONS
    fn = {"rms_norm": layernorm.rms_norm, "add_rms_norm": layernorm.add_rms_norm,
          "silu_and_mul": activation.silu_and_mul}[name].__wrapped__
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(64, 512, generator=g).to(torch.bfloat16) for _ in range(2))
    w = (torch.rand(512, generator=g) + 0.5).to(torch.bfloat16)
    args = {"rms_norm": (x, w, 1e-6), "add_rms_norm": (x, r, w, 1e-6), "silu_and_mul": (x,)}[name]
    eager, compiled = fn(*args), torch.compile(fn, **COMPILE_OPTIONS)(*args)
    if not isinstance(eager, tuple):
        eager, compiled = (eager,), (compiled,)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))
