"""Reliability on the tiny Qwen3 model: the max_model_len limit, a clean engine after every call
(also after a failure in the middle of one), a preemption storm, a soak run, start-up errors."""
import gc
import json
import os
import shutil

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import Sequence
from conftest import assert_clean, random_prompts, tokens

GREEDY = SamplingParams(temperature=0, max_tokens=6)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- max_model_len ------------------------------------------------------------------------

def test_requests_stop_at_max_model_len(qwen3_dir):
    llm = LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=40)
    prompts = random_prompts(3, [10, 30, 39], seed=3)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    # prompt + output stop at 40 tokens
    assert [len(o.token_ids) for o in outs] == [20, 10, 1]
    assert [o.finish_reason for o in outs] == ["length"] * 3
    for n in (40, 41):   # a prompt must leave room for one output token
        with pytest.raises(ValueError, match=f"prompt 0 has {n} tokens, too many for max_model_len=40"):
            llm.generate([[5] * n], params, use_tqdm=False)
    assert_clean(llm)


def test_a_sequence_that_outgrows_the_whole_cache_stops_with_length(qwen3_dir):
    """A prompt that fits but whose output would not: it ends early instead of hanging."""
    llm = LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=2)   # 32 tokens in all
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    short, grows = llm.generate(random_prompts(2, [3, 20], seed=4),
                                [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), params],
                                use_tqdm=False)
    assert len(short.outputs[0].token_ids) == 3
    out = grows.outputs[0]
    assert out.finish_reason == "length" and 20 + len(out.token_ids) == 33   # 32 computed + the last sampled
    assert_clean(llm)


def test_step_reports_a_sequence_that_outgrew_the_cache(qwen3_dir):
    """Driving add_request / step by hand, every request is reported finished once."""
    llm = LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=2)
    seqs = llm.add_request([5] * 20, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    reported = []
    for _ in range(100):
        if llm.is_finished():
            break
        reported += llm.step()[0]
    assert reported == seqs and seqs[0].finish_reason == "length"
    assert_clean(llm)


# ---- clean after every call, also after a failure -----------------------------------------

@pytest.fixture(scope="module")
def reference(qwen3_dir):
    opts = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_batched_tokens=32)
    prompts = random_prompts(6, [5, 40, 17, 17, 60, 3], seed=5)
    prompts[3][:16] = prompts[2][:16]   # a shared first block: the prefix cache takes part
    return opts, prompts, tokens(LLM(qwen3_dir, **opts).generate(prompts, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("fail_at", [1, 2, 4, 9])   # a first chunk, a later chunk, decode steps
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failure_in_the_middle_of_generate_leaves_a_clean_engine(qwen3_dir, reference, monkeypatch,
                                                                  fail_at, error):
    opts, prompts, expected = reference
    llm = LLM(qwen3_dir, **opts)
    real_run, calls = llm.model_runner.launch, []

    def flaky_run(batch, **kwargs):
        calls.append(batch)
        if len(calls) == fail_at:
            raise error("injected")
        return real_run(batch, **kwargs)

    monkeypatch.setattr(llm.model_runner, "launch", flaky_run)
    with pytest.raises(error, match="injected"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_clean(llm)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert_clean(llm)


def test_blocks_free_after_every_call(qwen3_dir, reference):
    opts, prompts, expected = reference
    llm = LLM(qwen3_dir, **opts)
    for _i in range(3):
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert_clean(llm)
        assert llm.scheduler.block_manager.hash_to_block_id   # cached blocks stay, but free
    # The cached blocks are reclaimable: prompts that need the whole cache still run.
    big = random_prompts(4, [256] * 4, seed=6)
    llm.generate(big, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert_clean(llm)


# ---- preemption storm ---------------------------------------------------------------------

def test_preemption_storm_gives_the_tokens_of_a_large_cache(qwen3_dir):
    # 6..16-token prompts + 8 outputs: most cross a block boundary while decoding
    prompts = random_prompts(200, [6 + i % 11 for i in range(200)], seed=7)
    for p in prompts[::3]:
        p[:4] = [9, 8, 7, 6]   # some shared prefixes too
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    big = LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=512)
    expected = tokens(big.generate(prompts, params, use_tqdm=False))

    small = LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=5)   # 80 tokens: about 3 requests
    preempted = []
    real_preempt = small.scheduler._preempt
    small.scheduler._preempt = lambda seq: preempted.append(seq.seq_id) or real_preempt(seq)
    assert tokens(small.generate(prompts, params, use_tqdm=False)) == expected
    assert len(preempted) > 50, "the cache was not small enough to force preemption"
    assert_clean(small)


# ---- soak ---------------------------------------------------------------------------------

def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def count_live_sequences() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is Sequence)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc (Linux)")
def test_soak_many_calls_memory_stays_flat(qwen3_dir):
    llm = LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=32)
    cuda = llm.model_runner.device.type == "cuda"
    params = SamplingParams(temperature=0, max_tokens=4)

    def call(i):
        prompts = random_prompts(3, [3 + i % 5, 20, 9], seed=i)   # new prompts: the prefix cache churns
        llm.generate(prompts, params, use_tqdm=False)
        assert_clean(llm)

    for i in range(10):   # warm-up: allocator pools, tokenizer and torch caches
        call(i)
    gc.collect()
    rss0 = rss_mb()
    cuda0 = torch.cuda.memory_allocated() if cuda else 0
    live_seqs = count_live_sequences()
    for i in range(10, 200):
        call(i)
    gc.collect()
    growth = rss_mb() - rss0
    assert growth < 30, f"RSS grew by {growth:.1f} MB over 190 generate calls"
    assert count_live_sequences() == live_seqs, "finished sequences are kept alive"
    if cuda:   # a little slack for buffers first made for a batch shape not seen in the warm-up
        assert torch.cuda.memory_allocated() - cuda0 < 1 << 20


