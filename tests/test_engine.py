"""End to end on a tiny random Qwen3: every greedy token is an argmax of transformers' logits."""
import pytest
import torch

from conftest import EOS, HFOracle, make_model, random_prompts
from nanovllm import LLM, CompletionOutput, RequestOutput, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def oracle(qwen3_dir):
    return HFOracle(qwen3_dir)


def check(oracle, prompts, outs):
    for prompt, out in zip(prompts, outs):
        oracle.assert_greedy(prompt, out.outputs[0].token_ids)


def test_mixed_prompt_lengths_batch(qwen3_dir, oracle):
    llm = LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=128)
    prompts = random_prompts(6, [1, 2, 17, 64, 150, 300], seed=1)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts          # prompt order kept
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    check(oracle, prompts, outs)


def test_shared_prefix_runs_twice_and_hits_cache(qwen3_dir, oracle):
    llm = LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=128)
    prefix = random_prompts(1, [64], seed=2)[0]                   # 4 full blocks
    prompts = [prefix + tail for tail in random_prompts(3, [5, 20, 33], seed=3)] + [prefix]
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    bm = llm.scheduler.block_manager
    cached_before = len(bm.hash_to_block_id)
    computed = []
    original_run = llm.model_runner.launch

    def spy(batch, **kwargs):
        if batch.is_prefill:
            computed.extend(batch.num_new_tokens)
        return original_run(batch, **kwargs)

    llm.model_runner.launch = spy
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert cached_before >= 4
    # Every prompt reuses the prefix; the block-aligned, fully cached one still computes its last block.
    assert sum(computed) < sum(len(p) for p in prompts) - 3 * 64
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first]
    check(oracle, prompts, second)


def test_prefix_caching_can_be_turned_off(qwen3_dir):
    prompts = [random_prompts(1, [40], seed=9)[0]] * 2
    runs = {}
    for enabled in (True, False):
        llm = LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=32, enable_prefix_caching=enabled)
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        computed, original_run = [], llm.model_runner.launch
        llm.model_runner.launch = lambda b, computed=computed, original_run=original_run, **kwargs: (
            computed.extend(b.num_new_tokens if b.is_prefill else []), original_run(b, **kwargs))[1]
        runs[enabled] = (llm.generate(prompts[1:], GREEDY, use_tqdm=False)[0].outputs[0].token_ids,
                         sum(computed))
        assert bool(llm.scheduler.block_manager.hash_to_block_id) == enabled
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == 40 - 32 and runs[False][1] == 40   # two cached blocks of 16, or none
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False"):
        LLM(qwen3_dir, enable_prefix_caching="yes")


