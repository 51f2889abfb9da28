"""FP8 weights on CPU: tiny random Qwen3, Llama and Qwen3-MoE models saved as the real FP8 checkpoints are
(HF's quant_method 'fp8' with [128, 128] blocks and weight_scale_inv, as Qwen3-*-FP8 ship;
compressed-tensors FP8_DYNAMIC with per-channel weight_scale; per-tensor weight scales with static
input and KV scales, as AutoFP8 and compressed-tensors' FP8 scheme write them; fbgemm_fp8, per channel
with bf16 experts), then every greedy token must be an
argmax of transformers' logits on the dequantized model; TP=2 gives TP=1's tokens; quantization='fp8'
on a bf16 checkpoint quantizes at load; formats nanovllm does not read are clear errors."""
import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file
from conftest import HFOracle, edit_checkpoint, make_model, random_prompts

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.quantization import check_quantization
from nanovllm.kernels.fp8_reference import quantize_activations, quantize_weight

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Every projection a multiple of 128 rows and columns, on one rank and on two (head_dim 128:
# q 512, k and v 256 rows; MLP 512, experts 256).
SHAPES = dict(hidden_size=256, intermediate_size=512, head_dim=128, num_attention_heads=4,
              num_key_value_heads=2)
MOE_SHAPES = dict(SHAPES, moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
OPTIONS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=32)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

BLOCK_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [128, 128]}
# what llm-compressor's FP8_DYNAMIC scheme writes
CT_CONFIG = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                    "dynamic": False, "group_size": None, "block_structure": None, "observer": "minmax"},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                              "dynamic": True, "group_size": None, "block_structure": None,
                              "observer": None}}}}
# AutoFP8's static scheme with its KV cache scales: one weight_scale and one input_scale a projection,
# k_proj / v_proj an output_scale, all 0-dim
AUTOFP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"],
                  "kv_cache_scheme": "static"}
# llm-compressor's FP8 scheme: per-tensor weights and static per-tensor activations, scales of shape [1];
# with a kv_cache_scheme, self_attn.k_scale / v_scale
_CT_GROUP = CT_CONFIG["config_groups"]["group_0"]
_STATIC_TENSOR = {**_CT_GROUP["input_activations"], "strategy": "tensor", "dynamic": False,
                  "observer": "minmax"}
CT_STATIC_CONFIG = {**CT_CONFIG, "kv_cache_scheme": _STATIC_TENSOR, "config_groups": {"group_0": {
    **_CT_GROUP, "weights": {**_CT_GROUP["weights"], "strategy": "tensor"},
    "input_activations": _STATIC_TENSOR}}}
# transformers' FbgemmFp8Config (Meta's Llama-3.1-*-FP8): per-channel float32 scales on the linear
# layers; the experts stay bf16
FBGEMM_CONFIG = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                 "modules_to_not_convert": ["lm_head"]}
PER_TENSOR = "tensor"
# format -> (quantization_config, weight block (None: per channel), scale name, scale dtype, shape of a
# per-tensor scale and its input_scale (None: no input_scale), where the KV scales are stored)
FORMATS = {"block": (BLOCK_CONFIG, (128, 128), "weight_scale_inv", torch.float32, None, None),
           "compressed-tensors": (CT_CONFIG, None, "weight_scale", torch.bfloat16, None, None),
           "autofp8-static": (AUTOFP8_CONFIG, PER_TENSOR, "weight_scale", torch.float32, (), "output_scale"),
           "compressed-tensors-static": (CT_STATIC_CONFIG, PER_TENSOR, "weight_scale", torch.float32, (1,),
                                         "attention"),
           "fbgemm": (FBGEMM_CONFIG, None, "weight_scale", torch.float32, None, None)}
BF16_EXPERTS = ("fbgemm",)   # formats whose experts are not quantized


def quantization_of(path: str, **options):
    """The format the engine reads the folder's checkpoint in (None: unquantized), checked as the
    engine checks it before any worker starts."""
    return check_quantization(Config(path, **options))


def _is_projection(name: str, experts: bool = True) -> bool:
    return (name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS
            and (experts or ".experts." not in name))


