"""Speculative decoding (n-gram drafts, verified by the target model): greedy outputs are exactly those
without speculation; sampled tokens keep the target model's distribution; stops, preemption, n > 1,
logprobs, prefix caching and chunked prefill compose with it. Tiny random models on the CPU."""
import logging
import math

import pytest
import torch

from conftest import HFOracle, assert_clean, edit_checkpoint, make_model, random_prompts
from nanovllm import LLM, SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence
from nanovllm.spec import NgramProposer, SpeculativeConfig

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
OPTIONS = dict(kvcache_block_size=16, num_kvcache_blocks=64)
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def repetitive_prompts() -> list[list[int]]:
    """Prompts that repeat themselves, so the n-gram proposer finds drafts; the tiny random models
    also fall into loops of their own, where drafts are accepted."""
    return [[5, 6, 7, 8, 9] * 6, [10, 11, 12] * 8 + [13], list(range(20, 60)), [30, 31] * 10]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("spec_qwen3")), "qwen3")


@pytest.fixture(scope="module")
def base(model):
    return LLM(model, **OPTIONS)


@pytest.fixture(scope="module")
def spec(model):
    return LLM(model, speculative_config=SPEC, **OPTIONS)


def token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


# ---- configuration and the proposer -------------------------------------------------------------

@pytest.mark.parametrize("value, message", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "unknown method 'eagle'"),
    ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1, got None"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "draft"}, "unknown key 'model'"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_config_is_a_value_error(value, message):
    with pytest.raises(ValueError, match="speculative_config") as e:
        SpeculativeConfig.of(value)
    assert message in str(e.value)


def test_bad_speculative_config_refused_by_llm(model):
    with pytest.raises(ValueError, match="unknown method"):
        LLM(model, speculative_config={"method": "medusa", "num_speculative_tokens": 2}, **OPTIONS)


def test_lookup_bounds_default_as_vllm_s():
    assert SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 2}) == \
        SpeculativeConfig("ngram", 2, 5, 5)
    only_max = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)


