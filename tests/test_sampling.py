"""The sampler's knobs against direct computations, and vLLM's sampling API end to end on a tiny model."""
import math

import pytest
import torch

from conftest import EOS, HFOracle, random_prompts
from nanovllm import LLM, SamplingParams
from nanovllm.engine.sampling_prep import SamplingPrep
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import (Sampler, SamplingTensors, apply_min_p, apply_penalties,
                                     apply_top_k_top_p)

NEG = float("-inf")


# ---- masks and penalties on hand-made logits ---------------------------------------------------

def kept(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row > NEG).flatten().tolist()) for row in logits]


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[0.1, 2.0, 1.0, 3.0, -1.0], [5.0, 4.0, 3.0, 2.0, 1.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 5, 1]), None)
    assert kept(out) == [{3, 1}, {0, 1, 2, 3, 4}, {4}]
    assert torch.equal(out[out > NEG], logits[out > NEG])   # kept logits are unchanged


def test_top_p_keeps_the_smallest_set_reaching_p():
    torch.manual_seed(0)
    logits = torch.randn(6, 12) * 2
    top_p = torch.tensor([0.1, 0.3, 0.5, 0.8, 0.95, 1.0])
    out = apply_top_k_top_p(logits, None, top_p)
    for row, p, got in zip(logits, top_p.tolist(), kept(out)):
        probs, order = torch.softmax(row, -1).sort(descending=True)
        expect, total = set(), 0.0
        for prob, token in zip(probs.tolist(), order.tolist()):
            expect.add(token)
            total += prob
            if total >= p:
                break
        assert got == expect


def test_top_k_then_top_p():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # top_k=3 renormalises to 4/9, 3/9, 2/9; top_p=0.7 then needs the two most likely.
    assert kept(apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([0.7]))) == [{0, 1}]


def test_min_p_drops_tokens_below_a_share_of_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = apply_min_p(logits, torch.tensor([0.25, 0.0]))
    assert kept(out) == [{0, 1, 2}, {0, 1, 2, 3}]   # 0.25 * 0.5 = 0.125


def penalties(**kw) -> SamplingTensors:
    return SamplingTensors(temperatures=torch.zeros(2), all_greedy=True, **kw)


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5], [2.0, -2.0, 1.0, -1.0, 0.5]])
    pad = 5
    t = penalties(repetition=torch.tensor([2.0, 1.0]), output_tokens=torch.tensor([[0, pad], [0, 1]]),
                  prompt_tokens=torch.tensor([[1, 3], [pad, pad]]))
    out = apply_penalties(logits.clone(), t)
    assert torch.allclose(out[0], torch.tensor([1.0, -4.0, 1.0, -2.0, 0.5]))   # prompt and output tokens
    assert torch.allclose(out[1], logits[1])                                  # penalty 1 = off


def test_frequency_and_presence_penalties_count_output_tokens():
    logits = torch.zeros(2, 6)
    pad = 6
    t = penalties(frequency=torch.tensor([0.5, 0.0]), presence=torch.tensor([1.0, 0.25]),
                  output_tokens=torch.tensor([[2, 2, 2, 4], [5, pad, pad, pad]]))
    out = apply_penalties(logits.clone(), t)
    expect = torch.zeros(2, 6)
    expect[0, 2] = -(3 * 0.5 + 1.0)
    expect[0, 4] = -(1 * 0.5 + 1.0)
    expect[1, 5] = -0.25
    assert torch.allclose(out, expect)


# ---- distributions -------------------------------------------------------------------------------

DRAWS = 2000


def draw_frequencies(logits: torch.Tensor, **knobs) -> torch.Tensor:
    torch.manual_seed(1234)
    rows = logits.expand(DRAWS, -1).clone()
    t = SamplingTensors(temperatures=torch.full((DRAWS,), knobs.pop("temperature", 1.0)), all_greedy=False,
                        **{k: torch.full((DRAWS,), v) for k, v in knobs.items()})
    tokens = Sampler().sample(rows, t).token_ids
    return torch.bincount(tokens, minlength=logits.numel()).double() / DRAWS


def assert_close_to(freq: torch.Tensor, probs: torch.Tensor):
    # each frequency within 4 standard errors of its probability (and exactly 0 where p = 0)
    se = torch.sqrt(probs * (1 - probs) / DRAWS)
    assert torch.all((freq - probs).abs() <= 4 * se + 1e-12), (freq, probs)


LOGITS = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_matches_softmax(temperature):
    probs = torch.softmax(LOGITS.double() / temperature, -1)
    assert_close_to(draw_frequencies(LOGITS, temperature=temperature), probs)


