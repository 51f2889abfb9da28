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
from nanovllm.distributed.data_parallel import assign_by_cost

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


def test_strings_chat_and_errors(dp_llm, qwen3_dir):
    one = LLM(qwen3_dir, **ENGINE)
    texts = ["w5 w6 w7", "w9 " * 20, "w300"]
    outs = dp_llm.generate(texts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == texts
    assert tokens(outs) == tokens(one.generate(texts, GREEDY, use_tqdm=False))
    assert dp_llm.get_tokenizer() is not None
    with pytest.raises(ValueError, match="prompt 2: token id 9999"):   # the job's index, not the chunk's
        dp_llm.generate([[5, 6], [7, 8], [9999]], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="unknown option.*'bogus'"):
        LLM(qwen3_dir, data_parallel_size=2, bogus=1)
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
    llm.requests_per_call = 2   # many small calls, so the job is surely unfinished at the kill
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