def test_ngram_proposer_takes_the_longest_recent_match():
    p = NgramProposer(3, 1, 3)
    # the 3-gram [1, 2, 3] occurred at the start: propose what followed it
    assert p.propose([1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 10) == [4, 5, 6]
    # longest wins over more recent: 2-gram [8, 3] at 5, 1-gram [3] later at 7
    assert p.propose([8, 3, 1, 1, 1, 8, 3, 7, 3, 0, 8, 3], 10) == [7, 3, 0]
    # of equal length, the most recent occurrence; fewer tokens when it is near the end
    assert p.propose([4, 1, 4, 2, 4], 10) == [2, 4]
    assert p.propose([1, 2, 3, 4], 10) == []            # nothing recurs
    assert p.propose([1, 2, 3, 1, 2, 3, 1, 2], 2) == [3, 1]   # capped by max_drafts
    assert NgramProposer(3, 2, 3).propose([5, 1, 5], 10) == []   # a 1-gram is below prompt_lookup_min


def test_byte_search_finds_what_a_plain_loop_finds():
    """find_earlier searches int64 bytes: a match that straddles token boundaries is skipped."""
    from array import array

    from nanovllm.spec.ngram import find_earlier

    def plain(ids, n):
        return next((s for s in range(len(ids) - n - 1, -1, -1) if ids[s:s + n] == ids[-n:]), None)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        ids = torch.randint(0, 4, (int(torch.randint(2, 40, (), generator=g)),), generator=g)
        ids = (ids * torch.tensor([1, 256, 65536])[torch.randint(0, 3, ids.shape, generator=g)]).tolist()
        for n in range(1, min(4, len(ids) - 1) + 1):
            assert find_earlier(array("q", ids).tobytes(), n) == plain(ids, n), (ids, n)


def test_free_rejected_gives_back_blocks_past_the_tokens():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    seq = Sequence(list(range(3, 9)))   # 6 tokens: 2 blocks
    bm.allocate(seq)
    assert bm.can_append(seq, 5) and not bm.can_append(seq, 4 * 6 + 3)
    bm.may_append(seq, 5)                # slots for 5 drafts after the 6 tokens: 3 blocks
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    seq.append_token(11)
    bm.free_rejected(seq)                # 7 tokens need 2 blocks
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6


# ---- greedy: exactly the tokens without speculation ------------------------------------------------

def test_greedy_is_identical_and_some_drafts_are_rejected(base, spec, model, caplog):
    prompts = repetitive_prompts()
    want = base.generate(prompts, GREEDY, use_tqdm=False)
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        got = spec.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    drafted = sum(o.metrics.num_draft_tokens for o in got)
    accepted = sum(o.metrics.num_accepted_tokens for o in got)
    assert 0 < accepted < drafted   # both branches of verification ran
    assert base.generate(prompts[:1], GREEDY, use_tqdm=False)[0].metrics is None
    assert any("speculative decoding:" in r.getMessage() and f"{accepted} accepted" in r.getMessage()
               for r in caplog.records)
    HFOracle(model).assert_greedy(prompts[0], got[0].outputs[0].token_ids)
    assert_clean(spec.llm_engine)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_greedy_is_identical_on_other_families(tmp_path, arch):
    path = make_model(str(tmp_path), arch)
    prompts = repetitive_prompts()
    want = LLM(path, **OPTIONS).generate(prompts, GREEDY, use_tqdm=False)
    got = LLM(path, speculative_config=SPEC, **OPTIONS).generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0


def test_requests_without_drafts_share_the_verify_step(base, spec):
    """Penalties, bad_words and min_tokens make a request decode one token a step (its law changes
    with every token); in the same batch as drafting requests it samples as without speculation.
    logit_bias and allowed_token_ids hold for drafts too."""
    prompts = repetitive_prompts()
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias={40: 3.0}),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, min_tokens=10),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                             allowed_token_ids=[30, 31, 40, 41, 42])]
    got = spec.generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == token_ids(base.generate(prompts, params, use_tqdm=False))
    assert got[0].metrics.num_draft_tokens == 0 and got[3].metrics.num_draft_tokens > 0
    assert set(got[3].outputs[0].token_ids) <= {30, 31, 40, 41, 42}


def test_without_async_scheduling_too(model, base):
    prompts = repetitive_prompts()
    llm = LLM(model, speculative_config=SPEC, async_scheduling=False, **OPTIONS)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == \
        token_ids(base.generate(prompts, GREEDY, use_tqdm=False))


def test_stops_where_they_would_without_speculation(base, spec):
    """max_tokens and stop strings / stop ids cut a run of accepted drafts at the same token."""
    prompts = repetitive_prompts()
    full = base.generate(prompts, GREEDY, use_tqdm=False)
    for max_tokens in range(1, 14):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert token_ids(spec.generate(prompts, params, use_tqdm=False)) == \
            token_ids(base.generate(prompts, params, use_tqdm=False))
    for out in full:
        ids = out.outputs[0].token_ids
        for cut in (3, 7, 12):
            stop_word = f"w{ids[cut]}"
            for params in (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop_word]),
                           SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                          stop_token_ids=[ids[cut]])):
                want = base.generate([out.prompt_token_ids], params, use_tqdm=False)[0].outputs[0]
                got = spec.generate([out.prompt_token_ids], params, use_tqdm=False)[0].outputs[0]
                assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
                    (want.token_ids, want.text, want.finish_reason, want.stop_reason)
                assert len(got.token_ids) <= cut + 1
    assert_clean(spec.llm_engine)


def test_preemption_with_a_tiny_cache(model, base):
    """Eight sequences over 12 blocks of 8 tokens: preempted and recomputed, drafts and all."""
    prompts = repetitive_prompts() * 2
    llm = LLM(model, speculative_config=SPEC, kvcache_block_size=8, num_kvcache_blocks=12)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == token_ids(base.generate(prompts, params, use_tqdm=False))
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0
    assert_clean(llm.llm_engine)