def _quantize(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    if block == PER_TENSOR:   # one scale, the whole tensor's amax / 448
        q, s = quantize_weight(w.reshape(1, -1), None)
        return q.reshape(w.shape), s.reshape(())
    return quantize_weight(w, block)


def _dequantize(w: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """The format's definition, written out: each block (row, or the tensor) of w times its scale."""
    if block in (None, PER_TENSOR):
        return w.float() * scale.float()
    ones = torch.ones(block)
    return w.float() * torch.kron(scale.float(), ones)[:w.shape[0], :w.shape[1]]


def dequantized_copy(src: str, dst: str, block, scale_dtype, experts: bool = True) -> str:
    """src's model with every projection replaced by its quantized-then-dequantized values (fp32,
    unquantized): transformers' oracle of an FP8 model."""
    shutil.copytree(src, dst)

    def dequantize(tensors):
        for name in [n for n in tensors if _is_projection(n, experts)]:
            w, s = _quantize(tensors[name], block)
            tensors[name] = _dequantize(w, s.to(scale_dtype), block)
    edit_checkpoint(dst, dequantize)
    return dst


def _set_quantization_config(folder: str, qconfig: dict):
    """Writes qconfig into the folder's config.json as its quantization_config."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = qconfig
    with open(path, "w") as f:
        json.dump(config, f)


def save_fp8(src: str, dst: str, fmt: str) -> str:
    """dst: src's model in FP8 format fmt; dst + '-dequantized': its dequantized copy. Returns dst."""
    qconfig, block, scale_name, scale_dtype, scalar_shape, kv_scales = FORMATS[fmt]
    experts = fmt not in BF16_EXPERTS
    shutil.copytree(src, dst)

    def quantize(tensors):
        for name in [n for n in tensors if _is_projection(n, experts)]:
            w, s = _quantize(tensors[name], block)
            prefix = name.removesuffix("weight")
            if scalar_shape is not None:   # static input scales (never read) and KV scales
                s = s.reshape(scalar_shape)
                unread = torch.full(scalar_shape, 0.05, dtype=torch.float32)   # KV ones read by an FP8 cache
                tensors[prefix + "input_scale"] = unread
                proj = name.split(".")[-2]
                if proj in ("k_proj", "v_proj"):
                    kv_name = (prefix + "output_scale" if kv_scales == "output_scale"
                               else prefix.removesuffix(f"{proj}.") + f"{proj[0]}_scale")
                    tensors[kv_name] = unread.clone()
            tensors[name], tensors[prefix + scale_name] = w, s.to(scale_dtype)
    edit_checkpoint(dst, quantize)
    dequantized_copy(src, dst + "-dequantized", block, scale_dtype, experts)
    _set_quantization_config(dst, qconfig)
    return dst


def _distinct_projection_scales(path: str) -> str:
    """v_proj and up_proj weights 4x and 1/4 as large: each packed projection's own scale differs, so a
    scale loaded onto the wrong projection's rows changes the tokens."""
    edit_checkpoint(path, lambda t: t.update({n: w * (4.0 if ".v_proj." in n else 0.25)
                                              for n, w in t.items() if ".v_proj." in n or ".up_proj." in n}))
    return path


@pytest.fixture(scope="module")
def bf16_dirs(tmp_path_factory):
    dirs = {"qwen3": make_model(str(tmp_path_factory.mktemp("qwen3-fp8-src")), "qwen3", **SHAPES),
            "llama": make_model(str(tmp_path_factory.mktemp("llama-fp8-src")), "llama", **SHAPES),
            "qwen3_moe": make_model(str(tmp_path_factory.mktemp("moe-fp8-src")), "qwen3_moe",
                                    **MOE_SHAPES)}
    return {arch: _distinct_projection_scales(path) for arch, path in dirs.items()}


@pytest.fixture(scope="module", params=[(arch, fmt) for arch in ("qwen3", "llama", "qwen3_moe")
                                                for fmt in FORMATS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def fp8_dir(request, bf16_dirs, tmp_path_factory):
    arch, fmt = request.param
    return save_fp8(bf16_dirs[arch], str(tmp_path_factory.mktemp("fp8") / f"{arch}-{fmt}"), fmt)


def test_fp8_checkpoint_matches_transformers_on_the_dequantized_model(fp8_dir):
    llm = LLM(fp8_dir, **OPTIONS)
    layers = [m for m in llm.model_runner.model.modules() if getattr(m, "quant", None) is not None]
    assert layers and all(p.dtype == torch.float8_e4m3fn for m in layers
                          for n, p in m.named_parameters(recurse=False) if n in ("weight", "w13", "w2"))
    oracle = HFOracle(fp8_dir + "-dequantized")
    prompts = random_prompts(4, [1, 9, 17, 40], seed=3)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        oracle.assert_greedy(prompt, out.outputs[0].token_ids)


def test_tensor_parallel_fp8_equals_one_rank(fp8_dir):
    prompts = random_prompts(3, [5, 17, 33], seed=1)
    one = [o.outputs[0].token_ids for o in LLM(fp8_dir, **OPTIONS).generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(fp8_dir, tensor_parallel_size=2, **OPTIONS)
    try:
        two = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert two == one


def test_quantization_fp8_quantizes_a_bf16_checkpoint_at_load(bf16_dirs, tmp_path):
    path = bf16_dirs["qwen3"]
    llm = LLM(path, quantization="fp8", **OPTIONS)
    model = llm.model_runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.shape == (qkv.weight.shape[0], 1)
    assert model.model.layers[0].folded   # the norms were folded into the weights before quantizing
    # The RMSNorm weights of the random model are 1, so folding leaves the projections as they are:
    # the engine's tokens are transformers' argmax on the model quantized per channel (fp32 scales).
    oracle = HFOracle(dequantized_copy(path, str(tmp_path / "dequantized"), None, torch.float32))
    prompts = random_prompts(4, [3, 9, 17, 40], seed=5)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        oracle.assert_greedy(prompt, out.outputs[0].token_ids)


def test_bf16_checkpoint_with_dummy_fp8_and_quantized_moe(bf16_dirs):
    llm = LLM(bf16_dirs["qwen3_moe"], quantization="fp8", load_format="dummy", **OPTIONS)
    experts = llm.model_runner.model.model.layers[0].mlp.experts
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.w13_scale.shape == (4, 512, 1)
    out = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_a_shard_that_splits_a_block_is_a_clear_error(tmp_path):
    """head_dim 64: k and v have 128 rows, 64 on each of two ranks: half a block's scale each."""
    src = make_model(str(tmp_path / "src"), "qwen3", **dict(SHAPES, head_dim=64))
    path = save_fp8(src, str(tmp_path / "block"), "block")
    with pytest.raises(Exception, match="multiple of the FP8 weight block"):
        LLM(path, tensor_parallel_size=2, **OPTIONS)


def _with_quantization_config(src: str, dst: str, qconfig: dict) -> str:
    shutil.copytree(src, dst)
    _set_quantization_config(dst, qconfig)
    return dst


@pytest.mark.parametrize("qconfig, message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({**CT_CONFIG, "config_groups": {"g": {**_CT_GROUP, "weights": {**_CT_GROUP["weights"],
                                                                    "dynamic": True}}}}, "not supported"),
    ({**CT_CONFIG, "config_groups": {"g": {**_CT_GROUP, "input_activations": _STATIC_TENSOR, "weights": {
        **_CT_GROUP["weights"], "strategy": "block", "block_structure": [128, 128]}}}}, "not supported"),
    ({**CT_CONFIG, "config_groups": {"g": {**CT_CONFIG["config_groups"]["group_0"],
                                           "input_activations": None}}}, "not supported"),
    ({**CT_STATIC_CONFIG, "kv_cache_scheme": {**_STATIC_TENSOR, "type": "int"}}, "kv_cache_scheme"),
    ({**CT_STATIC_CONFIG, "kv_cache_scheme": {**_STATIC_TENSOR, "strategy": "attn_head"}}, "kv_cache_scheme"),
    *[({**FBGEMM_CONFIG, "activation_scale_ub": ub}, "activation_scale_ub")
      for ub in (0, -1.0, "1200", True, float("inf"), float("nan"), 1e39, 10 ** 400)],
])
def test_unsupported_quantization_configs_are_clear_errors(bf16_dirs, tmp_path, qconfig, message):
    path = _with_quantization_config(bf16_dirs["qwen3"], str(tmp_path / "m"), qconfig)
    with pytest.raises(ValueError, match=message):
        quantization_of(path)


