"""The engine end to end on CPU with every Triton kernel a GPU run uses (paged decode attention, the
fused q/k norm + rotary + KV store, RMSNorm with and without the residual add, SiLU-and-mul) run by
Triton's interpreter: the kernels' wiring into the layers and the runner (shapes, strides, slots,
chunked prefill) is checked in CI, where there is no GPU. Prefill attention stays the torch
reference (torch's flash op is CUDA-only)."""
import pytest

from conftest import HFOracle, interp, random_prompts, run_interpreted_tests
from nanovllm import LLM, SamplingParams

INTERPRETED_ENV = {"NANOVLLM_KERNELS": "triton"}   # conftest runs this file's interp tests with it


def test_engine_with_interpreted_kernels():
    run_interpreted_tests(__file__, **INTERPRETED_ENV)


@interp
@pytest.mark.parametrize("dtype,atol,fold", [("float32", 1e-3, True), ("bfloat16", 0.3, True),
                                             ("float32", 1e-3, False)])
def test_interp_greedy_tokens_are_transformers_argmax(qwen3_dir, monkeypatch, dtype, atol, fold):
    # fold: the layers' RMSNorm weights folded into their GEMMs (models.llama.FOLD_NORMS): no RMSNorm
    # with a residual add runs then, the q/k and SiLU-and-mul kernels apply rstd instead.
    from nanovllm.kernels import backend
    from nanovllm.models import llama
    assert backend.KERNELS == "triton"
    monkeypatch.setattr(llama, "FOLD_NORMS", fold)
    monkeypatch.setattr(backend, "_fast", lambda t: True)   # CPU tensors take the Triton kernels
    calls = []
    for name in ("paged_decode_attention_triton", "qk_norm_rope_store_triton", "rms_norm_triton",
                 "add_rms_norm_triton", "silu_and_mul_triton"):
        kernel = getattr(backend, name)
        monkeypatch.setattr(backend, name, lambda *a, k=kernel, n=name, **kw: calls.append(n) or k(*a, **kw))
    # A 40-token prompt with 32-token steps: a chunked prefill reads its first chunk from the pages.
    prompts = random_prompts(3, [5, 17, 40], seed=1)
    llm = LLM(qwen3_dir, device="cpu", dtype=dtype, kvcache_block_size=16, num_kvcache_blocks=32,
              max_num_batched_tokens=32)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert set(calls) == {"paged_decode_attention_triton", "qk_norm_rope_store_triton", "rms_norm_triton",
                          "silu_and_mul_triton"} | (set() if fold else {"add_rms_norm_triton"})
    oracle = HFOracle(qwen3_dir)
    for prompt, out in zip(prompts, outs):
        assert len(out.outputs[0].token_ids) == 6
        oracle.assert_greedy(prompt, out.outputs[0].token_ids, atol=atol)
