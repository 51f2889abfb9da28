"""Loading: strict safetensors loader errors, sharded checkpoints, unknown architectures, missing
config.json, dummy weights, hub-id errors (no network), and config.json in old and new styles."""
import json
import os
import socket

import pytest
import torch
from conftest import make_model, random_prompts
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.engine.devices import pick_dtype
from nanovllm.models import get_model_class
from nanovllm.models.llama import rope_settings
from nanovllm.utils.loader import resolve_model

SMALL = dict(kvcache_block_size=16, num_kvcache_blocks=16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("llama")), "llama")


def _copy_with(src: str, dst, edit) -> str:
    """A copy of the model folder whose tensors went through edit(dict of tensors)."""
    dst = str(dst)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
                g.write(f.read())
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


# ---- strict loader ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["model.layers.1.self_attn.k_proj.weight",
                                  "model.layers.0.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"])
def test_missing_tensor_is_named(llama_dir, tmp_path, name):
    path = _copy_with(llama_dir, tmp_path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"has no tensor for: {name}"):
        LLM(path, **SMALL)


@pytest.mark.parametrize("name, shape", [
    ("model.layers.0.self_attn.q_proj.weight", (80, 64)),    # too many rows: must not be cut to fit
    ("model.layers.0.self_attn.v_proj.weight", (16, 64)),    # too few rows
    ("model.layers.1.mlp.down_proj.weight", (64, 100)),      # row-parallel: wrong input size
    ("model.layers.0.mlp.gate_proj.weight", (128, 32)),
    ("model.embed_tokens.weight", (500, 64)),
    ("model.layers.0.input_layernorm.weight", (65,)),
])
def test_wrong_shape_is_named(llama_dir, tmp_path, name, shape):
    path = _copy_with(llama_dir, tmp_path, lambda t: t.__setitem__(name, torch.zeros(shape)))
    with pytest.raises(ValueError, match=f"checkpoint tensor '{name}'.*shape"):
        LLM(path, **SMALL)


def test_extra_tensor_is_named(llama_dir, tmp_path):
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    path = _copy_with(llama_dir, tmp_path, lambda t: t.__setitem__(name, torch.zeros(8)))
    with pytest.raises(ValueError, match=f"'{name}'.*matches no model parameter"):
        LLM(path, **SMALL)


def test_tied_checkpoint_may_carry_lm_head(tmp_path):
    """Some tied checkpoints store lm_head.weight too: it is the embedding, so it is skipped."""
    path = make_model(str(tmp_path / "tied"), "llama", tie_word_embeddings=True)
    path = _copy_with(path, tmp_path,
                      lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    assert LLM(path, **SMALL).generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_only_pytorch_bin_is_refused(llama_dir, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(llama_dir, name), "rb") as f, open(tmp_path / name, "wb") as g:
            g.write(f.read())
    torch.save(load_file(os.path.join(llama_dir, "model.safetensors")), tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError,
                       match=r"pytorch_model\.bin.*safetensors|safetensors.*pytorch_model\.bin"):
        LLM(str(tmp_path), **SMALL)


def test_sharded_checkpoint_loads(llama_dir, tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert len(shards) > 2 and os.path.isfile(tmp_path / "model.safetensors.index.json")
    prompts = random_prompts(2, [5, 20])
    sharded = LLM(str(tmp_path), **SMALL).generate(prompts, GREEDY, use_tqdm=False)
    whole = LLM(llama_dir, **SMALL).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sharded] == [o.outputs[0].token_ids for o in whole]


# ---- architecture and folder ----------------------------------------------------------------

def _edit_config(path: str, **changes):
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def test_unknown_architecture_names_the_supported_ones(tmp_path):
    path = make_model(str(tmp_path), "llama", tokenizer=False)
    _edit_config(path, architectures=["MixtralForCausalLM"])
    with pytest.raises(ValueError,
                       match="MixtralForCausalLM.*not supported.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        LLM(path, **SMALL)


@pytest.mark.parametrize("arch, changes, refused", [
    # Qwen3-MoE's config names no layer_types: which layers slide is not said (Qwen2/3 run their
    # windows: tests/test_gemma.py)
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1), True),
    # every layer below max_window_layers: transformers runs them all with full attention
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=8), False),
], ids=["qwen3-moe", "qwen2-no-sliding-layer"])
def test_sliding_window_layers_are_refused(tmp_path, arch, changes, refused):
    path = make_model(str(tmp_path), arch, tokenizer=False, **changes)
    if refused:
        with pytest.raises(ValueError, match="sliding-window attention.*not supported"):
            LLM(path, **SMALL)
    else:
        LLM(path, **SMALL)


