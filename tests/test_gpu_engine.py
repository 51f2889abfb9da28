"""The end-to-end scenarios on CUDA (fp32 exact argmax, bf16 within a tolerance) and CUDA-graph
replay against eager. Skipped without a GPU; run on the H200."""
import pytest
import torch

from conftest import HFOracle, random_prompts
from nanovllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# bf16 rounds the logits: accept a token within this much of the fp32 maximum.
ATOL = {"float32": 1e-3, "bfloat16": 0.3}


@pytest.fixture(scope="module")
def oracle(qwen3_dir):
    return HFOracle(qwen3_dir)


def scenarios():
    prefix = random_prompts(1, [64], seed=2)[0]
    return {
        "mixed": (dict(num_kvcache_blocks=128), [random_prompts(6, [1, 2, 17, 64, 150, 300], seed=1)]),
        "prefix_twice": (dict(num_kvcache_blocks=128),
                         [[prefix + t for t in random_prompts(3, [5, 20, 33], seed=3)] + [prefix]] * 2),
        "tiny_cache": (dict(num_kvcache_blocks=12), [random_prompts(6, [10, 20, 30, 12, 25, 7], seed=4)]),
        "chunked": (dict(num_kvcache_blocks=64, max_num_batched_tokens=64),
                    [random_prompts(3, [200, 90, 45], seed=5)]),
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["mixed", "prefix_twice", "tiny_cache", "chunked"])
def test_scenarios_on_gpu(qwen3_dir, oracle, name, dtype):
    options, runs = scenarios()[name]
    llm = LLM(qwen3_dir, device="cuda", dtype=dtype, kvcache_block_size=16, **options)
    exact = total = 0
    for prompts in runs:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            ids = out.outputs[0].token_ids
            assert len(ids) == 16
            oracle.assert_greedy(prompt, ids, atol=ATOL[dtype])
            logits = oracle.logits(prompt + ids)[len(prompt) - 1:-1]
            exact += int((logits.argmax(-1) == torch.tensor(ids)).sum())
            total += len(ids)
    assert exact / total >= (1.0 if dtype == "float32" else 0.9)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_replay_matches_eager(qwen3_dir, oracle, dtype):
    """fp32: the same tokens. bf16: a padded graph batch runs other GEMM tilings and attention
    splits than eager, so rounding differs and a near-tie may flip; both must stay argmax choices
    within the bf16 tolerance and agree on nearly all tokens."""
    prompts = random_prompts(20, [3 + 7 * i for i in range(20)], seed=7)
    runs = []
    for eager in (True, False):
        llm = LLM(qwen3_dir, device="cuda", dtype=dtype, kvcache_block_size=16, num_kvcache_blocks=256,
                  enforce_eager=eager, max_num_seqs=32)
        assert bool(llm.model_runner.graphs) != eager
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
    if dtype == "float32":
        assert runs[0] == runs[1]
        return
    same = sum(a == b for eager, graph in zip(*runs) for a, b in zip(eager, graph))
    assert same / sum(map(len, runs[0])) >= 0.9
    for prompt, ids in zip(prompts, runs[1]):
        oracle.assert_greedy(prompt, ids, atol=ATOL[dtype])


def test_bf16_default_dtype_and_block_256(qwen3_dir, oracle):
    llm = LLM(qwen3_dir, device="cuda", dtype="bfloat16")   # default block size 256, graphs on
    prompts = random_prompts(4, [300, 5, 270, 40], seed=8)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        oracle.assert_greedy(prompt, out.outputs[0].token_ids, atol=ATOL["bfloat16"])


def test_async_scheduling_matches_one_step_at_a_time(qwen3_dir):
    """With CUDA graphs the pending input tokens come from the device inside the graph; stop
    tokens end sequences while their next step is already launched."""
    prompts = random_prompts(12, [3 + 11 * i for i in range(12)], seed=9)
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=list(range(3, 40)))
    runs = []
    for run_ahead in (True, False):
        llm = LLM(qwen3_dir, device="cuda", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=256,
                  async_scheduling=run_ahead)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
    assert runs[0] == runs[1]
    assert any(reason == "stop" for _, reason in runs[0]) and any(reason == "length" for _, reason in runs[0])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_store_at_warm_up_starts_and_gives_the_same_tokens(qwen3_dir, kv_cache_dtype, monkeypatch):
    """attention.STORE_AT_WARM_UP: the warm-up forward stores into a dummy block at slot -1 (so the
    q/k kernel compiles the store-on variant there); the engine then runs as without it: the same
    kernels on the same batch, so the same greedy tokens."""
    from nanovllm.layers import attention
    prompts = random_prompts(3, [5, 40, 100], seed=11)
    tokens = {}
    for on in (False, True):
        monkeypatch.setattr(attention, "STORE_AT_WARM_UP", on)
        llm = LLM(qwen3_dir, device="cuda", dtype="bfloat16", kvcache_block_size=16, num_kvcache_blocks=64,
                  kv_cache_dtype=kv_cache_dtype)
        assert all(a.k_cache.shape[0] == 64 for a in llm.model_runner.attention_layers)   # its own cache
        tokens[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        llm.shutdown()
    assert tokens[True] == tokens[False]
