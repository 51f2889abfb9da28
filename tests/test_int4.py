"""Integer weights with 16-bit activations on CPU: tiny random Qwen3, Llama and Qwen3-MoE models saved
in each format's exact on-disk layout (written out here from the formats' published definitions:
AWQ's GEMM packing with its interleaved column order, GPTQ's packing with v1's zero - 1 and act
order's g_idx permutation; compressed-tensors' pack-quantized written by the compressed-tensors
package itself), then every greedy token must be an argmax of transformers' logits on the
dequantized model; TP=2 gives TP=1's tokens; formats nanovllm does not run are clear errors."""
import os
import shutil

import pytest
import torch
from conftest import HFOracle, edit_checkpoint, make_model, random_prompts
from test_fp8 import _set_quantization_config

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.quantization import check_quantization

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GROUP = 16
# every projection's input a whole number of groups on one rank and on two (hidden 64; o_proj 64;
# down 128; the experts' down 64), and every packed output a whole number of 8-column words
SHAPES = dict(hidden_size=64, intermediate_size=128)
MOE_SHAPES = dict(SHAPES, moe_intermediate_size=64, num_experts=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
OPTIONS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=32)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # nibble i of an AWQ word holds column 8 c + AWQ_ORDER[i]


def _projections(tensors: dict) -> list[str]:
    return [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in PROJECTIONS]


# ---- quantizing one weight, as the formats define it ------------------------------------------

def _groups_of_rows(k: int, group: int | None, act_order: bool, seed: int) -> torch.Tensor:
    """[k] the group of each input row: row // group, or act order's: the rows taken in a random
    permutation, group j the j-th run of `group` of them (GPTQ's desc_act g_idx)."""
    if group is None:
        return torch.zeros(k, dtype=torch.long)
    if not act_order:
        return torch.arange(k) // group
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[perm] = torch.arange(k) // group
    return g_idx


def quantize(w: torch.Tensor, bits: int, group: int | None, sym: bool, act_order: bool = False,
             seed: int = 0, min_zero: int = 0):
    """w [N, K] -> (values [K, N] in [0, 2^bits), zeros [G, N], scales [G, N] fp16, g_idx [K]), min-max
    per group and output column (sym: zero 2^(bits-1))."""
    n, k = w.shape
    g_idx = _groups_of_rows(k, group, act_order, seed)
    num_groups = int(g_idx.max()) + 1
    top = 2 ** bits - 1
    wt = w.t().float()                                          # [K, N]
    scales = torch.empty(num_groups, n)
    zeros = torch.empty(num_groups, n, dtype=torch.int64)
    for g in range(num_groups):
        rows = wt[g_idx == g]
        if sym:
            scales[g] = rows.abs().amax(0) / (2 ** (bits - 1) - 1)
            zeros[g] = 2 ** (bits - 1)
        else:
            lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            scales[g] = (hi - lo) / top
            zeros[g] = torch.round(-lo / scales[g]).clamp(min_zero, top).long()
    scales = scales.clamp(min=1e-4).half()
    values = (torch.round(wt / scales.float()[g_idx]) + zeros[g_idx]).clamp(0, top).long()
    return values, zeros, scales, g_idx


def dequantized(values, zeros, scales, g_idx) -> torch.Tensor:
    """The format's definition, w = (v - z) * s, as the [N, K] fp32 weight transformers runs."""
    return ((values - zeros[g_idx]).float() * scales.float()[g_idx]).t().contiguous()


def pack_words(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Entries along dim into int32 words, one word at a time: nibble (or byte) i of word j holds entry
    j * p + order[i] (order: 0..p-1 unless given)."""
    p = 32 // bits
    order = order or tuple(range(p))
    v = values.movedim(dim, 0).long()
    words = torch.zeros(v.shape[0] // p, *v.shape[1:], dtype=torch.int64)
    for j in range(words.shape[0]):
        for i in range(p):
            words[j] |= v[j * p + order[i]] << (bits * i)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.movedim(0, dim).contiguous()


def _input_seed(name: str) -> int:
    """One act order per GEMM input: q/k/v (and gate/up) share their input, so their act order (the
    permutation GPTQ takes from the input's statistics) is the same; other weights differ."""
    prefix, proj = name.removesuffix(".weight").rsplit(".", 1)
    key = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(proj, proj)
    return sum(map(ord, f"{prefix}.{key}")) * 7 + len(prefix)


# ---- writing a checkpoint in a format ----------------------------------------------------------

def write_gptq(prefix, w, tensors, bits=4, group=GROUP, sym=False, desc_act=False, v1=True, seed=0):
    values, zeros, scales, g_idx = quantize(w, bits, group, sym, desc_act, seed, min_zero=1 if v1 else 0)
    tensors[prefix + "qweight"] = pack_words(values, bits, 0)                   # [K / p, N]
    tensors[prefix + "qzeros"] = pack_words(zeros - (1 if v1 else 0), bits, 1)  # [G, N / p]
    tensors[prefix + "scales"] = scales
    tensors[prefix + "g_idx"] = g_idx.to(torch.int32)
    return dequantized(values, zeros, scales, g_idx)


def write_awq(prefix, w, tensors, group=GROUP, **_):
    values, zeros, scales, g_idx = quantize(w, 4, group, sym=False)
    tensors[prefix + "qweight"] = pack_words(values, 4, 1, AWQ_ORDER)   # [K, N / 8]
    tensors[prefix + "qzeros"] = pack_words(zeros, 4, 1, AWQ_ORDER)     # [G, N / 8]
    tensors[prefix + "scales"] = scales
    return dequantized(values, zeros, scales, g_idx)


def write_compressed_tensors(prefix, w, tensors, bits=4, group=GROUP, sym=False, **_):
    """compressed-tensors' own compressor packs the weight, scale and zero point it is given; its
    decompressor gives the dequantized weight."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    values, zeros, scales, g_idx = quantize(w, bits, group, sym)
    offset = 2 ** (bits - 1)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym,
                            strategy="group" if group else "channel", group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    state = {"weight": dequantized(values, zeros, scales, g_idx), "weight_scale": scales.t().contiguous()}
    if not sym:
        state["weight_zero_point"] = (zeros - offset).t().to(torch.int8).contiguous()
    packed = PackedQuantizationCompressor.compress(state, scheme)
    for name, t in packed.items():
        tensors[prefix + name] = t
    return PackedQuantizationCompressor.decompress(packed, scheme)["weight"].float()


def write_compressed_tensors_act_order(prefix, w, tensors, bits=4, group=GROUP, seed=0, **_):
    """compressed-tensors' layout with actorder 'group' (as older llm-compressor releases export it:
    the package no longer writes it), word by word: values and zero points stored + 2^(bits-1), i.e.
    as the unsigned values here."""
    values, zeros, scales, g_idx = quantize(w, bits, group, False, True, seed)
    tensors[prefix + "weight_packed"] = pack_words(values.t(), bits, 1)       # [N, K / p]
    tensors[prefix + "weight_scale"] = scales.t().contiguous()                # [N, G]
    tensors[prefix + "weight_zero_point"] = pack_words(zeros.t(), bits, 0)    # [N / p, G]
    tensors[prefix + "weight_shape"] = torch.tensor(list(w.shape))
    tensors[prefix + "weight_g_idx"] = g_idx.to(torch.int32)
    return dequantized(values, zeros, scales, g_idx)


def _ct_config(bits=4, group=GROUP, sym=False, actorder=None) -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "group_size": group, "dynamic": False,
               "strategy": "group" if group else "channel", "actorder": actorder, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"], "weights": weights, "input_activations": None,
                "output_activations": None}}}


def _gptq_config(bits=4, group=GROUP, sym=False, desc_act=False, v1=True) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group or -1, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": "gptq" if v1 else "gptq_v2", "damp_percent": 0.01, "true_sequential": True}


# format -> (writer, its keyword arguments, quantization_config)
FORMATS = {
    "awq": (write_awq, {}, {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                            "version": "gemm", "modules_to_not_convert": None}),
    "gptq": (write_gptq, {}, _gptq_config()),
    "gptq-act-order": (write_gptq, dict(desc_act=True), _gptq_config(desc_act=True)),
    "gptq-8bit-sym-v2-channel": (write_gptq, dict(bits=8, group=None, sym=True, v1=False),
                                 _gptq_config(bits=8, group=None, sym=True, v1=False)),
    "compressed-tensors": (write_compressed_tensors, {}, _ct_config()),
    "compressed-tensors-sym-channel": (write_compressed_tensors, dict(group=None, sym=True),
                                       _ct_config(group=None, sym=True)),
    "compressed-tensors-8bit": (write_compressed_tensors, dict(bits=8), _ct_config(bits=8)),
    "compressed-tensors-act-order": (write_compressed_tensors_act_order, {}, _ct_config(actorder="group")),
}


def save_quantized(src: str, dst: str, fmt: str) -> str:
    """dst: src's model in format fmt; dst + '-dequantized': its dequantized copy (fp32, unquantized,
    transformers' oracle). Returns dst."""
    writer, kwargs, qconfig = FORMATS[fmt]
    shutil.copytree(src, dst)
    shutil.copytree(src, dst + "-dequantized")
    plain: dict[str, torch.Tensor] = {}

    def quantize_all(tensors):
        for name in _projections(tensors):
            plain[name] = writer(name.removesuffix("weight"), tensors.pop(name), tensors,
                                 seed=_input_seed(name), **kwargs)
    edit_checkpoint(dst, quantize_all)
    edit_checkpoint(dst + "-dequantized", lambda tensors: tensors.update(plain))
    _set_quantization_config(dst, qconfig)
    return dst


@pytest.fixture(scope="module")
def bf16_dirs(tmp_path_factory):
    return {"qwen3": make_model(str(tmp_path_factory.mktemp("qwen3-int4-src")), "qwen3", **SHAPES),
            "llama": make_model(str(tmp_path_factory.mktemp("llama-int4-src")), "llama", **SHAPES),
            "qwen3_moe": make_model(str(tmp_path_factory.mktemp("moe-int4-src")), "qwen3_moe", **MOE_SHAPES)}


CASES = [("qwen3", fmt) for fmt in FORMATS] + [("llama", "awq"), ("llama", "gptq-act-order"),
                                               ("qwen3_moe", "compressed-tensors-act-order"),
                                               ("llama", "compressed-tensors"), ("qwen3_moe", "gptq"),
                                               ("qwen3_moe", "awq"), ("qwen3_moe", "compressed-tensors")]


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}-{p[1]}")
def quantized_dir(request, bf16_dirs, tmp_path_factory):
    arch, fmt = request.param
    return save_quantized(bf16_dirs[arch], str(tmp_path_factory.mktemp("int") / f"{arch}-{fmt}"), fmt)


