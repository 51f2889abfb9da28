"""FP8 weights and LoRA on the hybrid models (Qwen3.5 / Qwen3-Next) against transformers on tiny random
configs. FP8: checkpoints written here in the block layout Qwen publishes (quant_method 'fp8',
weight_scale_inv per block; the linear attention's in_proj_a/b/ba, the routers and lm_head kept in
bf16 by modules_to_not_convert), with 16 x 16 blocks so that the tiny projections hold several and the
partial-rotary reordering of q and k rows crosses blocks; every greedy token is an argmax of
transformers' logits on the dequantized model (also of the multimodal checkpoint, as published);
TP=2 gives TP=1's tokens; compressed-tensors FP8_DYNAMIC (per channel); quantization='fp8' on a
bf16 checkpoint; integer formats are refused.
LoRA: PEFT adapters on the gated q_proj (its gate packed with q), k/v/o and the dense MLP, against
PEFT's logits, TP=2 as TP=1, on block-FP8 weights too; adapters on the linear-attention projections
are a clear error."""
import json
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_5")   # transformers >= 5.2
from conftest import edit_checkpoint, HFOracle, random_prompts
from test_fp8 import CT_CONFIG, _set_quantization_config
from test_qwen35 import MOE, TEXT, make_qwen35
from transformers.models.qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_next import Qwen3NextConfig

from nanovllm import LLM, SamplingParams
from nanovllm.kernels.fp8_reference import quantize_weight

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FP8 = torch.float8_e4m3fn
BLOCK = (16, 16)
OPTIONS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=16, max_num_batched_tokens=48,
               max_num_seqs=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = random_prompts(3, [5, 23, 50], seed=2)
# the projections Qwen's FP8 checkpoints store in FP8 (the rest, in bf16, are in the ignore list)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
             "in_proj_qkv", "in_proj_z", "in_proj_qkvz", "out_proj")
# Qwen3-Next: a shared expert of 64 rows, 32 on each of two ranks (two 16-row blocks)
NEXT = dict(TEXT, **dict(MOE, shared_expert_intermediate_size=64), decoder_sparse_step=1,
            mlp_only_layers=[1], norm_topk_prob=False)


def _quantized(name: str, everything: bool) -> bool:
    """A projection's weight the checkpoint stores in FP8 (everything: every linear layer's, as
    quantization='fp8' quantizes them)."""
    leaf = name.split(".")[-2]
    return name.endswith(".weight") and (
        leaf in QUANTIZED or (everything and leaf in ("in_proj_a", "in_proj_b", "in_proj_ba")))