def test_top_p_matches_the_truncated_distribution():
    probs = torch.softmax(LOGITS.double(), -1)
    # probabilities, most likely first: .538 (logit 2), .198 (1), .120 (0.5), ...
    # top_p = 0.8 needs three (.736 < .8 <= .856)
    keep = torch.tensor([1, 1, 0, 0, 0, 1], dtype=torch.bool)
    truncated = torch.where(keep, probs, 0.0)
    assert_close_to(draw_frequencies(LOGITS, top_p=0.8), truncated / truncated.sum())


def test_top_k_and_min_p_distributions():
    probs = torch.softmax(LOGITS.double(), -1)
    top2 = torch.where(torch.tensor([1, 0, 0, 0, 0, 1], dtype=torch.bool), probs, 0.0)
    assert_close_to(draw_frequencies(LOGITS, top_k=2), top2 / top2.sum())
    # min_p 0.3: keep probabilities >= 0.3 * max (e^-1 = 0.37 of the top passes; e^-1.5 = 0.22 does not)
    minp = torch.where(LOGITS >= 1.0, probs, 0.0)
    assert_close_to(draw_frequencies(LOGITS, min_p=0.3), minp / minp.sum())


def test_seeded_rows_ignore_the_rest_of_the_batch():
    logits = torch.randn(4, 50)
    sampler = Sampler()

    def sample(rows, seeds):
        t = SamplingTensors(temperatures=torch.ones(len(rows)), all_greedy=False, seeds=seeds)
        return sampler.sample(logits[rows].clone(), t).token_ids.tolist()

    alone = [sample([2], [(0, s)])[0] for s in range(20)]
    batched = [sample([0, 1, 2, 3], [(2, s)])[2] for s in range(20)]
    assert alone == batched and len(set(alone)) > 1


# ---- min_tokens in the scheduler (no model) -----------------------------------------------------

def test_min_tokens_holds_off_eos_and_stop_tokens():
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_blocks=8,
                      block_size=4, eos_token_ids={EOS})
    seq = Sequence([5, 6, 7], SamplingParams(min_tokens=3, stop_token_ids=[9], max_tokens=10))
    sched.add(seq)
    for token in [EOS, 9]:   # outputs 1 and 2: neither may end it
        assert sched.postprocess(sched.schedule(), [token]) == []
    assert sched.postprocess(sched.schedule(), [9]) == [seq]   # output 3 may
    assert (seq.finish_reason, seq.stop_reason) == ("stop", 9)
    assert sched.block_manager.num_free_blocks == 8


# ---- end to end on the tiny model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=64)


@pytest.fixture(scope="module")
def oracle(qwen3_dir):
    return HFOracle(qwen3_dir)


PROMPTS = random_prompts(4, [7, 12, 5, 9], seed=3)


def gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_seeded_request_is_reproducible_and_independent_of_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=12, ignore_eos=True)
    alone = gen(llm, [PROMPTS[0]], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=3, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=9)]
    batch = gen(llm, [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3]],
                [others[0], seeded, others[1], others[2]])
    assert batch[1].outputs[0].token_ids == alone
    assert gen(llm, [PROMPTS[0]], seeded)[0].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_k=50, seed=8, max_tokens=12, ignore_eos=True)
    assert gen(llm, [PROMPTS[0]], other_seed)[0].outputs[0].token_ids != alone


def test_n_completions_are_indexed_and_differ_under_one_seed(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)
    out = gen(llm, PROMPTS[:2], params)
    assert [len(o.outputs) for o in out] == [3, 3]
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    tokens = [tuple(c.token_ids) for c in out[0].outputs]
    assert len(set(tokens)) == 3
    assert [tuple(c.token_ids) for c in gen(llm, PROMPTS[:1], params)[0].outputs] == tokens


def greedy_text(llm, prompt, max_tokens=12):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    c = gen(llm, [prompt], params)[0].outputs[0]
    return c.token_ids, c.text


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(llm, include):
    ids, text = greedy_text(llm, PROMPTS[1])
    words = text.split()   # (the text reads after the prompt: it starts with a space)
    stop = words[2][-1] + " " + words[3][:2]   # the end of word 3 and the start of word 4
    cut = text.find(stop)
    end = cut + len(stop)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop, "no such"],
                            include_stop_str_in_output=include)
    c = gen(llm, [PROMPTS[1]], params)[0].outputs[0]
    assert c.text == (text[:end] if include else text[:cut])
    # generation stopped at the token that completed the stop string
    assert c.token_ids == ids[:len(text[:end].split())]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert llm.scheduler.is_finished()
    assert llm.scheduler.block_manager.num_free_blocks == llm.model_runner.num_kvcache_blocks


def test_stop_token_ids_and_min_tokens(llm):
    ids, _ = greedy_text(llm, PROMPTS[2])
    stop_id = ids[1]
    c = gen(llm, [PROMPTS[2]],
            SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]))[0].outputs[0]
    assert c.token_ids == ids[:ids.index(stop_id) + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_id)
    held = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id], min_tokens=5)
    c = gen(llm, [PROMPTS[2]], held)[0].outputs[0]
    assert len(c.token_ids) >= 5 and stop_id not in c.token_ids[:5] and EOS not in c.token_ids[:5]


