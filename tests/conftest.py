"""Tiny random Hugging Face models saved to temp folders, the transformers oracle, and helpers
shared by the test files."""
import glob
import os
import subprocess
import sys
from pathlib import Path

# The tests are the application here: nanovllm leaves its log records to pytest (caplog), adding no
# stderr handler of its own (tests/test_envs.py runs the default in a fresh interpreter).
os.environ.setdefault("NANOVLLM_CONFIGURE_LOGGING", "0")
# One torch thread, here and in the processes the tests start (servers, TP workers, scripts): the tiny
# models' ops are too small to split, and on a 2-core machine shared with other work two threads spin
# against each other (a 16-prompt generate: 0.35 s on one thread, 13 s on two, on a busy 2-core machine).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen3Config, Qwen3MoeConfig)

torch.set_num_threads(1)   # in case torch was imported before this file set OMP_NUM_THREADS

VOCAB = 512
EOS = 1

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=EOS, tie_word_embeddings=False)
CONFIGS = {
    "qwen3": lambda **kw: Qwen3Config(**{**_COMMON, "head_dim": 16, "rope_theta": 10000.0, **kw}),
    "llama": lambda **kw: LlamaConfig(**{**_COMMON, "rope_theta": 10000.0, **kw}),
    "qwen2": lambda **kw: Qwen2Config(**{**_COMMON, "rope_theta": 10000.0, **kw}),
    # 8 experts, top 2, and a dense layer (mlp_only_layers) between two sparse ones
    "qwen3_moe": lambda **kw: Qwen3MoeConfig(**{**_COMMON, "head_dim": 16, "rope_theta": 10000.0,
                                                "num_experts": 8, "num_experts_per_tok": 2,
                                                "moe_intermediate_size": 32, "norm_topk_prob": True,
                                                "num_hidden_layers": 3, "mlp_only_layers": [1], **kw}),
}


def _tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer: 'w0 w1 ...' words, so strings round-trip and ids stay in range."""
    vocab = {"<s>": 0, "</s>": EOS, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def make_model(path: str, arch: str = "qwen3", seed: int = 0, tokenizer: bool = True, **overrides) -> str:
    torch.manual_seed(seed)
    config = CONFIGS[arch](**overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Larger-than-default weights give peaked logits, so argmax is not decided by rounding.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    if tokenizer:
        _tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("qwen3")), "qwen3")


class HFOracle:
    """transformers' model on the same folder, for checking that tokens are argmax choices."""

    def __init__(self, path: str):
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                          attn_implementation="eager")
        self.model.eval()

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([token_ids])).logits[0].float()

    def assert_greedy(self, prompt_ids: list[int], output_ids: list[int], atol: float = 1e-3):
        """Every output token is (within atol) a maximum of transformers' logits at its position."""
        assert output_ids, "no tokens generated"
        logits = self.logits(prompt_ids + output_ids)
        for i, tok in enumerate(output_ids):
            row = logits[len(prompt_ids) - 1 + i]
            assert row[tok] >= row.max() - atol, (
                f"token {i} ({tok}) is not an argmax: logit {row[tok]:.5f} vs max {row.max():.5f} "
                f"(argmax {row.argmax().item()})")


def edit_checkpoint(path: str, edit):
    """Rewrite a model folder's *.safetensors files after edit(tensors) changed each file's
    name -> tensor dict in place."""
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        tensors = load_file(file)
        edit(tensors)
        save_file(tensors, file, metadata={"format": "pt"})


def randomize_tensors(path: str, suffix: str, draw):
    """Each checkpoint tensor whose name ends with suffix replaced by draw(shape): values HF's
    initialisation would leave trivial (zero biases, unit norm weights), which could hide a tensor
    loaded into the wrong place or a transformation that drops it."""
    edit_checkpoint(path, lambda tensors: tensors.update(
        {name: draw(t.shape) for name, t in tensors.items() if name.endswith(suffix)}))


def random_prompts(n: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for length in lengths][:n]


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module, restored after it (the whole session runs on one thread now, see
    the top of this file; a module that raises the count for itself gets it back to one after)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def assert_nearly_equal(out: torch.Tensor, ref: torch.Tensor, max_fraction: float = 0.01):
    """fp32: within 1e-6. 16-bit: bit-for-bit equal on all but a small fraction of values, and those
    close: a different fp32 summation order can flip the rounding of an intermediate value (one ulp),
    which can be a few ulps of an output where two rotated terms cancel. A rounding step left out
    or added shows up as many more mismatches."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
        return
    differ = out != ref
    assert differ.float().mean() <= max_fraction, f"{int(differ.sum())} of {out.numel()} values differ"
    torch.testing.assert_close(out.float(), ref.float(), atol=2 ** -5, rtol=2 ** -7)


def tokens(outputs) -> list[list[int]]:
    """The first completion's token ids of each RequestOutput."""
    return [list(o.outputs[0].token_ids) for o in outputs]


