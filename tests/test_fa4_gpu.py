"""FlashAttention-4 prefill (prefill_attention="flash_attn_4") on a GPU where it runs: its
prefill over the paged cache against the fp32 torch reference at Qwen3-0.6B's attention shapes
(16 query / 8 KV heads, head_dim 128), and the engine's greedy tokens against transformers with
CUDA graphs on. Skipped without CUDA, on GPUs older than Hopper, and without the package
(pip install 'nanovllm[flash]'; on the GPU machine: benchmarks/fa4_gpu.sh)."""
import pytest
import torch


def fa4_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    if torch.cuda.get_device_capability()[0] not in (9, 10, 11):
        return "needs Hopper (sm90) or sm100/sm110"
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as e:   # not installed, or a broken install
        return f"flash-attn-4 does not import: {type(e).__name__}: {e}"
    return None


pytestmark = pytest.mark.skipif(fa4_skip_reason() is not None, reason=str(fa4_skip_reason()))

if fa4_skip_reason() is None:
    from conftest import HFOracle, random_prompts
    from test_gpu_engine import ATOL, GREEDY, scenarios
    from test_kernels_gpu import BF16_TOL, SCALE, prefill_case

    from nanovllm import LLM
    from nanovllm.kernels import fa4_prefill
    from nanovllm.kernels.reference import prefill_attention_ref


@pytest.fixture
def fa4_only(monkeypatch):
    """Today's path may not run: a case FA4 should take must not fall back silently."""
    def no_fallback(*args):
        raise AssertionError("FA4's prefill fell back to today's path")
    monkeypatch.setattr(fa4_prefill, "prefill_attention", no_fallback)


def check_fa4(args):
    out = fa4_prefill.prefill_attention_fa4(*args, SCALE)
    ref_args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    ref = prefill_attention_ref(*ref_args, SCALE)
    assert out.shape == ref.shape and out.dtype == args[0].dtype
    torch.testing.assert_close(out.float(), ref, **BF16_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fa4_prefill_without_a_prefix_mixed_lengths(fa4_only, dtype):
    lens = [1, 17, 1024, 300, 4096]
    args = list(prefill_case(lens, lens, 256, dtype=dtype))
    args[-1] = None   # no block tables: the new K/V are all the keys
    check_fa4(args)


@pytest.mark.parametrize("block_size", [256, 16, 128])
def test_fa4_prefill_over_cached_prefixes_and_chunks(fa4_only, block_size):
    # a prefix hit of a few tokens, a chunk in the middle of a long prompt, a fresh prompt, a
    # one-token remainder of a fully cached prompt, a prefix ending mid-block
    check_fa4(prefill_case([5, 512, 100, 1, 37], [600, 2048, 100, 257, 300], block_size))


def test_fa4_prefill_long_chunk_after_a_long_prefix(fa4_only):
    check_fa4(prefill_case([4096, 2000], [8192, 2000], 256, seed=3))


def test_fa4_with_an_fp8_cache_reads_pages_through_todays_path(monkeypatch):
    """FA4 reads FP8 only on sm100 (with FP8 queries): a prefill over an FP8 cache falls back."""
    calls = []
    monkeypatch.setattr(fa4_prefill, "prefill_attention", lambda *a: calls.append(a) or "fallback")
    args = list(prefill_case([5, 40], [300, 40], 256))
    args[3], args[4] = args[3].to(torch.float8_e4m3fn), args[4].to(torch.float8_e4m3fn)
    assert fa4_prefill.prefill_attention_fa4(*args, SCALE) == "fallback" and len(calls) == 1


@pytest.fixture(scope="module")
def oracle(qwen3_dir):
    return HFOracle(qwen3_dir)


@pytest.mark.parametrize("name", ["mixed", "prefix_twice", "tiny_cache", "chunked"])
def test_fa4_scenarios_greedy_match_transformers(qwen3_dir, oracle, name):
    """The GPU scenarios (block 16, CUDA graphs on) with FA4 forced: prefix hits and chunks read
    the pages through FA4."""
    options, runs = scenarios()[name]
    llm = LLM(qwen3_dir, device="cuda", dtype="bfloat16", kvcache_block_size=16,
              prefill_attention="flash_attn_4", **options)
    assert llm.model_runner.prefill_attention.name == "flash_attn_4" and llm.model_runner.graphs
    exact = total = 0
    for prompts in runs:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            ids = out.outputs[0].token_ids
            assert len(ids) == 16
            oracle.assert_greedy(prompt, ids, atol=ATOL["bfloat16"])
            logits = oracle.logits(prompt + ids)[len(prompt) - 1:-1]
            exact += int((logits.argmax(-1) == torch.tensor(ids)).sum())
            total += len(ids)
    assert exact / total >= 0.9


def test_fa4_default_block_256_with_prefix_hits(qwen3_dir, oracle):
    llm = LLM(qwen3_dir, device="cuda", dtype="bfloat16", prefill_attention="flash_attn_4")
    prefix = random_prompts(1, [300], seed=11)[0]
    prompts = [prefix + p for p in random_prompts(3, [5, 270, 40], seed=12)]
    for _ in range(2):   # the second run hits the cached prefix blocks
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            oracle.assert_greedy(prompt, out.outputs[0].token_ids, atol=ATOL["bfloat16"])


def test_auto_picks_fa4_here(qwen3_dir):
    llm = LLM(qwen3_dir, device="cuda", dtype="bfloat16", num_kvcache_blocks=16, enforce_eager=True)
    assert llm.model_runner.prefill_attention.name == "flash_attn_4"