def _generate(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_int_checkpoint_matches_transformers_on_the_dequantized_model(quantized_dir):
    llm = LLM(quantized_dir, **OPTIONS)
    layers = [m for m in llm.model_runner.model.modules() if getattr(m, "quant", None) is not None]
    assert layers and all(m.w_packed.dtype == torch.int32 for m in layers if hasattr(m, "w_packed"))
    oracle = HFOracle(quantized_dir + "-dequantized")
    prompts = random_prompts(3, [4, 17, 33], seed=2)
    for prompt, out in zip(prompts, _generate(llm, prompts)):
        oracle.assert_greedy(prompt, out)


@pytest.mark.parametrize("arch,fmt", [("qwen3", "awq"), ("qwen3_moe", "gptq-act-order"),
                                      ("llama", "compressed-tensors-act-order")])
def test_tensor_parallel_int_equals_one_rank(bf16_dirs, tmp_path, arch, fmt):
    path = save_quantized(bf16_dirs[arch], str(tmp_path / fmt), fmt)
    prompts = random_prompts(3, [5, 17, 30], seed=4)
    one = _generate(LLM(path, **OPTIONS), prompts)
    llm = LLM(path, tensor_parallel_size=2, **OPTIONS)
    try:
        assert _generate(llm, prompts) == one
    finally:
        llm.shutdown()


def test_dummy_weights_run_in_the_format(bf16_dirs, tmp_path):
    """A GPTQ config with dummy weights (benchmarks): the float weights are quantized at load."""
    path = str(tmp_path / "m")
    shutil.copytree(bf16_dirs["qwen3_moe"], path)
    _set_quantization_config(path, _gptq_config())
    llm = LLM(path, load_format="dummy", **OPTIONS)
    layer = llm.model_runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.w_packed.shape == (64 // 8, 128)   # K / 8, q 64 + k, v 32 rows
    assert layer.mlp.experts.w13_packed.shape == (4, 64 // 8, 128)
    assert len(_generate(llm, [[5, 6, 7]])[0]) == 8


CT_GROUP = _ct_config()["config_groups"]["group_0"]
INT8_TOKENS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
FP4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}


def quantization_of(path: str, **options):
    return check_quantization(Config(path, **options))


def test_quantization_option_must_match_the_checkpoint(bf16_dirs, tmp_path):
    """quantization='awq' on an unquantized checkpoint, or 'gptq' on an AWQ one, is refused before any
    worker starts; None or the checkpoint's own method reads it."""
    with pytest.raises(ValueError, match="quantization='awq' needs a checkpoint in that format"):
        LLM(bf16_dirs["qwen3"], quantization="awq", **OPTIONS)
    with pytest.raises(ValueError, match="quantization='bitsandbytes' is not supported.*'awq'"):
        quantization_of(bf16_dirs["qwen3"], quantization="bitsandbytes")
    path = save_quantized(bf16_dirs["qwen3"], str(tmp_path / "awq"), "awq")
    with pytest.raises(ValueError, match="quantization='gptq', but the checkpoint's quantization_config"):
        quantization_of(path, quantization="gptq")
    assert quantization_of(path, quantization="awq").layout.group == GROUP


@pytest.mark.parametrize("qconfig,message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "supported: .*'gptq'.*'awq'"),
    ({"quant_method": "gguf"}, "supported: .*'gptq'"),
    ({"quant_method": "mxfp4"}, "supported"),
    ({**_gptq_config(), "bits": 3}, "bits 3"),
    ({**_gptq_config(), "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({**_gptq_config(), "dynamic": {r"+:.*down_proj": {"bits": 8}}}, "'dynamic' overrides"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
    ({**_ct_config(), "config_groups": {"g": {**CT_GROUP, "input_activations": INT8_TOKENS}}},
     "not supported"),   # int8 w8a8
    ({**_ct_config(), "format": "nvfp4-pack-quantized", "config_groups": {"g": {**CT_GROUP, "weights": FP4}}},
     "not supported"),   # nvfp4
])
def test_unsupported_methods_are_clear_errors(bf16_dirs, tmp_path, qconfig, message):
    path = str(tmp_path / "m")
    shutil.copytree(bf16_dirs["qwen3"], path)
    _set_quantization_config(path, qconfig)
    with pytest.raises(ValueError, match=message):
        quantization_of(path)


def test_gptqmodel_exclusions_and_the_ignore_list_stay_unquantized(bf16_dirs, tmp_path):
    """GPTQModel's dynamic '-:' patterns (here every o_proj) and compressed-tensors' ignore list keep
    those layers' float weights; the rest is read in the format, matching transformers."""
    from safetensors.torch import load_file
    plain = {n: t for n, t in load_file(os.path.join(bf16_dirs["llama"], "model.safetensors")).items()
             if ".o_proj." in n}

    def unquantized_o_proj(tensors):
        for name in [n for n in tensors if ".o_proj." in n]:
            del tensors[name]
        tensors.update(plain)
    prompts = random_prompts(2, [5, 20], seed=9)
    for fmt, qconfig in (("gptq", {**_gptq_config(), "dynamic": {r"-:.*o_proj": {}}}),
                         ("compressed-tensors", {**_ct_config(), "ignore": ["lm_head", "re:.*o_proj$"]})):
        path = save_quantized(bf16_dirs["llama"], str(tmp_path / fmt), fmt)
        edit_checkpoint(path, unquantized_o_proj)
        edit_checkpoint(path + "-dequantized", unquantized_o_proj)
        _set_quantization_config(path, qconfig)
        llm = LLM(path, **OPTIONS)
        attn = llm.model_runner.model.model.layers[0].self_attn
        assert attn.o_proj.quant is None and attn.qkv_proj.quant is not None
        oracle = HFOracle(path + "-dequantized")
        for prompt, out in zip(prompts, _generate(llm, prompts)):
            oracle.assert_greedy(prompt, out)


def test_packed_projections_with_different_act_orders_are_refused(bf16_dirs, tmp_path):
    """q, k and v quantized with act orders of their own: nanovllm's one qkv_proj has one g_idx."""
    path = str(tmp_path / "m")
    shutil.copytree(bf16_dirs["qwen3"], path)
    edit_checkpoint(path, lambda t: [write_gptq(n.removesuffix("weight"), t.pop(n), t, desc_act=True, seed=i)
                                     for i, n in enumerate(_projections(t))])
    _set_quantization_config(path, _gptq_config(desc_act=True))
    with pytest.raises(ValueError, match="g_idx differs between projections"):
        LLM(path, **OPTIONS)


def test_a_shard_that_splits_a_group_is_a_clear_error(bf16_dirs, tmp_path):
    """group_size 64 at TP=2: o_proj's 64 input rows split into 32 per rank, half a group."""
    path = str(tmp_path / "m")
    shutil.copytree(bf16_dirs["qwen3"], path)
    writer, _, qconfig = FORMATS["gptq"]
    edit_checkpoint(path, lambda t: [writer(n.removesuffix("weight"), t.pop(n), t, group=64)
                                     for n in _projections(t)])
    _set_quantization_config(path, {**qconfig, "group_size": 64})
    assert len(_generate(LLM(path, **OPTIONS), [[5, 6, 7]])[0]) == 8   # one rank: whole groups
    with pytest.raises(Exception, match=r"32 input rows \(of 64.*groups of 64"):
        LLM(path, tensor_parallel_size=2, **OPTIONS)


def test_adapters_on_int4_weights(bf16_dirs, tmp_path):
    """LoRA on GPTQ layers (kept apart from the packed weights): PEFT on the dequantized model."""
    from test_lora import ALL, check_one_adapter, make_adapter

    from nanovllm import LoRARequest
    path = save_quantized(bf16_dirs["qwen3"], str(tmp_path / "gptq"), "gptq")
    lora = LoRARequest("g", 1, make_adapter(path + "-dequantized", str(tmp_path / "a"), 8, ALL, seed=4))
    assert not any(check_one_adapter(path, path + "-dequantized", lora).values())