def assert_clean(llm):
    """No queued sequences; every KV block free (cached prefix blocks sit in the free list, reclaimable)."""
    sched = llm.scheduler
    bm = sched.block_manager
    assert not sched.waiting and not sched.running
    assert getattr(llm.run_ahead, "in_flight", None) is None   # no launched step left unapplied
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


REPO = Path(__file__).resolve().parents[1]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Triton kernel tests named `test_interp_*` run only in a subprocess with TRITON_INTERPRET=1: the
# variable must be set before the kernel modules are imported, and other test files import them first.
interp = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter subprocess")


# One interpreter subprocess per environment for all the collected files' `test_interp_*` tests (each
# subprocess pays the imports and collection again: about 5-10 s a file on the 2-core machine). A file
# whose interpreted tests need more variables names them in INTERPRETED_ENV and passes them here.
_INTERP_FILES: dict[tuple, list[str]] = {}     # environment -> the collected files with interp tests
_INTERP_RUNS: dict[tuple, dict[str, list]] = {}   # environment -> file -> [(test, outcome, text)]


@pytest.hookimpl(trylast=True)   # after -k and -m have deselected: only the tests that will run
def pytest_collection_modifyitems(session, config, items):
    if INTERPRETED:
        return
    for item in items:
        if item.name.startswith("test_interp_"):
            env = tuple(sorted(getattr(item.module, "INTERPRETED_ENV", {}).items()))
            files = _INTERP_FILES.setdefault(env, [])
            if str(item.path) not in files:
                files.append(str(item.path))


def _run_interpreted(files: list[str], env_vars: dict) -> dict[str, list]:
    """Run the files' `interp_` tests in one subprocess under the Triton interpreter: for each file,
    [(test name, "passed" / "failed" / "skipped", the failure's text)], from pytest's JUnit XML."""
    import tempfile
    import xml.etree.ElementTree as ET
    env = {**os.environ, **env_vars, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "results.xml")
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files,
                                 "-k", "interp_", f"--junitxml={xml}"], env=env, cwd=REPO,
                                capture_output=True, text=True, timeout=1800)
        if not os.path.exists(xml):   # the run broke before any test: every file fails with its output
            return {f: [("(no run)", "failed", result.stdout[-4000:] + result.stderr[-2000:])] for f in files}
        modules = {".".join(Path(f).resolve().relative_to(REPO).with_suffix("").parts): f for f in files}
        outcomes: dict[str, list] = {f: [] for f in files}
        for case in ET.parse(xml).getroot().iter("testcase"):
            module = next((m for m in modules if case.get("classname", "").startswith(m)), None)
            if module is None:
                continue
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            skipped = case.find("skipped") is not None
            outcome = "failed" if bad is not None else "skipped" if skipped else "passed"
            text = "" if bad is None else (bad.get("message", "") + "\n" + (bad.text or ""))[-4000:]
            outcomes[modules[module]].append((case.get("name"), outcome, text))
        return outcomes


def run_interpreted_tests(test_file: str, **env_vars: str):
    """Run test_file's `interp_` tests under the Triton interpreter (with env_vars set too); fail
    with the output of those that failed. The first call runs every collected file's (with the same
    env_vars) in one subprocess; the later calls read their file's results."""
    if INTERPRETED:
        pytest.skip("already in the interpreter")
    if torch.cuda.is_available():
        # The GPU tests run the compiled kernels there. (Also, triton 3.6's interpreter, the GPU
        # machine's version, failed there; here it fails with numpy 2.4: `int()` of a 1-element array.)
        pytest.skip("a GPU is present: the *_gpu tests run the compiled kernels")
    pytest.importorskip("triton")
    key, test_file = tuple(sorted(env_vars.items())), str(Path(test_file).resolve())
    if test_file not in _INTERP_RUNS.get(key, {}):
        files = [f for f in _INTERP_FILES.get(key, []) if f != test_file] + [test_file]
        _INTERP_RUNS.setdefault(key, {}).update(_run_interpreted(files, env_vars))
    results = _INTERP_RUNS[key][test_file]
    failed = [f"{name}: {outcome}\n{text}" for name, outcome, text in results if outcome != "passed"]
    assert results and not failed, "\n".join(failed) or f"no interp_ test ran in {test_file}"


def serve_process(args: list[str], log, timeout_s: float):
    """Runs `python -m nanovllm.serve ARGS --port P` on a free port, its output to the file `log` (a
    file: a full pipe would block it); yields the base URL once /health answers, and stops the server
    at the end whatever happened (use with `yield from` in a fixture)."""
    import socket
    import time
    import urllib.request
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm.serve", *args, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"the server exited with {proc.returncode}:\n{log.read()}")
            try:
                if urllib.request.urlopen(base + "/health", timeout=5).status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the server did not start in time")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