# ---- shutdown -----------------------------------------------------------------------------

def test_shutdown_frees_the_weights_without_the_cycle_collector(qwen3_dir):
    # a layer and its parameters reference each other (their weight_loader): shutdown collects them
    # itself, so the memory comes back (on a GPU, before empty_cache) even with automatic
    # collection off, as some services run
    import weakref
    llm = LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=8)
    weight = weakref.ref(next(llm.model_runner.model.parameters()))
    gc.disable()
    try:
        llm.shutdown()
        assert weight() is None
    finally:
        gc.enable()


def test_shutdown_from_another_thread_ends_a_running_call_with_a_clear_error(qwen3_dir):
    import threading
    llm = LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=64, enforce_eager=True)
    runner, stepping, shut = llm.model_runner, threading.Event(), threading.Event()
    real_launch = runner.launch

    def launch(*args, **kwargs):   # the call is inside a step when shutdown() comes
        stepping.set()
        shut.wait(30)
        return real_launch(*args, **kwargs)
    runner.launch = launch
    outcome = []

    def run():   # chat: a serialised call (generate) inside another
        try:
            llm.chat([{"role": "user", "content": "w5 w6"}], GREEDY, use_tqdm=False,
                     chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
            outcome.append(None)
        except Exception as e:
            outcome.append(e)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert stepping.wait(30)
    llm.shutdown()   # does not wait for the call: it releases the model under it
    shut.set()
    thread.join(30)
    assert not thread.is_alive() and isinstance(outcome[0], RuntimeError), outcome
    assert "shut down (by another thread) during this call" in str(outcome[0])
    assert not isinstance(outcome[0].__cause__, RuntimeError)   # said once, with what failed under it
    with pytest.raises(RuntimeError, match="the engine was shut down: shut this engine down"):
        llm.generate([[5, 6]], GREEDY, use_tqdm=False)   # a later call: shut down before it began


# ---- start-up errors ----------------------------------------------------------------------

def test_missing_model_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_folder_without_config_json(tmp_path, qwen3_dir):
    folder = tmp_path / "no_config"
    shutil.copytree(qwen3_dir, folder)
    os.remove(folder / "config.json")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(str(folder))


def test_folder_without_weights(tmp_path, qwen3_dir):
    folder = tmp_path / "no_weights"
    folder.mkdir()
    shutil.copy(os.path.join(qwen3_dir, "config.json"), folder)
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        LLM(str(folder), num_kvcache_blocks=4)


def test_unknown_option_lists_the_valid_ones(qwen3_dir):
    with pytest.raises(TypeError,
                       match=r"unknown option 'gpu_mem'; valid options are: .*gpu_memory_utilization"):
        LLM(qwen3_dir, gpu_mem=0.5)


BAD_OPTIONS = [
    (dict(max_num_seqs=0), r"max_num_seqs must be an integer >= 1, got 0"),
    (dict(max_num_batched_tokens=2.5), r"max_num_batched_tokens must be an integer >= 1, got 2.5"),
    (dict(max_model_len="long"), r"max_model_len must be an integer >= 1, got 'long'"),
    (dict(kvcache_block_size=0), r"kvcache_block_size must be an integer >= 1"),
    (dict(num_kvcache_blocks=0), r"num_kvcache_blocks must be an integer >= 1"),
    (dict(kv_cache_memory_bytes=-1), r"kv_cache_memory_bytes must be an integer >= 1"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
    (dict(gpu_memory_utilization="0.5"), r"gpu_memory_utilization must be a number in \(0, 1\]"),
    (dict(device="tpu"), r"device must be one of \('auto', 'cuda', 'cpu'\), got 'tpu'"),
    (dict(dtype="int8"), r"dtype must be one of"),
    (dict(load_format="pt"), r"load_format must be one of"),
    (dict(enforce_eager="yes"), r"enforce_eager must be True or False, got 'yes'"),
    (dict(seed=-1), r"seed must be an integer >= 0, got -1"),
    (dict(tensor_parallel_size=0), r"tensor_parallel_size must be an integer >= 1"),
    (dict(tensor_parallel_size=3), r"tensor_parallel_size=3 does not divide the model's "
                                   r"num_attention_heads \(4\); sizes that divide num_attention_heads \(4\), "
                                   r"num_key_value_heads \(2\), intermediate_size \(128\): 1, 2$"),
]


@pytest.mark.parametrize("options,message", BAD_OPTIONS, ids=[next(iter(o)) for o, _ in BAD_OPTIONS])
def test_bad_option_values(qwen3_dir, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(qwen3_dir, **options)


@pytest.mark.parametrize("arch, overrides, name", [
    ("qwen3", {}, r"num_attention_heads \(4\)"),
    ("qwen3", {"num_attention_heads": 6, "num_key_value_heads": 2}, r"num_key_value_heads \(2\)"),
    ("qwen3", {"num_attention_heads": 3, "num_key_value_heads": 3, "intermediate_size": 128},
     r"intermediate_size \(128\)"),
    ("qwen3_moe", {"num_attention_heads": 3, "num_key_value_heads": 3}, r"moe_intermediate_size \(32\)"),
    # the dense layer (mlp_only_layers=[1]) of the MoE model splits intermediate_size too
    ("qwen3_moe", {"num_attention_heads": 3, "num_key_value_heads": 3, "moe_intermediate_size": 30},
     r"intermediate_size \(128\)")])
def test_tensor_parallel_size_must_divide_the_model_before_workers_start(qwen3_dir, arch, overrides, name):
    # refused by the config (no worker process is started), naming the size that does not divide
    from nanovllm.config import Config, _check_tp_divides
    from conftest import CONFIGS
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the model's " + name):
        _check_tp_divides(CONFIGS[arch](**overrides), 3)
    _check_tp_divides(CONFIGS[arch](**overrides), 1)
    if arch == "qwen3" and not overrides:
        with pytest.raises(ValueError, match=name):
            Config.create(qwen3_dir, tensor_parallel_size=3)


def test_tensor_parallel_error_lists_the_sizes_that_work():
    # the demo model's shapes (SmolLM2-135M: 9 heads, 3 KV heads): 2 fails, and 1 and 3 are named
    from nanovllm.config import _check_tp_divides
    from conftest import CONFIGS
    demo = CONFIGS["llama"](num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                            intermediate_size=1536)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the model's "
                                         r"num_attention_heads \(9\); .*intermediate_size \(1536\): 1, 3$"):
        _check_tp_divides(demo, 2)
    _check_tp_divides(demo, 3)


def test_kv_cache_too_small_says_what_to_raise(qwen3_dir):
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=100 is less than one KV block "
                                         r"\(8192 bytes per block of 16 tokens\): raise it"):
        LLM(qwen3_dir, kvcache_block_size=16, kv_cache_memory_bytes=100)


def test_broken_config_json(tmp_path, qwen3_dir):
    folder = tmp_path / "broken"
    shutil.copytree(qwen3_dir, folder)
    with open(folder / "config.json") as f:
        config = json.load(f)
    config["model_type"] = "no_such_model"
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="no_such_model"):
        LLM(str(folder))
