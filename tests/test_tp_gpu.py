"""Tensor parallelism on CUDA (NCCL): TP=2 (and 4, 8 where the GPUs exist) gives TP=1's greedy
tokens in fp32, with CUDA graphs and eager; bf16 within a tolerance of transformers' logits; two
engines at once; nothing left after shutdown. Skipped without enough GPUs; run on the H200s."""
import multiprocessing
import os

import pytest
import torch

from conftest import HFOracle, make_model, random_prompts
from nanovllm import LLM, SamplingParams

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 CUDA GPUs")

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = random_prompts(8, [1, 5, 17, 33, 64, 150, 300, 40], seed=11)
OPTIONS = dict(device="cuda", kvcache_block_size=16, num_kvcache_blocks=96, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def model_8_heads(tmp_path_factory):
    """8 heads and 8 KV heads divide by 2, 4 and 8."""
    return make_model(str(tmp_path_factory.mktemp("qwen3_8h")), "qwen3", num_attention_heads=8,
                      num_key_value_heads=8, head_dim=8)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def run(path: str, tp: int, **options) -> list[list[int]]:
    llm = LLM(path, tensor_parallel_size=tp, **{**OPTIONS, **options})
    try:
        return tokens(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("eager", [True, False])
def test_fp32_tp_matches_tp1(model_8_heads, tp, eager):
    if tp > NUM_GPUS:
        pytest.skip(f"needs {tp} GPUs")
    expected = run(model_8_heads, 1, dtype="float32", enforce_eager=eager)
    assert run(model_8_heads, tp, dtype="float32", enforce_eager=eager) == expected


def test_bf16_tp2_within_tolerance(qwen3_dir):
    oracle = HFOracle(qwen3_dir)
    for prompt, ids in zip(PROMPTS, run(qwen3_dir, 2, dtype="bfloat16")):
        oracle.assert_greedy(prompt, ids, atol=0.3)


def test_two_tp2_engines_and_clean_shutdown(qwen3_dir, model_8_heads):
    expected = [run(p, 1, dtype="float32") for p in (qwen3_dir, model_8_heads)]
    engines = [LLM(p, tensor_parallel_size=2, dtype="float32", **OPTIONS) for p in (qwen3_dir, model_8_heads)]
    for _ in range(2):
        assert [tokens(e) for e in engines] == expected
    pids = [pid for e in engines for pid in e.workers.pids]
    names = [e.workers.channel.name for e in engines]
    for e in engines:
        e.shutdown()
    assert not any(p.pid in pids for p in multiprocessing.active_children())
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)