def test_prefix_caching_and_chunked_prefill(model, base):
    shared = random_prompts(1, [40], seed=3)[0]
    prompts = [shared + p for p in repetitive_prompts()]
    llm = LLM(model, speculative_config=SPEC, max_num_batched_tokens=48, **OPTIONS)
    want = token_ids(base.generate(prompts, GREEDY, use_tqdm=False))
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    again = llm.generate(prompts, GREEDY, use_tqdm=False)   # now the prompts hit the prefix cache
    assert token_ids(again) == want and all(o.num_cached_tokens > 0 for o in again)


def test_logprobs_per_accepted_token(base, spec):
    prompts = repetitive_prompts()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    want, got = base.generate(prompts, params, use_tqdm=False), spec.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.outputs[0].logprobs) == len(w.outputs[0].token_ids)
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lg.keys() == lw.keys()
            for t in lw:
                assert lg[t].rank == lw[t].rank
                assert math.isclose(lg[t].logprob, lw[t].logprob, abs_tol=1e-4)
        assert math.isclose(g.outputs[0].cumulative_logprob, w.outputs[0].cumulative_logprob, abs_tol=1e-3)


def test_n_completions_and_seeded_sampling(base, spec):
    prompts = repetitive_prompts()[:2]
    greedy = SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True)
    got = spec.generate(prompts, greedy, use_tqdm=False)
    assert token_ids(got) == token_ids(base.generate(prompts, greedy, use_tqdm=False))
    seeded = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
    first, second = (spec.generate(prompts, seeded, use_tqdm=False) for _ in range(2))
    assert token_ids(first) == token_ids(second)   # a seeded request repeats, drafts and all
    assert len({tuple(c.token_ids) for c in first[0].outputs}) > 1   # its completions differ
    assert all(len(c.token_ids) == 20 for o in first for c in o.outputs)
    assert_clean(spec.llm_engine)


def test_tensor_parallel_equals_one_rank(model, base):
    """TP=2 on the CPU: the verify step's StepInput reaches the worker, which runs the same rows."""
    prompts = repetitive_prompts()
    llm = LLM(model, speculative_config=SPEC, tensor_parallel_size=2, device="cpu", **OPTIONS)
    try:
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert token_ids(got) == token_ids(base.generate(prompts, GREEDY, use_tqdm=False))
        assert sum(o.metrics.num_accepted_tokens for o in got) > 0
    finally:
        llm.shutdown()


# ---- sampling: the target model's distribution ----------------------------------------------------

def next_token_law(oracle: HFOracle, token_ids: list[int]) -> torch.Tensor:
    return torch.softmax(oracle.logits(token_ids)[-1].double(), dim=-1)


def prompt_with_uncertain_draft(oracle: HFOracle) -> tuple[list[int], int, int]:
    """A prompt P = S + [a, c] + S whose likely first token is a (prefill samples it), after which
    the n-gram draft is c (what followed S's tail and a before): with c the model's likeliest
    token after P + [a] at a probability between 0.15 and 0.85, drafts are both accepted and
    rejected often. Returns P, a and c."""
    for seed in range(100):
        s = random_prompts(1, [6], seed=seed)[0]
        a = c = 3
        for _ in range(6):   # a fixed point: a and c the argmaxes after the prompt they are part of
            prompt = s + [a, c] + s
            new_a = next_token_law(oracle, prompt).argmax().item()
            new_c = next_token_law(oracle, prompt + [new_a]).argmax().item()
            if (new_a, new_c) == (a, c):
                p_c = next_token_law(oracle, prompt + [a])[c]
                if 0.15 < p_c < 0.85 and NgramProposer(3, 1, 3).propose(prompt + [a], 3)[0] == c:
                    return prompt, a, c
                break
            a, c = new_a, new_c
    raise AssertionError("no prompt with an uncertain first draft")


def total_variation(counts: dict[int, int], p: torch.Tensor) -> float:
    n = sum(counts.values())
    seen = sum(abs(c / n - p[t].item()) for t, c in counts.items())
    unseen = sum(p[t].item() for t in range(p.numel()) if t not in counts)
    return 0.5 * (seen + unseen)