def test_config_groups_and_static_scales_read_as_vllm_does(bf16_dirs, tmp_path, caplog):
    """Several compressed-tensors groups of one weight format (one static, one dynamic) read as one; the
    static input scales are the tensors the loader skips; the KV scales are kept, with a warning."""
    groups = {"static": CT_STATIC_CONFIG["config_groups"]["group_0"], "dynamic": _CT_GROUP}
    path = _with_quantization_config(bf16_dirs["qwen3"], str(tmp_path / "m"),
                                     {**CT_STATIC_CONFIG, "config_groups": groups})
    with caplog.at_level("WARNING"):
        scheme = quantization_of(path)
    assert scheme.block is None and scheme.unread == (".input_scale",) and ".k_scale" in scheme.kv_scales
    assert "kv_cache_scheme" in caplog.text
    channel = save_fp8(bf16_dirs["qwen3"], str(tmp_path / "c"), "compressed-tensors")
    assert quantization_of(channel).unread == ()


@pytest.mark.parametrize("fmt", ["autofp8-static", "compressed-tensors-static"])
def test_static_kv_scales_scale_an_fp8_cache(bf16_dirs, tmp_path, fmt):
    """The checkpoint's KV scales (AutoFP8's k/v_proj.output_scale, llm-compressor's self_attn.k_scale /
    v_scale) are the FP8 cache's per-layer scales, as vLLM uses them: each layer's K and V its own, the
    tokens still near transformers' argmax; a scale that is not one positive number is refused."""
    from test_fp8_kv import check_close
    path = save_fp8(bf16_dirs["qwen3"], str(tmp_path / fmt), fmt)
    kv_name = re.compile(r"layers\.(\d+)\.self_attn\.([kv])(_proj\.output)?_scale$")

    def distinct(tensors):   # layer i: K 0.02 (i + 1), V 0.15 (i + 1) (its |V| reaches 40: v_proj x4)
        for name in tensors:
            if m := kv_name.search(name):
                per_layer = 0.02 if m[2] == "k" else 0.15
                tensors[name] = torch.full_like(tensors[name], per_layer * (int(m[1]) + 1))
    edit_checkpoint(path, distinct)
    llm = LLM(path, kv_cache_dtype="fp8", **OPTIONS)
    layers = torch.arange(1, len(llm.model_runner.attention_layers) + 1)
    expected = torch.stack([0.02 * layers, 0.15 * layers])
    torch.testing.assert_close(llm.model_runner.kv_scales[..., 0], expected)
    for i, attn in enumerate(llm.model_runner.attention_layers):   # what the kernels read
        assert (attn.k_scale.item(), attn.v_scale.item()) == pytest.approx(expected[:, i].tolist())
    prompts = random_prompts(3, [5, 17, 40], seed=6)
    check_close(HFOracle(path + "-dequantized"), prompts, llm.generate(prompts, GREEDY, use_tqdm=False))
    # Layer 0's K in the cache: its values / 0.02 (the largest |K| is about 3.5: 170 of e4m3's 448).
    assert 100 < llm.model_runner.kv_cache[0, 0].float().abs().max() < 448
    edit_checkpoint(path, lambda t: t.update({n: -v for n, v in t.items() if kv_name.search(n)}))
    with pytest.raises(ValueError, match="KV cache scale is one positive finite number"):
        LLM(path, kv_cache_dtype="fp8", **OPTIONS)
    edit_checkpoint(path, lambda t: t.update({"model.layers.0.self_attn.attn.k_scale": torch.tensor(0.1)}))
    with pytest.raises(ValueError, match="attn.k_scale.*does not know where"):
        LLM(path, kv_cache_dtype="fp8", **OPTIONS)