def test_checkpoint_dtype_that_cannot_run_is_named(tmp_path):
    path = make_model(str(tmp_path), "qwen3", tokenizer=False)
    _edit_config(path, dtype="float64")
    config = Config.create(path)
    with pytest.raises(ValueError, match="dtype torch.float64.*dtype= one of float32, bfloat16, float16"):
        pick_dtype(config, torch.device("cuda"))
    assert pick_dtype(Config.create(path, dtype="bfloat16"), torch.device("cuda")) == torch.bfloat16


def test_config_transformers_refuses_is_a_value_error_naming_the_file(tmp_path):
    path = make_model(str(tmp_path), "qwen3", tokenizer=False)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    del config["num_hidden_layers"]   # transformers' default (32) then disagrees with layer_types
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="(?s)config.json: .*num_hidden_layers"):
        LLM(path, **SMALL)


def test_folder_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(str(tmp_path), **SMALL)


# ---- dummy weights ----------------------------------------------------------------------------

def test_dummy_weights_need_only_config_json(tmp_path):
    path = make_model(str(tmp_path), "qwen3", tokenizer=False)
    os.remove(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "generation_config.json"))
    assert os.listdir(path) == ["config.json"]
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors.*load_format='dummy'"):
        LLM(path, **SMALL)
    prompts = random_prompts(2, [3, 20])
    outs = LLM(path, load_format="dummy", **SMALL).generate(prompts, GREEDY, use_tqdm=False)
    again = LLM(path, load_format="dummy", **SMALL).generate(prompts, GREEDY, use_tqdm=False)
    for out, out2 in zip(outs, again):
        ids = out.outputs[0].token_ids
        assert len(ids) == GREEDY.max_tokens and all(0 <= t < 512 for t in ids)
        assert ids == out2.outputs[0].token_ids   # seeded: the same random weights each time


# ---- hub ids ---------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["./no-such-model", "/no/such/model", "no/such/model", "~/no-such-model",
                                   "no-such-model"])
def test_missing_folder_that_is_no_hub_id(model):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(model)


def test_hub_id_offline_says_how_to_pass_a_folder(monkeypatch, tmp_path):
    import huggingface_hub.constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)   # read at import time
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))   # nothing cached
    connections = []
    monkeypatch.setattr(socket.socket, "connect", lambda self, addr: connections.append(addr))
    with pytest.raises(FileNotFoundError, match="not a local folder.*Offline.*local folder"):
        LLM("nanovllm-tests/no-such-model", **SMALL)
    assert connections == []


# ---- config.json styles ------------------------------------------------------------------------

_BASE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False}
OLD_STYLE = {  # transformers 4: rope_theta at top level, torch_dtype, rope_scaling with "type", no head_dim
    **_BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 500000.0,
    "torch_dtype": "bfloat16", "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 32}}
NEW_STYLE = {  # transformers 5: rope_parameters, dtype, an explicit head_dim unlike hidden / heads
    **_BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32, "dtype": "float16",
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}
NO_DTYPE = {**_BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}


@pytest.mark.parametrize("raw, theta, scaled, dtype, head_dim", [
    (OLD_STYLE, 500000.0, True, torch.bfloat16, 16),
    (NEW_STYLE, 1000000.0, False, torch.float16, 32),
    (NO_DTYPE, 10000.0, False, torch.float32, 16),
], ids=["old-style", "new-style", "no-dtype"])
def test_config_styles(tmp_path, raw, theta, scaled, dtype, head_dim):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = Config.create(str(tmp_path))
    assert pick_dtype(config, torch.device("cuda")) == dtype   # "auto" on CUDA: the checkpoint's dtype
    assert pick_dtype(config, torch.device("cpu")) == torch.float32
    assert pick_dtype(Config.create(str(tmp_path), dtype="bfloat16"), torch.device("cpu")) == torch.bfloat16
    got_theta, scaling = rope_settings(config.hf_config)
    assert got_theta == theta
    assert (scaling is not None and scaling["rope_type"] == "llama3") == scaled
    model = get_model_class(config.hf_config)(config.hf_config)
    attn = model.model.layers[0].self_attn
    assert attn.head_dim == head_dim and attn.o_proj.weight.shape == (64, 4 * head_dim)
    cos_sin = attn.rotary_emb.cos_sin_cache[1]   # position 1: angle = inv_freq
    inv_freq = torch.atan2(cos_sin[head_dim // 2:], cos_sin[:head_dim // 2])
    if not scaled:   # (scaled frequencies are checked in test_models)
        expect = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        torch.testing.assert_close(inv_freq, expect, rtol=1e-4, atol=1e-7)
    out = LLM(str(tmp_path), load_format="dummy", **SMALL).generate([[3, 4, 5]], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens
