"""SamplingParams: vLLM's defaults, and a ValueError naming the field for every bad value."""
import pytest

from nanovllm import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.stop, p.stop_token_ids, p.include_stop_str_in_output, p.ignore_eos) == ([], [], False, False)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.skip_special_tokens) == (16, 0, None, True)
    assert not p.greedy and not p.has_penalties


def test_normalisation():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop_token_ids=(5, 6)).stop_token_ids == [5, 6]
    assert SamplingParams(top_k=-1).top_k == -1
    greedy = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2)
    assert greedy.greedy and (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(repetition_penalty=1.2).has_penalties


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 1.5), ("temperature", -0.1), ("temperature", "hot"), ("top_p", 0.0), ("top_p", 1.1),
    ("top_k", -2), ("top_k", 2.0), ("min_p", -0.1), ("min_p", 1.5), ("seed", 1.0), ("seed", "1"),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0.0),
    ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -2), ("prompt_logprobs", 1.5), ("logprobs", 1.0),
    ("stop", [""]),
    ("stop", [1]), ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("ignore_eos", 1),
    ("include_stop_str_in_output", "yes"), ("skip_special_tokens", None),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_unknown_field_is_a_type_error():
    with pytest.raises(TypeError):
        SamplingParams(top_n=3)
