"""Async scheduling: the engine launches step N+1 before step N's tokens reach the host (inputs of
pending tokens come from the device), and gives exactly the tokens of the one-step-at-a-time engine
in every scenario where the two could differ: EOS and stop tokens or strings ending a sequence
while its next step is already launched, max_tokens, preemption, chunked prefill, seeded sampling,
logprobs, penalties (which fall back to waiting), n > 1, and tensor parallelism."""
import pytest

from conftest import EOS, assert_clean, make_model, random_prompts, tokens
from nanovllm import LLM, SamplingParams
from nanovllm.engine.sampled_tokens import PendingSample

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = random_prompts(6, [1, 9, 17, 40, 70, 130], seed=21)
OPTS = dict(device="cpu", kvcache_block_size=8, num_kvcache_blocks=200, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    """A model that emits EOS now and then: its EOS logit is raised by a bias on the LM head."""
    path = make_model(str(tmp_path_factory.mktemp("qwen3_eos")), "qwen3", seed=5)
    from safetensors.torch import load_file, save_file
    import os
    f = os.path.join(path, "model.safetensors")
    weights = load_file(f)
    weights["lm_head.weight"][EOS] *= 3.0
    save_file(weights, f, metadata={"format": "pt"})
    return path


def both(path, prompts, params, **options):
    """(async outputs, sync outputs), each engine checked clean afterwards."""
    results = []
    for run_ahead in (True, False):
        llm = LLM(path, async_scheduling=run_ahead, **{**OPTS, **options})
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert_clean(llm)
        results.append(outs)
        llm.shutdown()
    return results


def completions(outs):
    # Logprobs to 4 places: batches of other sizes may sum in another order (last-bit differences).
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              None if c.cumulative_logprob is None else round(c.cumulative_logprob, 4)) for c in o.outputs]
            for o in outs]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=20),                                  # EOS ends some early
    SamplingParams(temperature=0, max_tokens=1),
    SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[7, 11, 13, 17], min_tokens=2),
    SamplingParams(temperature=0.8, max_tokens=16, seed=3, n=2),
    SamplingParams(temperature=0, max_tokens=10, logprobs=3),
    SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, presence_penalty=0.5),
    SamplingParams(temperature=0, max_tokens=24, stop=["w7", "w9 w1"]),
], ids=["eos", "one-token", "stop-tokens", "seeded-n2", "logprobs", "penalties", "stop-strings"])
def test_async_equals_sync(eos_model, params):
    run_ahead, one_at_a_time = both(eos_model, PROMPTS, params)
    assert completions(run_ahead) == completions(one_at_a_time)


def test_some_sequences_end_early_on_eos(eos_model):
    # Guards the test above: EOS must really cut sequences short while others go on.
    outs, _ = both(eos_model, PROMPTS, SamplingParams(temperature=0, max_tokens=20))
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert min(lengths) < 20 and max(lengths) == 20


def test_async_equals_sync_under_preemption_and_long_outputs(eos_model):
    # 14 blocks of 8 tokens cannot hold all six sequences: decode preempts and recomputes.
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    run_ahead, one_at_a_time = both(eos_model, PROMPTS[:5], params, num_kvcache_blocks=14)
    assert tokens(run_ahead) == tokens(one_at_a_time)


def test_next_step_is_launched_before_the_previous_tokens_are_read(qwen3_dir, monkeypatch):
    llm = LLM(qwen3_dir, **OPTS)
    events = []
    real_launch, real_result = llm.model_runner.launch, PendingSample.result
    monkeypatch.setattr(llm.model_runner, "launch",
                        lambda b, **kwargs: events.append("launch") or real_launch(b, **kwargs))
    monkeypatch.setattr(PendingSample, "result", lambda self: events.append("result") or real_result(self))
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    # prefill + 4 decode steps, each result read only after the next launch; the last, drained.
    assert events[:4] == ["launch", "launch", "result", "launch"]
    assert events.count("launch") == events.count("result")
    assert_clean(llm)


def test_engine_step_loop_by_hand(qwen3_dir):
    llm = LLM(qwen3_dir, **OPTS)
    seqs = llm.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finished = []
    while not llm.is_finished():
        finished += llm.step()[0]
    assert finished == seqs and len(seqs[0].completion_token_ids) == 4
    assert_clean(llm)


def test_tp2_async_equals_sync(eos_model):
    # Rank 1 reads pending input tokens from its copy of the sampled tokens, broadcast by rank 0.
    params = SamplingParams(temperature=0, max_tokens=12)
    run_ahead, one_at_a_time = both(eos_model, PROMPTS, params, tensor_parallel_size=2, device="cpu")
    assert tokens(run_ahead) == tokens(one_at_a_time)


def test_a_launched_prompt_is_shared_by_the_very_next_step(qwen3_dir):
    """Prompt blocks are registered in the prefix cache when their step is launched (a later step
    reads them after, in stream order), so running ahead shares a prefix as soon as one step later
    would: the same prefill work as one step at a time."""
    prefix = random_prompts(1, [32], seed=4)[0]                  # 4 blocks of 8
    prompts = [prefix + tail for tail in random_prompts(4, [8, 8, 8, 8], seed=5)]
    computed = {}
    for run_ahead in (True, False):
        llm = LLM(qwen3_dir, async_scheduling=run_ahead, **{**OPTS, "max_num_batched_tokens": 40})
        counts, launch = [], llm.model_runner.launch
        llm.model_runner.launch = lambda b, counts=counts, launch=launch, **kwargs: (
            counts.extend(b.num_new_tokens if b.is_prefill else []), launch(b, **kwargs))[1]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
        computed[run_ahead] = sum(counts)
    assert computed[True] == computed[False] == 40 + 3 * 8   # the first prompt whole, then the tails