def _keep_unquantized(src: str, path: str, modules: list[str]):
    """path (save_fp8's checkpoint) and its dequantized copy with these modules' tensors back to src's
    bf16 ones, as a checkpoint whose ignore list names them stores them."""
    prefixes = tuple(m + "." for m in modules)
    original = {n: t for n, t in load_file(os.path.join(src, "model.safetensors")).items()
                if n.startswith(prefixes)}

    def restore(tensors):
        for name in [n for n in tensors if n.startswith(prefixes)]:
            del tensors[name]
        tensors.update(original)
    edit_checkpoint(path, restore)
    edit_checkpoint(path + "-dequantized", restore)


def test_an_ignored_layer_stays_unquantized(bf16_dirs, tmp_path):
    """AutoFP8's ignored_layers naming one projection: the checkpoint keeps it in bf16, and so does the
    model; the tokens are transformers' argmax on the model with that layer unquantized."""
    layer = "model.layers.0.mlp.down_proj"
    path = save_fp8(bf16_dirs["qwen3"], str(tmp_path / "m"), "autofp8-static")
    _set_quantization_config(path, {**AUTOFP8_CONFIG, "ignored_layers": ["lm_head", layer]})
    _keep_unquantized(bf16_dirs["qwen3"], path, [layer])
    llm = LLM(path, **OPTIONS)
    mlp = llm.model_runner.model.model.layers[0].mlp
    assert mlp.down_proj.weight.dtype != torch.float8_e4m3fn and mlp.down_proj.quant is None
    assert mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    oracle = HFOracle(path + "-dequantized")
    prompts = random_prompts(2, [5, 17], seed=4)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        oracle.assert_greedy(prompt, out.outputs[0].token_ids)