@pytest.fixture(scope="module")
def peaked_model(tmp_path_factory):
    """The tiny model with its output head scaled up: at temperature 1 its next-token distribution
    puts tens of percent on a few tokens (the plain one's is nearly flat: drafts would never pass)."""
    path = make_model(str(tmp_path_factory.mktemp("spec_peaked")), "qwen3")
    edit_checkpoint(path, lambda tensors: tensors.update({"lm_head.weight": tensors["lm_head.weight"] * 6}))
    return path


def test_sampled_tokens_keep_the_target_distribution(peaked_model):
    """At temperature 1, the law of the tokens a verify step gives (the second and the third, after
    the most common first ones) is the model's: 2000 samples with speculation lie within sampling
    noise of the exact distributions (a wrong rule, such as always keeping the draft or redrawing
    from p after a rejection, is far outside)."""
    oracle = HFOracle(peaked_model)
    prompt, a, c = prompt_with_uncertain_draft(oracle)
    torch.manual_seed(0)
    num = 2000
    llm = LLM(peaked_model, speculative_config=SPEC, kvcache_block_size=16, num_kvcache_blocks=num + 8,
              max_num_seqs=num, max_num_batched_tokens=num * 4 + 64)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([prompt] * num, params, use_tqdm=False)
    samples = [o.outputs[0].token_ids for o in outs]
    after_a = [s for s in samples if s[0] == a]
    assert len(after_a) > num // 4
    drafts = sum(o.metrics.num_draft_tokens for o, s in zip(outs, samples) if s[0] == a)
    accepted = sum(o.metrics.num_accepted_tokens for o, s in zip(outs, samples) if s[0] == a)
    assert drafts >= len(after_a) and 0 < accepted < drafts   # max_tokens=3: one draft, then none
    # the second token, drawn by verifying draft c after P + [a]
    second = counts([s[1] for s in after_a])
    law = next_token_law(oracle, prompt + [a])
    noise = 1.5 / math.sqrt(len(after_a))
    assert total_variation(second, law) < 0.04 + noise, (second, law.topk(4))
    assert abs(second.get(c, 0) / len(after_a) - law[c].item()) < 4 * math.sqrt(0.25 / len(after_a))
    # the third, after an accepted c
    after_ac = [s for s in after_a if s[1] == c]
    law = next_token_law(oracle, prompt + [a, c])
    assert total_variation(counts([s[2] for s in after_ac]), law) < 0.04 + 1.5 / math.sqrt(len(after_ac))


def counts(tokens: list[int]) -> dict[int, int]:
    out = {}
    for t in tokens:
        out[t] = out.get(t, 0) + 1
    return out


def test_verify_keeps_a_truncated_law_with_seeded_draws():
    """verify() alone on made-up logits, top_k=2 and seeded requests: draft 1 is kept with its
    probability under the truncated law (0.375), a rejection falls to the other kept token, the
    token after a kept draft follows the next row's truncated law; the same seeds repeat."""
    from nanovllm.engine.sampling_prep import SamplingPrep
    from nanovllm.spec.verify import verify
    row0 = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()    # top 2: [0.625, 0.375]
    row1 = torch.tensor([0.1, 0.2, 0.1, 0.6]).log()      # top 2 (3, 1): [0.75, 0.25]
    num = 3000
    seqs = [Sequence([5, 6], SamplingParams(temperature=1.0, top_k=2, seed=i)) for i in range(num)]
    logits = torch.stack([row0, row1] * num)
    prep = SamplingPrep(4)
    first = verify(logits, seqs, [[1]] * num, prep).token_ids
    assert first == verify(logits, seqs, [[1]] * num, prep).token_ids   # seeded: repeats
    kept = [t for t in first if t[0] == 1]
    assert all(t == [0] for t in first if t[0] != 1)   # rejected: the only other token in the top 2
    bound = 4 * math.sqrt(0.25 / num)
    assert abs(len(kept) / num - 0.375) < bound
    assert all(len(t) == 2 and t[1] in (1, 3) for t in kept)
    assert abs(sum(t[1] == 3 for t in kept) / len(kept) - 0.75) < 4 * math.sqrt(0.25 / len(kept))