def test_tiny_kv_cache_preempts_and_stays_correct(qwen3_dir, oracle):
    prompts = random_prompts(6, [10, 20, 30, 12, 25, 7], seed=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(qwen3_dir, kvcache_block_size=8, num_kvcache_blocks=12)   # ~96 tokens for ~250 needed
    preempted = []
    original = llm.scheduler._preempt
    llm.scheduler._preempt = lambda seq: (preempted.append(seq.seq_id), original(seq))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert preempted
    check(oracle, prompts, outs)
    big = LLM(qwen3_dir, kvcache_block_size=8, num_kvcache_blocks=256).generate(prompts, params,
                                                                                use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in big]


def test_chunked_prefill_below_prompt_length(qwen3_dir, oracle):
    prompts = random_prompts(3, [200, 90, 45], seed=5)
    llm = LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=64, max_num_batched_tokens=64)
    sizes = []
    original_run = llm.model_runner.launch
    llm.model_runner.launch = lambda b, **kwargs: (sizes.append(b.num_tokens), original_run(b, **kwargs))[1]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert max(sizes) <= 64
    check(oracle, prompts, outs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_short_prompt_and_a_chunked_one_in_a_nearly_full_cache(qwen3_dir, oracle, async_scheduling):
    # A (2 blocks) and B (10 of the 12 blocks, prefilled in chunks of 32 tokens): both get all their
    # tokens, none is ended as if it could never fit, and every token is an argmax
    prompts = random_prompts(2, [30, 150], seed=7)
    llm = LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=12, max_num_batched_tokens=32,
              async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [20, 20]
    check(oracle, prompts, outs)


def test_output_shapes_and_stop_on_eos(qwen3_dir):
    llm = LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=32)
    outs = llm.generate(["w5 w6 w7", [9, 10]], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert isinstance(outs[0], RequestOutput) and isinstance(outs[0].outputs[0], CompletionOutput)
    out = outs[0]
    assert out.prompt == "w5 w6 w7" and out.prompt_token_ids == [5, 6, 7]
    assert outs[1].prompt is None and outs[1].prompt_token_ids == [9, 10]
    c = out.outputs[0]
    assert c.index == 0 and c.finished() and out.finished
    assert c.finish_reason in ("stop", "length")
    if c.finish_reason == "length":
        assert len(c.token_ids) == 5
    else:
        assert c.token_ids[-1] == EOS
    assert out["text"] == c.text and out["token_ids"] == c.token_ids
    assert c.text == "".join(f" w{t}" for t in c.token_ids if t != EOS)   # read after the prompt's "w7"


def test_eos_finishes_with_stop(qwen3_dir):
    llm = LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=32)
    prompts = random_prompts(16, [4] * 16, seed=6)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert (c.finish_reason == "stop") == (EOS in c.token_ids)
        assert EOS not in c.token_ids[:-1]


def test_token_ids_without_tokenizer(tmp_path):
    path = make_model(str(tmp_path / "m"), "qwen3", tokenizer=False)
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=16)
    out = llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].text == ""
    HFOracle(path).assert_greedy([3, 4, 5], out.outputs[0].token_ids)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["w3 w4"], GREEDY, use_tqdm=False)