def test_fbgemm_fp8_keeps_the_experts_in_bf16(bf16_dirs, tmp_path):
    """fbgemm_fp8 quantizes the linear layers only (as vLLM reads it): a Qwen3-MoE checkpoint's experts
    are bf16 tensors, loaded unquantized beside FP8 attention projections; a bf16 expert is not refused."""
    path = save_fp8(bf16_dirs["qwen3_moe"], str(tmp_path / "m"), "fbgemm")
    assert not quantization_of(path).experts
    llm = LLM(path, **OPTIONS)
    layer = llm.model_runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.experts.quant is None and layer.mlp.experts.w13.dtype != torch.float8_e4m3fn


def test_fbgemm_fp8_modules_to_not_convert(bf16_dirs, tmp_path):
    """Meta's list names each projection a layer keeps in bf16 (here layer 0's attention): its packed
    qkv_proj stays bf16, o_proj too, the rest is FP8; the tokens are transformers' argmax."""
    kept = [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"]
    path = save_fp8(bf16_dirs["llama"], str(tmp_path / "m"), "fbgemm")
    _set_quantization_config(path, {**FBGEMM_CONFIG, "modules_to_not_convert": kept + ["lm_head"]})
    _keep_unquantized(bf16_dirs["llama"], path, kept)
    llm = LLM(path, **OPTIONS)
    layer = llm.model_runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.quant is None and layer.self_attn.o_proj.quant is None
    assert layer.mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    oracle = HFOracle(path + "-dequantized")
    prompts = random_prompts(2, [5, 17], seed=4)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        oracle.assert_greedy(prompt, out.outputs[0].token_ids)


def clip_projection_inputs(oracle: HFOracle, bound: float) -> HFOracle:
    """The oracle with every projection's input clipped to +-bound (fbgemm_fp8's activation_scale_ub,
    as the CPU path applies it)."""
    for name, module in oracle.model.named_modules():
        if name.split(".")[-1] in PROJECTIONS:
            module.register_forward_pre_hook(lambda m, args: (args[0].clamp(-bound, bound),))
    return oracle


def test_fbgemm_fp8_activation_scale_ub_bounds_each_tokens_scale(bf16_dirs, tmp_path):
    """fbgemm_fp8's activation_scale_ub: no token's activations scaled past it, larger values saturate
    (vLLM, FBGEMM's quantize_fp8_per_row). At 0.25 it clips most inputs of every FP8 projection: the
    tokens are transformers' argmax on the dequantized model whose projections see their inputs clipped
    to +-0.25, and not the tokens of the same checkpoint without the bound."""
    ub = 0.25
    path = save_fp8(bf16_dirs["llama"], str(tmp_path / "m"), "fbgemm")
    assert quantization_of(path).activation_scale_ub == 1200.0
    prompts = random_prompts(3, [5, 17, 30], seed=6)
    unbounded = [o.outputs[0].token_ids
                 for o in LLM(path, **OPTIONS).generate(prompts, GREEDY, use_tqdm=False)]
    _set_quantization_config(path, {**FBGEMM_CONFIG, "activation_scale_ub": ub})
    llm = LLM(path, **OPTIONS)
    assert llm.model_runner.model.model.layers[0].mlp.down_proj.quant.scale_ub == ub
    bounded = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert bounded != unbounded
    oracle = clip_projection_inputs(HFOracle(path + "-dequantized"), ub)
    for prompt, out in zip(prompts, bounded):
        oracle.assert_greedy(prompt, out)


def test_unsupported_quantization_option_names_the_supported_ones(bf16_dirs, tmp_path):
    with pytest.raises(ValueError, match="'fp8'"):
        quantization_of(bf16_dirs["qwen3"], quantization="gptq")
    path = save_fp8(bf16_dirs["qwen3"], str(tmp_path / "ct"), "compressed-tensors")
    with pytest.raises(ValueError, match="quantization='fp8', but the checkpoint's quantization_config says "
                                         "'compressed-tensors'"):
        quantization_of(path, quantization="fp8")
    assert quantization_of(path, quantization="compressed-tensors").block is None
    assert quantization_of(bf16_dirs["qwen3"]) is None
    assert quantization_of(bf16_dirs["qwen3"], quantization="fp8").online


def test_an_unquantized_tensor_in_an_fp8_checkpoint_is_refused(bf16_dirs, tmp_path):
    path = save_fp8(bf16_dirs["qwen3"], str(tmp_path / "bad"), "block")
    name = "model.layers.0.self_attn.o_proj.weight"
    edit_checkpoint(path, lambda t: t.update({name: t[name].float()}) if name in t else None)
    with pytest.raises(ValueError, match="o_proj.weight.*float8_e4m3fn"):
        LLM(path, **OPTIONS)


def test_activation_groups_round_like_the_weights():
    """quantize_activations: each token's group of 128 scaled by its amax / 448; values round-trip
    within e4m3's half-ulp (2^-4 relative)."""
    x = torch.randn(5, 300) * torch.logspace(-3, 3, 300)
    q, s = quantize_activations(x, 128)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 3)
    assert torch.allclose(s[:, 0], x[:, :128].abs().amax(1) / 448)
    back = (q.float().view(5, -1) * s.repeat_interleave(128, 1)[:, :300])
    assert torch.allclose(back, x, rtol=2 ** -4, atol=s.max().item() * 2 ** -9)