def _dequantize(w: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """The format's definition: each block (or row) of w times its scale."""
    if block is None:
        return w.float() * scale
    return w.float() * torch.kron(scale, torch.ones(block))[:w.shape[0], :w.shape[1]]


def dequantized_copy(src: str, dst: str, block, everything: bool = False) -> str:
    """src with each FP8 projection quantized and dequantized again (fp32): transformers' oracle."""
    shutil.copytree(src, dst)

    def dequantize(tensors):
        for name in [n for n in tensors if _quantized(n, everything)]:
            tensors[name] = _dequantize(*quantize_weight(tensors[name].float(), block), block)
    edit_checkpoint(dst, dequantize)
    return dst


def save_block_fp8(src: str, dst: str, checkpoint_prefix: str = "model.") -> str:
    """dst: src in Qwen's block-FP8 layout; dst + '-dequantized': its oracle. The ignore list names
    modules as the published checkpoints do (checkpoint_prefix: 'model.language_model.' for Qwen3.5's
    multimodal ones), which nanovllm matches to its own names."""
    shutil.copytree(src, dst)

    def quantize(tensors):
        for name in [n for n in tensors if _quantized(n, everything=False)]:
            w, s = quantize_weight(tensors[name].float(), BLOCK)
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = w, s
    edit_checkpoint(dst, quantize)
    dequantized_copy(src, dst + "-dequantized", BLOCK)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    layer_types = config.get("text_config", config)["layer_types"]   # a multimodal one's in text_config
    kept = ["lm_head"] + [f"{checkpoint_prefix}layers.{i}.{module}"
                          for i, kind in enumerate(layer_types) if kind == "linear_attention"
                          for module in ("linear_attn.in_proj_a", "linear_attn.in_proj_b",
                                         "linear_attn.in_proj_ba", "linear_attn.conv1d")]
    _set_quantization_config(dst, {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                   "weight_block_size": list(BLOCK), "modules_to_not_convert": kept})
    return dst


def greedy(llm) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def assert_transformers_argmax(path: str, outs: list[list[int]]):
    oracle = HFOracle(path)
    for prompt, out in zip(PROMPTS, outs):
        oracle.assert_greedy(prompt, out)


@pytest.fixture(scope="module")
def dense_bf16(tmp_path_factory):
    return make_qwen35(str(tmp_path_factory.mktemp("qwen35-bf16")), Qwen3_5TextConfig(**TEXT), seed=3)


def test_block_fp8_dense_matches_transformers_on_the_dequantized_model(dense_bf16, tmp_path):
    path = save_block_fp8(dense_bf16, str(tmp_path / "fp8"))
    llm = LLM(path, **OPTIONS)
    layers = llm.model_runner.model.model.layers
    attn, linear = layers[3].self_attn, layers[0].linear_attn
    # the gated q_proj and in_proj_qkvz move rows across blocks on load: their scales are per row
    assert attn.qkv_proj.weight.dtype == FP8 and attn.qkv_proj.weight_scale.shape == (256 + 128, 64 // 16)
    assert linear.in_proj_qkvz.weight.dtype == FP8 and linear.in_proj_qkvz.weight_scale.shape[0] == 192
    assert attn.o_proj.weight_scale.shape == (64 // 16, 128 // 16)   # plain layers keep their blocks
    assert linear.in_proj_ba.quant is None and linear.in_proj_ba.weight.dtype == torch.float32
    outs = greedy(llm)
    llm.shutdown()
    assert_transformers_argmax(path + "-dequantized", outs)


def test_block_fp8_multimodal_checkpoint_as_qwen_publishes_it(tmp_path):
    """Qwen3_5ForConditionalGeneration: the quantization_config at the top level of config.json, the
    text model's tensors and their ignore-list names under model.language_model."""
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
                  patch_size=4, spatial_merge_size=1, temporal_patch_size=1)
    config = Qwen3_5Config(text_config=TEXT, vision_config=vision, tie_word_embeddings=False)
    src = make_qwen35(str(tmp_path / "src"), config, seed=6, cls=Qwen3_5ForConditionalGeneration)
    path = save_block_fp8(src, str(tmp_path / "fp8"), "model.language_model.")
    llm = LLM(path, **OPTIONS)
    linear = llm.model_runner.model.model.layers[0].linear_attn
    assert linear.in_proj_qkvz.weight.dtype == FP8 and linear.in_proj_ba.quant is None
    outs = greedy(llm)
    llm.shutdown()
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(path + "-dequantized", dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0]
        assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out


def test_block_fp8_moe_matches_transformers(tmp_path):
    src = make_qwen35(str(tmp_path / "src"), Qwen3_5MoeTextConfig(**TEXT, **MOE), seed=4)
    path = save_block_fp8(src, str(tmp_path / "fp8"))
    llm = LLM(path, **OPTIONS)
    mlp = llm.model_runner.model.model.layers[1].mlp
    assert mlp.experts.w13.dtype == FP8 and mlp.shared_expert.gate_up_proj.weight.dtype == FP8
    assert mlp.gate.weight.dtype == torch.float32   # the router stays unquantized
    outs = greedy(llm)
    llm.shutdown()
    assert_transformers_argmax(path + "-dequantized", outs)


def test_block_fp8_qwen3_next_fused_projections_and_tp2(tmp_path):
    """Qwen3-Next's fused in_proj_qkvz (each key head's q, k, v, z rows together) de-interleaved with
    its per-row scales; TP=2 splits every projection and its scales as TP=1 reads them."""
    src = make_qwen35(str(tmp_path / "src"), Qwen3NextConfig(**NEXT), seed=5)
    path = save_block_fp8(src, str(tmp_path / "fp8"))
    llm = LLM(path, **OPTIONS)
    assert llm.model_runner.model.model.layers[0].linear_attn.in_proj_qkvz.weight.dtype == FP8
    one = greedy(llm)
    llm.shutdown()
    assert_transformers_argmax(path + "-dequantized", one)
    llm = LLM(path, tensor_parallel_size=2, **OPTIONS)
    try:
        assert greedy(llm) == one
    finally:
        llm.shutdown()


def test_quantization_fp8_quantizes_a_bf16_hybrid_at_load(dense_bf16, tmp_path):
    """Every sharded linear layer per channel (in_proj_ba too: nothing is ignored at load)."""
    llm = LLM(dense_bf16, quantization="fp8", **OPTIONS)
    linear = llm.model_runner.model.model.layers[0].linear_attn
    assert linear.in_proj_ba.weight.dtype == FP8 and linear.in_proj_qkvz.weight_scale.shape == (192, 1)
    outs = greedy(llm)
    llm.shutdown()
    assert_transformers_argmax(dequantized_copy(dense_bf16, str(tmp_path / "deq"), None, everything=True),
                               outs)


def test_compressed_tensors_fp8_dynamic_per_channel(dense_bf16, tmp_path):
    """llm-compressor's FP8_DYNAMIC (bf16 scales [N, 1]) on every linear layer, in_proj_a/b too: the
    gated q_proj's and the linear attention's scales follow their rows through the loaders."""
    path, oracle = str(tmp_path / "ct"), str(tmp_path / "deq")
    shutil.copytree(dense_bf16, path)
    shutil.copytree(dense_bf16, oracle)

    def quantize(tensors):
        for name in [n for n in tensors if _quantized(n, everything=True)]:
            w, s = quantize_weight(tensors[name].float(), None)
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale"] = w, s.bfloat16()
            tensors_deq[name] = _dequantize(w, s.bfloat16().float(), None)   # the oracle's weights
    tensors_deq = {}
    edit_checkpoint(path, quantize)
    edit_checkpoint(oracle, lambda tensors: tensors.update(tensors_deq))
    _set_quantization_config(path, CT_CONFIG)
    llm = LLM(path, **OPTIONS)
    assert llm.model_runner.model.model.layers[0].linear_attn.in_proj_ba.weight.dtype == FP8
    outs = greedy(llm)
    llm.shutdown()
    assert_transformers_argmax(oracle, outs)


@pytest.mark.parametrize("qconfig", [
    {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
    {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}])
def test_integer_formats_are_refused_for_hybrid_models(dense_bf16, tmp_path, qconfig):
    path = str(tmp_path / "int")
    shutil.copytree(dense_bf16, path)
    _set_quantization_config(path, qconfig)
    with pytest.raises(ValueError, match="integer weights.*not supported for hybrid"):
        LLM(path, **OPTIONS)


# ---- LoRA ------------------------------------------------------------------------------------------

LORA = dict(OPTIONS, num_kvcache_blocks=32, max_num_seqs=8, enable_lora=True, max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def adapters(dense_bf16, tmp_path_factory):
    pytest.importorskip("peft")
    from test_lora import make_adapter

    from nanovllm import LoRARequest
    root = tmp_path_factory.mktemp("qwen35-adapters")
    a = make_adapter(dense_bf16, str(root / "a"), 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"], seed=1)
    b = make_adapter(dense_bf16, str(root / "b"), 4, ["q_proj", "o_proj", "down_proj"], seed=2,
                     use_rslora=True)
    return LoRARequest("a", 1, a), LoRARequest("b", 2, b)


def _mixed(llm, adapters) -> tuple[list, list[list[int]]]:
    """Each prompt under the base model and each adapter, in one batch."""
    loras = [lora for _ in PROMPTS for lora in (None, *adapters)]
    prompts = [p for p in PROMPTS for _ in (None, *adapters)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    return list(zip(prompts, loras)), [list(o.outputs[0].token_ids) for o in outs]


def test_lora_on_the_gated_attention_and_mlp_is_peft_s_argmax(dense_bf16, adapters):
    """q_proj's adapter rows follow its query / gate split and the rotary order of the query rows; the
    linear-attention layers take none. TP=2 splits the adapters with their layers: TP=1's tokens."""
    from test_lora import PeftOracle
    llm = LLM(dense_bf16, **LORA)
    layers = llm.model_runner.model.model.layers
    assert layers[3].self_attn.qkv_proj.lora is not None and layers[0].linear_attn.in_proj_qkvz.lora is None
    runs, one = _mixed(llm, adapters)
    llm.shutdown()
    oracles = {None: PeftOracle(dense_bf16, None),
               **{r.lora_int_id: PeftOracle(dense_bf16, r) for r in adapters}}
    for (prompt, lora), out in zip(runs, one):
        oracles[lora and lora.lora_int_id].assert_greedy(prompt, out)
    for i in range(0, len(one), 3):   # each adapter changes the tokens
        assert one[i] != one[i + 1] and one[i] != one[i + 2]
    llm = LLM(dense_bf16, tensor_parallel_size=2, **LORA)
    try:
        assert _mixed(llm, adapters)[1] == one
    finally:
        llm.shutdown()


def test_lora_on_the_linear_attention_is_a_clear_error(dense_bf16, tmp_path):
    pytest.importorskip("peft")
    from test_lora import make_adapter

    from nanovllm import LoRARequest
    path = make_adapter(dense_bf16, str(tmp_path / "linear"), 4, ["in_proj_qkv", "out_proj"], seed=3)
    llm = LLM(dense_bf16, **LORA)
    try:
        with pytest.raises(ValueError, match="linear-attention layers' projections take no LoRA"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("linear", 3, path))
        assert not llm.scheduler.waiting and not llm.scheduler.running
    finally:
        llm.shutdown()


def test_lora_on_a_block_fp8_hybrid_is_peft_s_argmax_on_the_dequantized_model(dense_bf16, adapters,
                                                                                tmp_path):
    """An FP8 layer runs its adapters beside its GEMM (the shrink and expand, unfolded)."""
    from test_lora import PeftOracle
    path = save_block_fp8(dense_bf16, str(tmp_path / "fp8"))
    llm = LLM(path, **dict(LORA, max_loras=1))
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=adapters[0])
    finally:
        llm.shutdown()
    oracle = PeftOracle(path + "-dequantized", adapters[0])
    for prompt, out in zip(PROMPTS, outs):
        oracle.assert_greedy(prompt, list(out.outputs[0].token_ids))
