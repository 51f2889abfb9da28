"""Llama, Qwen2 and Qwen3 (and their config variants) against transformers on tiny random models:
every greedy token must be an argmax of transformers' logits, for a batch of mixed prompt lengths
and for prompts that hit the prefix cache."""

import pytest
import torch
from conftest import HFOracle, make_model, random_prompts, randomize_tensors

from nanovllm import LLM, SamplingParams
from nanovllm.models import MODEL_REGISTRY, get_model_class
from nanovllm.models.llama import LlamaDecoderLayer

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)

VARIANTS = {
    "llama": ("llama", {}),
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),   # q/k/v/o and MLP biases
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-rope-llama3": ("llama", dict(rope_scaling=dict(LLAMA3_ROPE), rope_theta=500000.0)),
    "qwen2": ("qwen2", {}),                                                # q/k/v biases, no o bias
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", {}),
    "qwen3-head-dim-32": ("qwen3", dict(head_dim=32)),                     # head_dim != hidden / heads
    "qwen3-attention-bias": ("qwen3", dict(attention_bias=True)),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def randomize_biases(path: str, seed: int = 1):
    """HF initialises biases to zero, which would hide a bias loaded into the wrong place."""
    g = torch.Generator().manual_seed(seed)
    randomize_tensors(path, ".bias", lambda shape: torch.randn(shape, generator=g) * 0.5)


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    path = make_model(str(tmp_path_factory.mktemp(request.param)), arch, **overrides)
    randomize_biases(path)
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=64)
    return request.param, path, llm, HFOracle(path)


def test_mixed_prompt_lengths_match_transformers(variant):
    _, _, llm, oracle = variant
    prompts = random_prompts(5, [1, 7, 16, 17, 45], seed=3)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        oracle.assert_greedy(prompt, out.outputs[0].token_ids)


def test_prefix_cache_hits_match_transformers(variant):
    _, _, llm, oracle = variant
    shared = random_prompts(1, [40], seed=7)[0]
    llm.generate([shared], GREEDY, use_tqdm=False)   # fills and registers two full blocks
    prompts = [shared + [5, 6, 7], shared[:33], shared]
    computed = _record_prefill_tokens(llm)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    # Each prompt reuses the two cached blocks (32 tokens), so the batch computes far fewer tokens.
    assert sum(computed) <= sum(len(p) for p in prompts) - 3 * 32
    for prompt, out in zip(prompts, outputs):
        oracle.assert_greedy(prompt, out.outputs[0].token_ids)


def _record_prefill_tokens(llm) -> list[int]:
    computed, run = [], llm.model_runner.launch

    def recording_run(batch, **kwargs):
        if batch.is_prefill:
            computed.extend(batch.num_new_tokens)
        return run(batch, **kwargs)

    llm.model_runner.launch = recording_run
    return computed


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_norm_weights_folded_into_the_gemms_match_transformers(tmp_path, arch):
    # RMSNorm weights far from HF's initial ones: the layers fold them into qkv_proj and
    # gate_up_proj at load (LlamaDecoderLayer.fold_norms), the kernels after those GEMMs apply
    # rstd, and the residual adds ride in o_proj and down_proj.
    path = make_model(str(tmp_path), arch)
    g = torch.Generator().manual_seed(5)
    randomize_tensors(path, "layernorm.weight", lambda shape: 0.5 + torch.rand(shape, generator=g) * 1.5)
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=64)
    assert all(layer.folded for layer in llm.model_runner.model.model.layers)
    oracle = HFOracle(path)
    prompts = random_prompts(4, [1, 9, 17, 40], seed=6)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        oracle.assert_greedy(prompt, out.outputs[0].token_ids)


def test_config_variant_is_built(variant):
    """The variant's config reached the model (so the comparison above covered it)."""
    name, _, llm, _ = variant
    model = llm.model_runner.model
    attn = model.model.layers[0].self_attn
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == name.endswith("-tied")
    assert (attn.qkv_proj.bias is not None) == (name.startswith("qwen2") or "bias" in name)
    assert (attn.o_proj.bias is not None) == ("bias" in name)
    assert (attn.q_norm is not None) == name.startswith("qwen3")
    assert attn.head_dim == (32 if name == "qwen3-head-dim-32" else 16)
    assert (model.model.layers[0].mlp.down_proj.bias is not None) == (name == "llama-biases")
    # the norms are folded into the GEMMs wherever no bias sits on them
    assert model.model.layers[0].folded == (attn.qkv_proj.bias is None and attn.o_proj.bias is None
                                            and name != "llama-biases")


def test_llama3_rope_scaling_changes_frequencies(tmp_path):
    """The llama3 rule slows long wavelengths by `factor`; without it the test above would pass
    only by luck, so check the frequencies themselves too."""
    # (a copy: transformers writes rope_theta into the dict it is given)
    path = make_model(str(tmp_path), "llama", tokenizer=False, rope_scaling=dict(LLAMA3_ROPE))
    llm = LLM(path, num_kvcache_blocks=4, kvcache_block_size=16)   # kept: deleting it frees the model
    scaled = llm.model_runner.model
    # position 1: angle = inv_freq (on the CPU: the engine may run on a GPU)
    cos_sin = scaled.model.layers[0].self_attn.rotary_emb.cos_sin_cache[1].float().cpu()
    inv = torch.atan2(cos_sin[8:], cos_sin[:8])
    plain = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    wavelen = 2 * torch.pi / plain
    long = wavelen > LLAMA3_ROPE["original_max_position_embeddings"]   # / low_freq_factor (1)
    short = wavelen < LLAMA3_ROPE["original_max_position_embeddings"] / 4   # / high_freq_factor
    torch.testing.assert_close(inv[long], plain[long] / 8, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(inv[short], plain[short], atol=1e-5, rtol=1e-4)


def test_registry_shares_one_decoder():
    # The Llama family; the hybrid linear-attention models (models/qwen3_5.py) and Gemma (models/gemma.py)
    # have decoders of their own.
    llama_family = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}
    assert set(MODEL_REGISTRY) - llama_family == {
        "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM",
        "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
        "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"}
    from transformers import Qwen3MoeConfig
    for arch in llama_family:
        config = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=8, architectures=[arch])
        model = get_model_class(config)(config)
        assert isinstance(model.model.layers[0], LlamaDecoderLayer)