def test_roofline_counts_fp8_weights_at_one_byte():
    """A one-token decode is bound by the weight bytes: FP8 reads the body at 1 byte, the LM head at 2."""
    from nanovllm.utils.roofline import H200, ModelShapes, workload_limit
    config = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, intermediate_size=12288, vocab_size=151936)
    shapes = ModelShapes.from_config(config)
    bf16, fp8 = (workload_limit(config, [1], [2000], weight_bytes=b) for b in (2, 1))
    body, head = shapes.body_params, shapes.lm_head_params
    assert fp8 / bf16 == pytest.approx((2 * body + 2 * head) / (body + 2 * head), rel=2e-2)
    assert bf16 == pytest.approx(H200.copy_bytes_per_s / (2 * (body + head)), rel=2e-2)
    with pytest.raises(ValueError, match="weight_bytes"):
        workload_limit(config, [1], [1], weight_bytes=4)


def test_block_fp8_configs_with_dummy_weights(tmp_path, bf16_dirs):
    """bench.py's configs/*-fp8 (Qwen3-*-FP8's quantization_config) parse as the block format, and a
    block-format config with dummy weights runs with block scales (quantized at load)."""
    for name in ("qwen3-8b-fp8", "qwen3-30b-a3b-fp8"):
        scheme = quantization_of(f"configs/{name}")
        assert scheme.block == (128, 128) and scheme.scale_name == "weight_scale_inv" and not scheme.online
    path = _with_quantization_config(bf16_dirs["qwen3_moe"], str(tmp_path / "m"), BLOCK_CONFIG)
    llm = LLM(path, load_format="dummy", **OPTIONS)
    layer = llm.model_runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight_scale.shape == (8, 2)    # q 512 + k, v 256 rows; 256 columns
    assert layer.mlp.experts.w13_scale.shape == (4, 4, 2)
    assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_an_fp8_tensor_for_an_unquantized_layer_is_refused(bf16_dirs, tmp_path):
    """The ignore list keeps o_proj unquantized, but the checkpoint's o_proj is FP8."""
    path = save_fp8(bf16_dirs["qwen3"], str(tmp_path / "m"), "block")
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["quantization_config"]["modules_to_not_convert"] = ["o_proj"]
    with open(config_file, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="o_proj.weight.*is FP8"):
        LLM(path, **OPTIONS)


def test_quantization_at_load_under_tensor_parallelism(bf16_dirs, tmp_path):
    """TP=2, norms folded, FP8 o_proj / down_proj adding into the residual on rank 0 only: each rank
    quantizes its own shard (a row-parallel shard's channel scales cover its half of the columns),
    so tokens are checked against the whole-row quantized oracle within a small gap."""
    path = bf16_dirs["qwen3"]
    oracle = HFOracle(dequantized_copy(path, str(tmp_path / "dequantized"), None, torch.float32))
    llm = LLM(path, quantization="fp8", tensor_parallel_size=2, **OPTIONS)
    try:
        prompts = random_prompts(3, [3, 17, 40], seed=6)
        for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
            oracle.assert_greedy(prompt, out.outputs[0].token_ids, atol=0.25)
    finally:
        llm.shutdown()
