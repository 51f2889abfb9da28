"""Data-parallel replicas and the Ray Data building block on a local Ray cluster of 2 CPUs: two
single-CPU replicas of a tiny model give the tokens one engine gives, in prompt order, also when a
replica is killed mid-job; the Ray Data example writes every row. Without Ray only the pure parts run."""
import importlib.util
import json
import os
import signal
import sys
import threading
import time

import pytest

from conftest import REPO, random_prompts, tokens
from nanovllm import LLM, SamplingParams
from nanovllm.distributed.data_parallel import JobTiming
from nanovllm.utils.balance import assign_by_cost, request_cost

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE = dict(device="cpu", enforce_eager=True, kvcache_block_size=16, num_kvcache_blocks=64,
              max_num_seqs=16, max_num_batched_tokens=512)


# ---- without Ray ---------------------------------------------------------------------------

def test_assign_by_cost_balances_and_keeps_every_index():
    costs = [100, 90, 10, 10, 50, 40, 30, 5, 5, 1]
    shares = assign_by_cost(costs, 3)
    assert sorted(i for s in shares for i in s) == list(range(len(costs)))
    assert all(s == sorted(s) for s in shares)
    loads = [sum(costs[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= 10, loads
    assert assign_by_cost([5], 2) == [[0], []]


def test_the_split_balances_the_decode_steps_reads():
    """bench.py's workload: balancing prompt + max_tokens leaves one replica 5% more K/V to read
    (each output token reads its prompt and the outputs before it); request_cost, under 1%."""
    import bench
    prompts, params = bench.workload(256, 1024, 1024, 0.6)
    lens = [(len(p), sp.max_tokens) for p, sp in zip(prompts, params)]

    def reads(share):
        return sum(o * p + o * (o - 1) // 2 for p, o in (lens[i] for i in share))

    def imbalance(costs):
        a, b = (reads(s) for s in assign_by_cost(costs, 2))
        return max(a, b) / min(a, b) - 1

    assert imbalance([p + o for p, o in lens]) > 0.04
    assert imbalance([request_cost(p, o) for p, o in lens]) < 0.01
    assert request_cost(10, 1) == 20 and request_cost(10, 3) == 10 + 30 + 3


def test_bench_reports_each_replicas_share_time_and_limit(tmp_path):
    import argparse

    import bench
    from nanovllm.utils import roofline
    config = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=128, vocab_size=1000)
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = argparse.Namespace(model=str(tmp_path), tensor_parallel_size=1, kv_cache_dtype="auto")
    prompts = [[1] * 100, [1] * 10, [1] * 50]
    params = [SamplingParams(max_tokens=n) for n in (20, 500, 30)]
    job = JobTiming(wall_s=2.0, split_s=0.01, shares={0: [1], 1: [0, 2]}, engine_s={0: 1.5, 1: 1.2},
                    done_s={0: 1.9, 1: 1.3})
    dp = bench.data_parallel_replicas(job, prompts, params, args, roofline.H200)
    assert job.overhead_s == pytest.approx(0.5)
    assert dp["driver_overhead_s"] == 0.5
    assert [(r["prompts"], r["prompt_tokens"], r["output_tokens"]) for r in dp["replicas"]] == [
        (1, 10, 500), (2, 150, 50)]
    slow = 500 / roofline.workload_limit(config, [10], [500])   # replica 0: 500 steps of its one sequence
    assert dp["replicas"][0]["limit_s"] == round(slow, 3)
    args.model = str(tmp_path / "elsewhere")   # no config.json: no limits
    rows = bench.data_parallel_replicas(job, prompts, params, args, roofline.H200)["replicas"]
    assert "limit_s" not in rows[0]


def test_bad_data_parallel_size_is_a_value_error(qwen3_dir):
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="data_parallel_size"):
            LLM(qwen3_dir, data_parallel_size=bad, **ENGINE)


def test_without_ray_the_entry_points_name_the_extra(monkeypatch, qwen3_dir):
    monkeypatch.setitem(sys.modules, "ray", None)   # `import ray` now raises ImportError
    with pytest.raises(ImportError, match=r"nanovllm\[ray\]"):
        LLM(qwen3_dir, data_parallel_size=2, **ENGINE)
    from nanovllm.distributed.ray_data import NanoVLLMPredictor
    with pytest.raises(ImportError, match=r"nanovllm\[ray\]"):
        NanoVLLMPredictor(qwen3_dir)


def test_the_driver_reads_the_model_tokenizer_and_defaults_the_replicas_use(monkeypatch, qwen3_dir):
    # revision, tokenizer, tokenizer_mode and generation_config reach the driver's own reading (it
    # renders chats and fills in default sampling params), not only the replicas' engines
    pytest.importorskip("ray")
    from nanovllm.distributed import data_parallel as dp
    calls = []

    class Stop(Exception):
        pass

    def record(name, result):
        return lambda *args, **kw: calls.append((name, args, kw)) or result

    def stop(*args, **kw):
        raise Stop   # before any Ray work: only the driver's reading is under test
    from nanovllm.utils import loader
    monkeypatch.setattr(loader, "resolve_model", record("resolve", qwen3_dir))
    monkeypatch.setattr(dp, "load_tokenizer", record("tokenizer", None))
    monkeypatch.setattr(dp, "default_sampling_overrides", record("defaults", {}))
    monkeypatch.setattr(dp, "init_ray", stop)
    with pytest.raises(Stop):
        LLM("org/model", data_parallel_size=2, revision="v2", tokenizer="org/tok", tokenizer_mode="slow",
            generation_config="vllm", **ENGINE)
    assert calls == [("resolve", ("org/model", "v2"), {"cache_dir": None}),
                     ("resolve", ("org/tok", "v2"), {"weights": False, "cache_dir": None}),
                     ("tokenizer", (qwen3_dir, "slow"), {}), ("defaults", (qwen3_dir, "vllm"), {})]


# ---- on a local Ray cluster -------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    from nanovllm.distributed.ray_utils import init_ray
    assert init_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    """One engine's greedy tokens for 24 prompts of mixed lengths."""
    prompts = random_prompts(24, [5 + 3 * (i % 7) for i in range(24)], seed=3)
    llm = LLM(qwen3_dir, **ENGINE)
    return prompts, tokens(llm.generate(prompts, GREEDY, use_tqdm=False))


@pytest.fixture(scope="module")
def dp_llm(ray_session, qwen3_dir):
    llm = LLM(qwen3_dir, data_parallel_size=2, **ENGINE)
    yield llm
    llm.shutdown()


def test_two_replicas_give_one_engines_tokens_in_order(dp_llm, reference):
    prompts, expected = reference
    outs = dp_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outs) == expected
    assert [o.prompt_token_ids for o in outs] == prompts
    assert dp_llm.rerun_requests == 0 and len(dp_llm.live) == 2
    job = dp_llm.last_job   # where the time went: both replicas worked, inside the driver's wall time
    assert sorted(i for share in job.shares.values() for i in share) == list(range(len(prompts)))
    assert all(job.shares[r] for r in (0, 1))
    assert all(0 < job.engine_s[r] <= job.done_s[r] <= job.wall_s for r in (0, 1))
    assert 0 <= job.overhead_s < job.wall_s
    assert set(dp_llm.startup_seconds) == {"ray_init", "replicas", "engine"}
    assert 0 < dp_llm.startup_seconds["engine"] < dp_llm.startup_seconds["replicas"]


def test_strings_chat_and_errors(dp_llm, qwen3_dir):
    one = LLM(qwen3_dir, **ENGINE)
    texts = ["w5 w6 w7", "w9 " * 20, "w300"]
    outs = dp_llm.generate(texts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == texts
    assert tokens(outs) == tokens(one.generate(texts, GREEDY, use_tqdm=False))
    assert dp_llm.get_tokenizer() is not None
    assert vars(dp_llm.get_default_sampling_params()) == vars(one.get_default_sampling_params())
    with pytest.raises(ValueError, match="prompt 2: token id 9999"):   # the job's index, not the chunk's
        dp_llm.generate([[5, 6], [7, 8], [9999]], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="unknown option.*'bogus'"):
        LLM(qwen3_dir, data_parallel_size=2, bogus=1)
    from nanovllm import LoRARequest
    with pytest.raises(ValueError, match="enable_lora=True"):   # on the driver, before any replica
        dp_llm.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, "/nowhere"))
    # The replicas still work after a failed job.
    assert tokens(dp_llm.generate(texts[:1], GREEDY, use_tqdm=False)) == tokens(outs[:1])


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w4{% endif %}")
CONVERSATIONS = [[{"role": "user", "content": "w5 w6"}], [{"role": "user", "content": "w7 w8 w9"}]]