def test_temperature_sampling_runs(qwen3_dir):
    llm = LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=32)
    outs = llm.generate(random_prompts(4, [5] * 4),
                        SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert all(0 <= t < 512 for o in outs for t in o.outputs[0].token_ids)


def test_unknown_option_and_bad_values(qwen3_dir):
    with pytest.raises(TypeError, match="unknown option"):
        LLM(qwen3_dir, max_num_seq=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(qwen3_dir, max_num_seqs=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_max_model_len_capped_by_model(qwen3_dir):
    llm = LLM(qwen3_dir, max_model_len=100_000, num_kvcache_blocks=4)
    assert llm.config.max_model_len == 1024


def test_vllm_prompt_dicts(qwen3_dir):
    llm = LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=32)
    plain = llm.generate(["w5 w6 w7", [9, 10]], GREEDY, use_tqdm=False)
    dicts = llm.generate([{"prompt": "w5 w6 w7"}, {"prompt_token_ids": [9, 10]}], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert dicts[0].prompt == "w5 w6 w7" and dicts[1].prompt is None and dicts[1].prompt_token_ids == [9, 10]
    single = llm.generate({"prompt_token_ids": [9, 10]}, GREEDY, use_tqdm=False)
    assert single[0].outputs[0].token_ids == plain[1].outputs[0].token_ids
    with pytest.raises(TypeError, match="prompt 1: a prompt dict is"):
        llm.generate([{"prompt": "w5"}, {"text": "w5"}], GREEDY, use_tqdm=False)


def test_partial_block_prefix_hits_copy_rows_and_keep_the_tokens(qwen3_dir, oracle):
    # Blocks of 64: a prompt sharing 90 tokens with an earlier one reuses one whole block and copies
    # 26 rows of the next (a partial hit); the same prompt again copies all but its last token.
    llm = LLM(qwen3_dir, kvcache_block_size=64, num_kvcache_blocks=64)
    base = random_prompts(1, [100], seed=11)[0]
    llm.generate([base], GREEDY, use_tqdm=False)
    prompts = [base[:90] + random_prompts(1, [20], seed=12)[0], base]
    computed, copies, original_run = [], [], llm.model_runner.launch

    def spy(batch, **kwargs):
        if batch.is_prefill:
            computed.extend(batch.num_new_tokens)
            copies.extend(batch.kv_copies)
        return original_run(batch, **kwargs)

    llm.model_runner.launch = spy
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [c.num_tokens for c in copies] == [26, 35] and computed == [20, 1]
    assert [o.num_cached_tokens for o in outs] == [90, 99]
    check(oracle, prompts, outs)


def test_prefill_and_decode_pass_the_qk_kernel_one_index_dtype(qwen3_dir, monkeypatch):
    """Prefill positions and slots are int32, as decode's are: on CUDA the q/k norm + rotary + store
    kernel then has one variant for both (int64 prefill positions compiled a variant of their own on
    a cold process's first request)."""
    from nanovllm.layers import attention
    seen, real = set(), attention.qk_norm_rope_store

    def record(*args, **kwargs):
        positions, slots = args[5], args[6]
        if slots is not None and slots.numel():
            seen.add((positions.dtype, slots.dtype))
        return real(*args, **kwargs)
    monkeypatch.setattr(attention, "qk_norm_rope_store", record)
    llm = LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=32, enforce_eager=True)
    llm.generate(random_prompts(2, [5, 40], seed=9), SamplingParams(temperature=0, max_tokens=3),
                 use_tqdm=False)
    assert seen == {(torch.int32, torch.int32)}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_warm_up_store_gives_every_layer_a_dummy_block_that_slot_minus_one_leaves_untouched(
        qwen3_dir, kv_cache_dtype, monkeypatch):
    """attention.STORE_AT_WARM_UP: within warm_up_store the warm-up forward's stores (slots -1) go to
    a zeroed dummy block of the cache's dtype and write nothing; the layers' own caches come back,
    and the forward's output is the one without it."""
    from nanovllm.layers import attention
    from nanovllm.utils.context import Context, forward_context
    llm = LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=32, kv_cache_dtype=kv_cache_dtype)
    runner = llm.model_runner
    layers = runner.attention_layers
    own = [(a.k_cache, a.v_cache, a.k_scale, a.v_scale) for a in layers]
    input_ids = torch.randint(0, 100, (24,))
    cu = torch.tensor([0, 12, 24], dtype=torch.int32)
    ctx = Context(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=12, max_seqlen_k=12,
                  slot_mapping=torch.full((24,), -1, dtype=torch.int32))
    positions = torch.arange(12, dtype=torch.int32).repeat(2)
    seen, real = [], attention.qk_norm_rope_store

    def record(*args, **kwargs):
        seen.append((args[7], args[6]))   # the cache, the slots
        return real(*args, **kwargs)
    monkeypatch.setattr(attention, "qk_norm_rope_store", record)
    runner.kv_cache.zero_()   # (the test's own stores to compare: none may land anywhere)
    with torch.inference_mode(), forward_context(ctx):
        want = runner.model(input_ids, positions)
        monkeypatch.setattr(attention, "STORE_AT_WARM_UP", True)
        with attention.warm_up_store(layers, 16, runner.kv_cache_dtype, torch.device("cpu")):
            seen.clear()
            got = runner.model(input_ids, positions)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert len(seen) == len(layers)
    dummy = seen[0][0]
    assert dummy.shape == (1, 16, layers[0].num_kv_heads, layers[0].head_dim)
    assert dummy.dtype == runner.kv_cache_dtype and not dummy.float().abs().sum()
    assert all(cache is dummy and bool((slots == -1).all()) for cache, slots in seen)
    assert [(a.k_cache, a.v_cache, a.k_scale, a.v_scale) for a in layers] == own
    assert not runner.kv_cache.float().abs().sum()
