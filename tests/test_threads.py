"""Threads sharing one engine: concurrent generate / chat / add_request+step calls are served one
after another (the engine's lock), so every caller gets exactly the outputs it gets alone, and a
call that fails leaves the other threads' calls untouched. (Tensor parallelism: tests/test_faults.py
runs the same check on a TP=2 engine in its subprocess.)"""
import threading
import time

import pytest

from conftest import assert_clean, random_prompts
from nanovllm import LLM, SamplingParams
from nanovllm.engine.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

OPTIONS = dict(device="cpu", kvcache_block_size=8, num_kvcache_blocks=24, max_num_batched_tokens=32,
               max_num_seqs=4)   # on CPU also on a GPU machine: CUDA wants blocks of 16 tokens
# Each job: its own prompts and params (greedy, seeded sampling with n=2, stop strings with
# logprobs, penalties), so tokens of one caller showing up in another's output would be seen.
JOBS = [
    (random_prompts(3, [5, 20, 9], seed=1), SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)),
    (random_prompts(2, [12, 3], seed=2), SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=6,
                                                        ignore_eos=True)),
    (random_prompts(2, [30, 6], seed=3), SamplingParams(temperature=0, max_tokens=9, stop=["w1"], logprobs=1,
                                                        ignore_eos=True)),
    (random_prompts(1, [17], seed=4), SamplingParams(temperature=0, max_tokens=5, frequency_penalty=0.5,
                                                     ignore_eos=True)),
]
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
CHAT = [[{"role": "user", "content": "w7 w8 w9"}], [{"role": "user", "content": "w50 w51"}]]


class Close(float):
    """A logprob that equals any within 1e-3: a request queued by hand is batched with another
    caller's, and a different batch may round the last bits differently. (Rounding to 4 places was
    not enough: -2.99135 rounds either way, and under load the test saw -2.9914 against -2.9913.)"""
    def __eq__(self, other):
        return abs(self - other) < 1e-3

    __hash__ = float.__hash__


def summary(outputs) -> list:
    """What a caller sees, logprobs compared within 1e-3 (Close)."""
    def logprobs(c):
        return [{t: (Close(lp.logprob), lp.rank) for t, lp in d.items()} for d in c.logprobs or []]
    return [(o.prompt, [(list(c.token_ids), c.text, c.finish_reason, logprobs(c)) for c in o.outputs])
            for o in outputs]


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    llm = LLM(qwen3_dir, **OPTIONS)
    llm.tokenizer.chat_template = TEMPLATE
    return llm


def run_threads(targets, timeout_s: float = 120):
    """Run each target in its own thread, all started together; re-raise the first error."""
    errors, start = [], threading.Barrier(len(targets))

    def wrapped(target):
        try:
            start.wait()
            target()
        except BaseException as e:   # noqa: BLE001 - reported to the test's thread
            errors.append(e)

    threads = [threading.Thread(target=wrapped, args=(t,), daemon=True) for t in targets]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a thread is still running: deadlock?"
    if errors:
        raise errors[0]


def test_threads_get_exactly_the_outputs_they_get_alone(llm):
    alone = [summary(llm.generate(p, sp, use_tqdm=False)) for p, sp in JOBS]
    chat_alone = summary(llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False))
    by_hand_alone = [list(o.outputs[0].token_ids) for o in llm.generate(*JOBS[0], use_tqdm=False)]
    got = {}

    def generate(i, reps=3):
        def target():
            got[i] = [summary(llm.generate(*JOBS[i], use_tqdm=False)) for _ in range(reps)]
        return target

    def chat():
        got["chat"] = [summary(llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False))
                       for _ in range(3)]

    def by_hand():   # add_request + step, interleaved with the other threads' generate calls
        seqs = [llm.add_request(p, JOBS[0][1])[0] for p in JOBS[0][0]]
        while not all(seq.is_finished for seq in seqs):
            llm.step()
        got["by_hand"] = [seq.completion_token_ids for seq in seqs]

    for _ in range(2):
        got.clear()
        run_threads([generate(i) for i in range(len(JOBS))] + [chat, by_hand])
        for i, expected in enumerate(alone):
            assert got[i] == [expected] * 3, f"job {i}"
        assert got["chat"] == [chat_alone] * 3
        assert got["by_hand"] == by_hand_alone
        assert_clean(llm)


def test_a_failing_call_leaves_the_other_threads_calls_untouched(llm, monkeypatch):
    """Only job 2 has stop strings, so only its calls detokenize: they fail, the others succeed."""
    alone = [summary(llm.generate(p, sp, use_tqdm=False)) for p, sp in JOBS]

    def broken_step(self, *args):
        raise RuntimeError("injected in the detokenizer")

    monkeypatch.setattr(IncrementalDetokenizer, "step", broken_step)
    got, failures = {}, []

    def generate(i):
        def target():
            for _ in range(3):
                try:
                    got.setdefault(i, []).append(summary(llm.generate(*JOBS[i], use_tqdm=False)))
                except RuntimeError as e:
                    failures.append((i, str(e)))
        return target

    run_threads([generate(i) for i in range(len(JOBS))])
    assert failures == [(2, "injected in the detokenizer")] * 3
    for i in (0, 1, 3):
        assert got[i] == [alone[i]] * 3
    assert_clean(llm)
