"""bench.py's physical limit (docs/benchmarks.md): the figures the docs quote for its workload, and
the two regimes of a decode step (weights and K/V at copy bandwidth, or FLOPs at the bf16 peak)."""
import json
import os

import pytest

import bench

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
# hidden 64, 2 layers, 4 heads of 16, 2 KV heads, intermediate 128, vocab 1000
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, vocab_size=1000)
TINY_PARAMS = 2 * (64 * (4 + 2 * 2) * 16 + 4 * 16 * 64 + 3 * 64 * 128) + 1000 * 64


@pytest.mark.parametrize("model,tp,kv_bytes,expected", [
    ("qwen3-0.6b", 1, 2, 36_300), ("qwen3-0.6b", 1, 1, 64_500),
    ("qwen3-8b", 1, 2, 12_900), ("qwen3-8b", 2, 2, 25_800)])
def test_limits_of_the_default_workload(model, tp, kv_bytes, expected):
    with open(os.path.join(CONFIGS, model, "config.json")) as f:
        config = json.load(f)
    prompts, params = bench.workload(256, 1024, 1024, 0.6)
    limit = bench.h200_limit(config, [len(p) for p in prompts], [p.max_tokens for p in params], tp, kv_bytes)
    assert limit == pytest.approx(expected, rel=0.002)


def test_one_sequence_is_bound_by_reading_the_weights():
    # One token of prompt, 1000 output tokens: each step reads the bf16 weights and <= 1000 tokens of
    # K/V (2 layers x K, V x 2 heads x 16 x 2 bytes = 256 bytes each), far below the FLOP time.
    kv_per_token = 2 * 2 * 2 * 16 * 2
    reads = sum(2 * TINY_PARAMS + kv_per_token * (1 + step) for step in range(1000))
    prefill = (2 * (TINY_PARAMS - 64_000) + 2 * 64_000 + 4 * 2 * 4 * 16 / 2) / bench.H200_BF16_FLOP_PER_S
    expected = 1000 / (reads / bench.H200_COPY_BYTES_PER_S + prefill)
    assert bench.h200_limit(TINY, [1], [1000]) == pytest.approx(expected, rel=1e-9)
    assert bench.h200_limit(TINY, [1], [1000], tp=2) == pytest.approx(2 * expected, rel=1e-9)


def test_a_large_batch_is_bound_by_flops():
    # 100,000 sequences of one prompt token and one output token: a step's FLOPs (2 per weight per
    # sequence) take longer than reading the weights once.
    decode_flops = 2 * TINY_PARAMS * 100_000 + 4 * 2 * 4 * 16 * 100_000
    prefill_flops = 2 * TINY_PARAMS * 100_000 + 4 * 2 * 4 * 16 / 2 * 100_000
    expected = 100_000 / ((decode_flops + prefill_flops) / bench.H200_BF16_FLOP_PER_S)
    assert bench.h200_limit(TINY, [1] * 100_000, [1] * 100_000) == pytest.approx(expected, rel=1e-9)


def test_long_workload_is_prefill_heavy_and_leaves_the_default_alone():
    prompts, params = bench.long_workload(256, 0.6)
    lens = [len(p) for p in prompts]
    assert len(prompts) == 256 and min(lens) >= 4000 and max(lens) <= 8000
    assert {p.max_tokens for p in params} == {64} and all(p.ignore_eos for p in params)
    assert bench.long_workload(256, 0.6)[0] == prompts   # seeded
    _, default_params = bench.workload(256, 1024, 1024, 0.6)
    assert sum(p.max_tokens for p in default_params) == 133_966   # nano-vllm's workload, unchanged
