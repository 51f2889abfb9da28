"""Bad input to generate / add_request: a ValueError or TypeError that names the prompt, nothing
queued (all or nothing per call), no model step run, and the engine serves the next call exactly
as a fresh engine would.

`python tests/test_validation.py` prints the table of docs/reliability.md from these cases."""
import numpy as np
import pytest

from nanovllm import LLM, SamplingParams

try:
    from conftest import assert_clean, make_model, random_prompts, tokens
except ImportError:   # run as a script from the repository root
    from tests.conftest import assert_clean, make_model, random_prompts, tokens

ENGINE = dict(kvcache_block_size=16, num_kvcache_blocks=4, max_model_len=100)   # cache: 64 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=4)
GOOD = random_prompts(2, [5, 30], seed=1)


pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (what, prompts, sampling_params, exception, a regex the message must match)
BAD_INPUTS = [
    ("empty token list", [[]], GREEDY, ValueError, r"prompt 0 is empty"),
    ("empty string", ["w5 w6", ""], GREEDY, ValueError, r"prompt 1 is empty"),
    ("whitespace-only string", ["   "], GREEDY, ValueError, r"prompt 0 is empty \(its text has no tokens\)"),
    ("token id = vocab size", [[5, 6], [5, 512]], GREEDY, ValueError,
     r"prompt 1: token id 512 at position 1 is outside the model's vocabulary \[0, 512\)"),
    ("negative token id", [[-1, 5]], GREEDY, ValueError, r"prompt 0: token id -1 at position 0 is outside"),
    ("prompt longer than max_model_len", [[5] * 3, [5] * 101], GREEDY, ValueError,
     r"prompt 1 has 101 tokens, too many for max_model_len=100"),
    ("prompt larger than the whole KV cache", [[5] * 65], GREEDY, ValueError,
     r"prompt 0 has 65 tokens and cannot fit in the whole KV cache \(4 blocks of 16 tokens\)"
     r".*num_kvcache_blocks"),
    ("None as prompts", None, GREEDY, TypeError,
     r"prompts must be a string, a list of token ids, or a list of those; got NoneType"),
    ("int as prompts", 5, GREEDY, TypeError, r"got int"),
    ("bytes as prompts", b"w5 w6", GREEDY, TypeError, r"got bytes"),
    ("prompt dict with an unknown key", {"text": "w5"}, GREEDY, TypeError,
     r"prompt 0: a prompt dict is \{'prompt': str\} \(TextPrompt\) or \{'prompt_token_ids'"),
    ("None among prompts", [[5], None], GREEDY, TypeError,
     r"prompt 1: expected a string or a list of token ids, got NoneType"),
    ("prompt dict with text as token ids", [[5], {"prompt_token_ids": "w5"}], GREEDY, TypeError,
     r"prompt 1: a prompt dict is"),
    ("numpy array as a prompt", [np.array([5, 6])], GREEDY, TypeError, r"prompt 0: .* got ndarray"),
    ("nested token lists", [[[5, 6]]], GREEDY, TypeError,
     r"prompt 0: a token-id prompt must be a flat list of ints; item 0 is list \[5, 6\]"),
    ("float in a token list", [[5], [5, 6.0]], GREEDY, TypeError, r"prompt 1: .* item 1 is float 6.0"),
    ("float in a single token-id prompt", [5, 6.0], GREEDY, TypeError, r"prompt 0: .* item 1 is float 6.0"),
    ("bool in a token list", [[5, True]], GREEDY, TypeError, r"prompt 0: .* item 1 is bool True"),
    ("string in a token list", [[5, "w6"]], GREEDY, TypeError, r"prompt 0: .* item 1 is str 'w6'"),
    ("int among string prompts", ["w5", 7], GREEDY, TypeError,
     r"prompt 1: expected a string or a list of token ids, got int"),
    ("2 SamplingParams for 3 prompts", [[5], [6], [7]], [GREEDY, GREEDY], ValueError,
     r"got 2 SamplingParams for 3 prompts; give one, or one per prompt"),
    ("None in the SamplingParams list", [[5], [6]], [GREEDY, None], TypeError,
     r"sampling_params 1 is NoneType, not SamplingParams"),
    ("dict as sampling_params", [[5]], {"max_tokens": 3}, TypeError,
     r"sampling_params must be a SamplingParams or a list of them, got dict"),
    ("stop token id outside the vocabulary", [[5]], SamplingParams(stop_token_ids=[600]), ValueError,
     r"sampling_params 0: stop_token_ids must be in \[0, 512\)"),
]

