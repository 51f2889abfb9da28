"""StopChecker: why a sequence stops (EOS, stop tokens, stop strings, lengths), with no model.

A character tokenizer (token t is the letter chr(ord('a') + t)) makes stop strings easy to place."""
import pytest

from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stop_checker import Stop, StopChecker
from nanovllm.sampling_params import SamplingParams

EOS = 25   # 'z'


class Letters:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t) for t in ids if not (skip_special_tokens and t == EOS))


class NoTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        raise AssertionError("a sequence without stop strings was detokenized")


def run(checker: StopChecker, params: SamplingParams, outputs: list[int],
        prompt=(0, 1)) -> tuple[int, Stop | None]:
    """Append outputs one at a time, checking each as the scheduler does; return how many were
    appended and why the sequence stopped."""
    seq = Sequence(list(prompt), params)
    for i, token in enumerate(outputs, start=1):
        seq.append_token(token)
        stop = checker.check(seq, token)
        if stop is not None:
            return i, stop
    return len(outputs), None


@pytest.fixture
def checker():
    return StopChecker({EOS}, max_model_len=12, tokenizer=Letters())


def test_eos_and_stop_tokens(checker):
    assert run(checker, SamplingParams(), [3, EOS, 4]) == (2, Stop("stop", None))
    assert run(checker, SamplingParams(ignore_eos=True), [3, EOS, 4]) == (3, None)
    assert run(checker, SamplingParams(stop_token_ids=[4]), [3, 4, EOS]) == (2, Stop("stop", 4))


def test_of_two_stop_strings_in_the_new_text_the_first_listed_wins(checker):
    # as vLLM: "bc" starts earlier in "abc", but "c" comes first in the list
    assert run(checker, SamplingParams(stop=["c", "bc"]), [0, 1, 2], prompt=(3,)) == (3, Stop("stop", "c"))
    assert run(checker, SamplingParams(stop=["bc", "c"]), [0, 1, 2], prompt=(3,)) == (3, Stop("stop", "bc"))


def test_lengths(checker):
    assert run(checker, SamplingParams(max_tokens=3), [3] * 5) == (3, Stop("length"))
    # max_model_len 12 counts the prompt: 2 prompt tokens + 10 outputs
    assert run(checker, SamplingParams(max_tokens=None), [3] * 20) == (10, Stop("length"))


def test_min_tokens_holds_off_eos_stop_tokens_and_stop_strings_not_lengths(checker):
    held = dict(min_tokens=3, stop_token_ids=[4], stop=["cd"])
    assert run(checker, SamplingParams(**held), [EOS, 4, EOS]) == (3, Stop("stop", None))
    assert run(checker, SamplingParams(**held), [2, 3, 4]) == (3, Stop("stop", 4))
    # "cd" is in the text at output 2 but held off; the text keeps growing, so "cd" at 4-5 is found
    assert run(checker, SamplingParams(**held), [2, 3, 7, 2, 3]) == (5, Stop("stop", "cd"))
    assert run(checker, SamplingParams(min_tokens=2, max_tokens=2, stop=["x"]), [3, 3]) == (2, Stop("length"))
    # as vLLM: stop strings only once the output is longer than min_tokens ("c" at output 2 is held
    # off), stop tokens from output min_tokens on
    assert run(checker, SamplingParams(min_tokens=2, stop=["c"]), [1, 2, 2]) == (3, Stop("stop", "c"))
    assert run(checker, SamplingParams(min_tokens=2, stop_token_ids=[2]), [1, 2, 2]) == (2, Stop("stop", 2))


@pytest.mark.parametrize("include, text", [(False, "hc"), (True, "hcde")])
def test_stop_string_across_tokens_cuts_the_text(checker, include, text):
    seq = Sequence([0], SamplingParams(stop=["de", "xyz"], include_stop_str_in_output=include))
    stops = []
    for token in [7, 2, 3, 4]:   # h c d e
        seq.append_token(token)
        stops.append(checker.check(seq, token))
    assert stops == [None, None, None, Stop("stop", "de")]
    assert seq.detokenizer.text == text


def test_precedence_eos_then_stop_string_then_length(checker):
    # The same token ends the output by a stop string and by max_tokens: the stop string wins.
    assert run(checker, SamplingParams(max_tokens=2, stop=["cd"]), [2, 3]) == (2, Stop("stop", "cd"))
    # EOS and stop tokens win over a stop string their own text completes.
    eos_text = SamplingParams(stop=["z"], skip_special_tokens=False)   # EOS decodes to "z" here
    assert run(checker, eos_text, [EOS]) == (1, Stop("stop", None))
    assert run(checker, SamplingParams(stop_token_ids=[2], stop=["c"]), [2]) == (1, Stop("stop", 2))


def test_only_sequences_with_stop_strings_are_detokenized():
    checker = StopChecker({EOS}, max_model_len=100, tokenizer=NoTokenizer())
    assert run(checker, SamplingParams(max_tokens=5, stop_token_ids=[9]), [3] * 5) == (5, Stop("length"))


def test_a_grammar_that_ends_on_a_secondary_eos_reports_its_id():
    # as without a grammar: generation_config's other EOS ids stop with stop_reason = the id
    checker = StopChecker({EOS, 24}, max_model_len=100, tokenizer=Letters(),
                          secondary_eos_token_ids=frozenset({24}))

    class Complete:   # a grammar that took the EOS as its end
        rejected, is_terminated = False, True

        def accept(self, token_id):
            pass

    for token, reason in [(24, 24), (EOS, None)]:
        seq = Sequence([0, 1], SamplingParams(), grammar=Complete())
        seq.append_token(token)
        assert checker.check(seq, token) == Stop("stop", reason)