def test_chat_renders_on_the_driver_like_one_engine(dp_llm, qwen3_dir):
    one = LLM(qwen3_dir, **ENGINE)
    one.tokenizer.chat_template = dp_llm.get_tokenizer().chat_template = CHAT_TEMPLATE
    outs = dp_llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    expected = one.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == [o.prompt for o in expected] == ["w5 w6 w4", "w7 w8 w9 w4"]
    assert tokens(outs) == tokens(expected)


def test_predictor_reads_prompts_token_ids_or_messages(qwen3_dir):
    np = pytest.importorskip("numpy")
    pytest.importorskip("ray")
    from nanovllm.distributed.ray_data import NanoVLLMPredictor
    predictor = NanoVLLMPredictor(qwen3_dir, dict(temperature=0, max_tokens=3), **ENGINE)
    predictor.llm.tokenizer.chat_template = CHAT_TEMPLATE
    one = LLM(qwen3_dir, **ENGINE)
    greedy3 = SamplingParams(temperature=0, max_tokens=3)
    out = predictor({"prompt": np.array(["w5 w6", "w300"], dtype=object), "id": np.array([7, 8])})
    assert list(out["id"]) == [7, 8] and list(out["num_input_tokens"]) == [2, 1]
    expected = one.generate(["w5 w6", "w300"], greedy3, use_tqdm=False)
    assert list(out["generated_text"]) == [o.outputs[0].text for o in expected]
    ids = np.empty(1, dtype=object)
    ids[0] = np.array([5, 6, 7])
    assert list(predictor({"prompt": ids})["num_generated_tokens"]) == [3]
    messages = np.empty(2, dtype=object)
    messages[:] = [np.array(c, dtype=object) for c in CONVERSATIONS]
    out = predictor({"messages": messages})
    one.tokenizer.chat_template = CHAT_TEMPLATE
    expected = one.chat(CONVERSATIONS, greedy3, use_tqdm=False)
    assert list(out["generated_text"]) == [o.outputs[0].text for o in expected]
    assert set(out["finish_reason"]) <= {"stop", "length"}
    with pytest.raises(KeyError, match="neither a 'prompt' nor a 'messages'"):
        predictor({"text": np.array(["w5"], dtype=object)})


