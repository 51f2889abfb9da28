"""The FP8 KV cache end to end on CPU (a tiny random Qwen3 against fp32 transformers): options,
the byte budget, greedy tokens within a stated tolerance, computed scales."""
import logging

import pytest
import torch
from conftest import HFOracle, random_prompts

from nanovllm import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# FP8 moves the logits a little (e4m3 keeps 3 mantissa bits of every K and V value), enough to
# flip this random model's near-ties (top-2 margins of 0.01-0.1 are common). Every greedy token must
# lie within FP8_ATOL logits of transformers' fp32 maximum, and at least FP8_EXACT of them must be
# its argmax. (Measured here: at most 0.11 off; 97-100% exact with scales 1.0, 86% computed.)
FP8_ATOL = 0.25
FP8_EXACT = 0.75


@pytest.fixture(scope="module")
def oracle(qwen3_dir):
    return HFOracle(qwen3_dir)


def check_close(oracle, prompts, outs):
    exact = total = 0
    for prompt, out in zip(prompts, outs):
        ids = list(out.outputs[0].token_ids)
        oracle.assert_greedy(prompt, ids, atol=FP8_ATOL)
        logits = oracle.logits(prompt + ids)[len(prompt) - 1:-1]
        exact += int((logits.argmax(-1) == torch.tensor(ids)).sum())
        total += len(ids)
    assert exact / total >= FP8_EXACT, f"{exact} of {total} tokens are transformers' argmax"


@pytest.mark.parametrize("options,message", [
    (dict(kv_cache_dtype="fp16"), "kv_cache_dtype must be one of"),
    (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype must be one of"),
    (dict(calculate_kv_scales=True), "also set kv_cache_dtype='fp8'"),
    (dict(kv_cache_dtype="fp8", calculate_kv_scales=1), "calculate_kv_scales must be True or False"),
])
def test_bad_options_are_refused(qwen3_dir, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(qwen3_dir, device="cpu", **options)


@pytest.mark.parametrize("dtype,ratio", [("float32", 4), ("bfloat16", 2)])
def test_the_budget_counts_bytes(qwen3_dir, caplog, dtype, ratio):
    """The same KV budget holds 4x (fp32 model) or 2x (bf16) the blocks in FP8; start-up logs them."""
    blocks = {}
    for kv_dtype in ("auto", "fp8_e4m3"):
        with caplog.at_level(logging.INFO, logger="nanovllm.engine.model_runner"):
            llm = LLM(qwen3_dir, device="cpu", dtype=dtype, kvcache_block_size=16,
                      kv_cache_memory_bytes=1 << 20, kv_cache_dtype=kv_dtype)
        runner = llm.model_runner
        blocks[kv_dtype] = runner.num_kvcache_blocks
        assert runner.kv_cache.dtype == (torch.float8_e4m3fn if kv_dtype != "auto" else getattr(torch, dtype))
        assert f"{blocks[kv_dtype]} blocks of 16 tokens = {16 * blocks[kv_dtype]} tokens" in caplog.text
    assert blocks["fp8_e4m3"] == ratio * blocks["auto"]


def test_fp8_greedy_tokens_are_close_to_transformers(qwen3_dir, oracle):
    """Mixed lengths, a cached prefix read back from FP8 pages in prefill, and chunked prefill."""
    llm = LLM(qwen3_dir, device="cpu", kvcache_block_size=16, num_kvcache_blocks=128, kv_cache_dtype="fp8",
              max_num_batched_tokens=128)
    assert torch.equal(llm.model_runner.kv_scales, torch.ones(2, 2, 1))   # 1.0 unless computed
    # Every layer's scales 16-byte aligned: Triton compiles one variant of each FP8 kernel, not two.
    for layer in llm.model_runner.attention_layers:
        assert layer.k_scale.shape == layer.v_scale.shape == (1,)
        assert layer.k_scale.data_ptr() % 16 == layer.v_scale.data_ptr() % 16 == 0
    prefix = random_prompts(1, [64], seed=2)[0]
    runs = [random_prompts(5, [1, 17, 64, 150, 300], seed=1),                      # 300 > 128: chunked
            [prefix + tail for tail in random_prompts(3, [5, 20, 33], seed=3)] + [prefix]]
    for prompts in runs + runs[1:]:   # the prefix prompts twice: the second run hits the prefix cache
        check_close(oracle, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))
    assert llm.scheduler.block_manager.hash_to_block_id   # prefix blocks were cached


def test_calculated_scales_come_from_the_first_prefill(qwen3_dir, oracle):
    llm = LLM(qwen3_dir, device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, kv_cache_dtype="fp8",
              calculate_kv_scales=True)
    runner = llm.model_runner
    prompts = random_prompts(3, [40, 7, 90], seed=4)
    check_close(oracle, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))
    scales = runner.kv_scales.clone()
    # vLLM's rule: the largest |K| becomes 200 and |V| 100. Recompute |V|'s amax of layer 0 from the
    # model's own qkv projection on the same first prefill.
    attn = runner.attention_layers[0]
    assert not attn.calculate_kv_scales and (scales != 1).all() and (scales > 0).all()
    model = runner.model.model
    ids = torch.tensor([t for p in prompts for t in p])
    layer = model.layers[0]
    hidden = layer.input_layernorm(model.embed_tokens(ids))
    v = layer.self_attn.qkv_proj(hidden)[:, -attn.num_kv_heads * attn.head_dim:]
    torch.testing.assert_close(scales[1, 0], v.abs().amax().reshape(1) / 100)
    llm.generate(random_prompts(2, [50, 60], seed=5), GREEDY, use_tqdm=False)
    assert torch.equal(runner.kv_scales, scales)   # computed once


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_on_gpu_graphs_and_eager(qwen3_dir, oracle, dtype):
    """On CUDA: the Triton kernels on an FP8 cache, scales computed at the first prefill, after
    the decode graphs were captured (they read the scales on the device). Graph replay and eager
    agree on nearly every token (a padded graph batch may split the context otherwise, which can
    flip a near-tie), and every token is within the FP8 tolerance (bf16: plus bf16's own 0.3)."""
    prompts = random_prompts(20, [3 + 7 * i for i in range(20)], seed=7)
    runs = []
    for eager in (True, False):
        llm = LLM(qwen3_dir, device="cuda", dtype=dtype, kvcache_block_size=16, num_kvcache_blocks=256,
                  enforce_eager=eager, max_num_seqs=32, kv_cache_dtype="fp8", calculate_kv_scales=True)
        assert bool(llm.model_runner.graphs) != eager
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert (llm.model_runner.kv_scales != 1).all()
        runs.append([list(o.outputs[0].token_ids) for o in outs])
        for prompt, ids in zip(prompts, runs[-1]):
            oracle.assert_greedy(prompt, ids, atol=FP8_ATOL + (0.3 if dtype == "bfloat16" else 0.0))
    same = sum(a == b for eager, graph in zip(*runs) for a, b in zip(eager, graph))
    # bf16 outputs round the splits' merged sums, so a different split count flips more near-ties
    # (measured: 214 of 240 tokens equal with the 64-token FP8 tiles, whose split counts go higher).
    assert same / sum(map(len, runs[0])) >= (0.9 if dtype == "float32" else 0.85)