def test_min_tokens_bans_eos_and_stop_tokens_in_the_sampler():
    seq = Sequence([5, 6], SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7]),
                   eos_token_ids=frozenset({EOS}))
    sampler, prep = Sampler(), SamplingPrep(16)
    t = prep.prepare([seq])
    logits = torch.zeros(1, 16)
    logits[0, EOS], logits[0, 7], logits[0, 3] = 5.0, 4.0, 1.0
    assert sampler.sample(logits, t).token_ids.tolist() == [3]
    seq.append_token(3)
    seq.append_token(3)   # two outputs: the ban is lifted
    t = prep.prepare([seq])
    assert t is None and sampler.sample(logits, t).token_ids.tolist() == [EOS]   # plain greedy


def test_min_tokens_bans_eos_with_ignore_eos_too():
    # vLLM's min-tokens processor bans the model's EOS whatever ignore_eos says
    seq = Sequence([5, 6], SamplingParams(temperature=0, min_tokens=2, ignore_eos=True),
                   eos_token_ids=frozenset({EOS}))
    logits = torch.zeros(1, 16)
    logits[0, EOS], logits[0, 3] = 5.0, 1.0
    sampler, prep = Sampler(), SamplingPrep(16)
    assert sampler.sample(logits, prep.prepare([seq])).token_ids.tolist() == [3]


def test_logprobs_are_log_softmax_of_transformers_logits(llm, oracle):
    for params in [SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_k=20, seed=2, max_tokens=6, logprobs=0,
                                  ignore_eos=True)]:
        c = gen(llm, [PROMPTS[0]], params)[0].outputs[0]
        ref = torch.log_softmax(oracle.logits(PROMPTS[0] + c.token_ids), -1)
        assert len(c.logprobs) == len(c.token_ids)
        for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[len(PROMPTS[0]) - 1 + i]
            assert list(entry)[0] == token   # the sampled token comes first
            assert abs(entry[token].logprob - row[token].item()) < 1e-4
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = row.topk(params.logprobs)
            for rank, (value, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
                assert abs(entry[t].logprob - value) < 1e-4
                assert entry[t].rank == rank or t == token
            assert len(entry) in (params.logprobs, params.logprobs + 1)
            assert entry[token].decoded_token == f"w{token}"
        assert math.isclose(c.cumulative_logprob, sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
    plain = gen(llm, [PROMPTS[0]], SamplingParams(max_tokens=2))[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_penalties_change_greedy_choice_by_the_formula(llm, oracle):
    params = SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.5, frequency_penalty=0.5,
                            presence_penalty=0.3, ignore_eos=True)
    c = gen(llm, [PROMPTS[3]], params)[0].outputs[0]
    logits = oracle.logits(PROMPTS[3] + c.token_ids)
    for i, token in enumerate(c.token_ids):
        row = logits[len(PROMPTS[3]) - 1 + i].clone()
        out = c.token_ids[:i]
        for t in set(PROMPTS[3] + out):
            row[t] = row[t] / 1.5 if row[t] > 0 else row[t] * 1.5
        for t in set(out):
            row[t] -= 0.5 * out.count(t) + 0.3
        assert row[token] >= row.max() - 1e-3


# ---- vLLM-style script, chat and the tokenizer ----------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w10{% endif %}")


def test_a_vllm_script_runs_unchanged(llm):
    prompts = ["w5 w6 w7", "w8 w9 w10 w11"]
    params = SamplingParams(n=2, temperature=0.8, top_p=0.95, seed=1, stop=["\n"], logprobs=2)
    outputs = llm.generate(prompts, params)
    for o in outputs:
        assert o.prompt in prompts and len(o.outputs) == 2
        for c in o.outputs:
            assert isinstance(c.text, str) and len(c.logprobs) == len(c.token_ids)
            assert c.cumulative_logprob < 0 and c.finish_reason in ("stop", "length")
    tokenizer = llm.get_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    try:
        out = llm.chat([{"role": "user", "content": "w20 w21"}], params)
        assert len(out) == 1 and len(out[0].outputs) == 2
        assert out[0].prompt_token_ids == tokenizer.encode("w20 w21 w10", add_special_tokens=False)
        many = llm.chat([[{"role": "user", "content": "w3"}], [{"role": "user", "content": "w4"}]],
                        SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert [o.prompt for o in many] == ["w3 w10", "w4 w10"]
    finally:
        tokenizer.chat_template = None


def test_chat_without_a_template_is_a_value_error(llm):
    llm.get_tokenizer().chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"role": "user", "content": "w3"}])


def test_bad_stop_token_id_is_rejected_before_queueing(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        gen(llm, PROMPTS[:2], SamplingParams(stop_token_ids=[10_000]))
    assert llm.scheduler.is_finished()