def test_a_replica_killed_mid_job_loses_no_prompt(ray_session, dp_llm, reference):
    """(The last test of dp_llm: it leaves no replica alive.)"""
    prompts, expected = reference
    llm = dp_llm
    llm.llm_engine.requests_per_call = 2   # many small calls, so the job is surely unfinished at the kill
    victim = llm.replica_pids[0]

    def kill_after_first_results():
        deadline = time.monotonic() + 60
        while llm.completed_requests < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(victim, signal.SIGKILL)

    killer = threading.Thread(target=kill_after_first_results, daemon=True)
    killer.start()
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    killer.join()
    assert tokens(outs) == expected
    assert llm.live == [1] and llm.rerun_requests > 0
    # With its last replica gone, a job is a clear error, not a hang.
    ray_session.kill(llm.replicas[1])
    with pytest.raises(RuntimeError, match="every data-parallel replica has died"):
        llm.generate(prompts[:4], GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="every data-parallel replica has died"):
        llm.generate(prompts[:4], GREEDY, use_tqdm=False)   # and the next job, at once


def test_ray_data_example_writes_every_row(ray_session, dp_llm, qwen3_dir, tmp_path):
    dp_llm.shutdown()   # gives its two CPUs back to the cluster for the Ray Data actors
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")   # Ray Data's blocks and the Parquet output
    spec = importlib.util.spec_from_file_location("ray_batch", REPO / "examples" / "ray_batch_inference.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rows = [{"id": i, "prompt": " ".join(f"w{3 + (i * 7 + k) % 500}" for k in range(1 + i % 9))}
            for i in range(300)]
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    example.run(str(src), str(tmp_path / "out"), qwen3_dir, max_tokens=4, concurrency=1, batch_size=64,
                engine_options=dict(ENGINE, num_kvcache_blocks=256, max_num_seqs=64))
    got = pd.read_parquet(tmp_path / "out").sort_values("id")
    assert list(got["id"]) == list(range(300))
    assert (got["num_generated_tokens"] > 0).all() and (got["num_generated_tokens"] <= 4).all()
    assert set(got["finish_reason"]) <= {"stop", "length"}
    assert list(got["num_input_tokens"]) == [1 + i % 9 for i in range(300)]
    one = LLM(qwen3_dir, **ENGINE)
    sample = [rows[i]["prompt"] for i in (0, 150, 299)]
    expected = [o.outputs[0].text for o in one.generate(sample, SamplingParams(temperature=0, max_tokens=4),
                                                        use_tqdm=False)]
    assert [got.iloc[i]["generated_text"] for i in (0, 150, 299)] == expected


def test_replicas_serve_lora_adapters_as_one_engine(ray_session, qwen3_dir, tmp_path):
    """(After the Ray Data test: dp_llm's CPUs are free.) Each replica loads the adapters of its
    prompts; the tokens are one LoRA engine's, a bad adapter is the replica's clear error and the
    replicas serve the next job."""
    pytest.importorskip("peft")
    from test_lora import ALL, make_adapter
    from nanovllm import LoRARequest
    a = LoRARequest("a", 1, make_adapter(qwen3_dir, str(tmp_path / "a"), 8, ALL, seed=1))
    b = LoRARequest("b", 2, make_adapter(qwen3_dir, str(tmp_path / "b"), 4, ["q_proj", "down_proj"], seed=2))
    prompts = random_prompts(8, [5, 9, 13, 7, 11, 6, 8, 10], seed=4)
    loras = [a, None, b, a, b, None, a, b]
    options = dict(ENGINE, enable_lora=True, max_loras=2, max_lora_rank=8)
    one = LLM(qwen3_dir, **options)
    expected = tokens(one.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    base = tokens(one.generate(prompts, GREEDY, use_tqdm=False))
    one.shutdown()
    assert all((got != want) == (lora is not None) for got, want, lora in zip(base, expected, loras))
    dp = LLM(qwen3_dir, data_parallel_size=2, **options)
    try:
        outs = dp.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        assert tokens(outs) == expected
        assert [o.lora_request for o in outs] == loras
        assert all(dp.last_job.shares[r] for r in (0, 1))
        with pytest.raises(FileNotFoundError, match="nowhere"):
            dp.generate(prompts[:2], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 3, "/nowhere"))
        assert tokens(dp.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=a)) == expected[:1]
    finally:
        dp.shutdown()