# Bad SamplingParams fail when they are built, before generate sees them.
BAD_PARAMS = [
    ("max_tokens=0", dict(max_tokens=0), r"max_tokens must be an integer >= 1, got 0"),
    ("max_tokens=1.5", dict(max_tokens=1.5), r"max_tokens must be an integer >= 1, got 1.5"),
    ("temperature=-1", dict(temperature=-1), r"temperature must be a number >= 0"),
    ("temperature=nan", dict(temperature=float("nan")), r"temperature must be a number >= 0"),
    ("ignore_eos=1", dict(ignore_eos=1), r"ignore_eos must be True or False, got 1"),
]


@pytest.fixture(scope="module")
def engine_and_reference(qwen3_dir):
    reference = tokens(LLM(qwen3_dir, **ENGINE).generate(GOOD, GREEDY, use_tqdm=False))
    return LLM(qwen3_dir, **ENGINE), reference


@pytest.mark.parametrize("what,prompts,params,exc,message", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_refused_and_the_engine_stays_usable(engine_and_reference, monkeypatch,
                                                          what, prompts, params, exc, message):
    llm, reference = engine_and_reference
    calls = []
    real_run = llm.model_runner.launch
    monkeypatch.setattr(llm.model_runner, "launch",
                        lambda batch, **kwargs: calls.append(batch) or real_run(batch, **kwargs))
    with pytest.raises(exc, match=message):
        llm.generate(prompts, params, use_tqdm=False)
    assert not calls, "a model step ran although the call was refused"
    assert_clean(llm)
    assert tokens(llm.generate(GOOD, GREEDY, use_tqdm=False)) == reference
    assert_clean(llm)


@pytest.mark.parametrize("what,kwargs,message", BAD_PARAMS, ids=[c[0] for c in BAD_PARAMS])
def test_bad_sampling_params_fail_when_built(what, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_add_request_validates_too(engine_and_reference):
    llm, _ = engine_and_reference
    with pytest.raises(ValueError, match=r"prompt 0: token id 999"):
        llm.add_request([5, 999], GREEDY)
    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams"):
        llm.add_request([5], {"max_tokens": 2})
    assert_clean(llm)


def test_accepted_prompt_forms(engine_and_reference):
    """One string, one token list, a tuple, numpy integers, an empty batch."""
    llm, _ = engine_and_reference
    one = tokens(llm.generate([5, 6, 7], GREEDY, use_tqdm=False))
    assert len(one) == 1
    assert tokens(llm.generate([(5, 6, 7)], GREEDY, use_tqdm=False)) == one
    assert tokens(llm.generate([[np.int64(5), np.int32(6), 7]], GREEDY, use_tqdm=False)) == one
    assert tokens(llm.generate("w5 w6 w7", GREEDY, use_tqdm=False)) == one
    assert llm.generate([], GREEDY, use_tqdm=False) == []
    assert_clean(llm)


def test_string_prompt_without_a_tokenizer(tmp_path):
    path = make_model(str(tmp_path / "m"), tokenizer=False)
    llm = LLM(path, **ENGINE)
    with pytest.raises(ValueError,
                       match=r"prompt 1: the engine has no tokenizer \(the model folder has none, or "
                             r"skip_tokenizer_init=True\), so prompts must be token-id lists"):
        llm.generate([[5, 6], "w5 w6"], GREEDY, use_tqdm=False)
    assert_clean(llm)
    assert len(llm.generate([[5, 6]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 4


def markdown_table(qwen3_dir: str) -> str:
    """The observed behaviour of every case above, as the table in docs/reliability.md."""
    llm = LLM(qwen3_dir, **ENGINE)
    rows = ["| input | raised |", "|---|---|"]
    for what, prompts, params, _, _ in BAD_INPUTS:
        try:
            llm.generate(prompts, params, use_tqdm=False)
            seen = "(nothing raised)"
        except Exception as e:
            seen = f"`{type(e).__name__}: {e}`"
        rows.append(f"| {what} | " + seen.replace("|", "\\|") + " |")
    for what, kwargs, _ in BAD_PARAMS:
        try:
            SamplingParams(**kwargs)
            seen = "(nothing raised)"
        except Exception as e:
            seen = f"`{type(e).__name__}: {e}`"
        rows.append(f"| SamplingParams({what}) | {seen} |")
    return "\n".join(rows)


if __name__ == "__main__":
    import tempfile
    print(markdown_table(make_model(tempfile.mkdtemp())))
