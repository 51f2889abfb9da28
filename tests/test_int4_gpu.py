"""The W4A16 / W8A16 Triton GEMM compiled on CUDA at Qwen3-8B shapes against the torch reference
(kernels/wna16_reference.py), also inside a CUDA graph, and integer checkpoints end to end in bf16
with CUDA graphs (dense layers through the GEMM at decode sizes, the experts dequantized into the
fused MoE kernel)."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from conftest import HFOracle, make_model, random_prompts  # noqa: E402
from test_int4_kernels import check_gemm, random_packed  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,bits,group,act_order", [
    (1, 4096, 4096, 4, 128, False), (16, 6144, 4096, 4, 128, True), (64, 4096, 12288, 4, 128, False),
    (7, 1024, 4096, 8, None, False), (33, 4096, 4096, 4, 32, False)])
def test_wna16_gemm_matches_the_reference(m, n, k, bits, group, act_order, dtype):
    out, ref = check_gemm(m, n, k, bits, group, act_order, dtype=dtype, device="cuda")
    # the same dequantized W in dtype, an fp32 sum in another order: a few ulps of dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_wna16_gemm_in_a_cuda_graph():
    from nanovllm.kernels.wna16_gemm import wna16_linear
    q, s, z = (t.cuda() for t in random_packed(2048, 1024, 4, 128, False, 0)[:3])
    g = None
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    eager = wna16_linear(x, q, s, z, g, 4, 128)
    wna16_linear(x, q, s, z, g, 4, 128)   # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = wna16_linear(x, q, s, z, g, 4, 128)
    graph.replay()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("arch,fmt", [("qwen3", "gptq"), ("llama", "awq"), ("qwen3_moe", "gptq-act-order"),
                                      ("qwen3", "compressed-tensors-8bit")])
def test_int_checkpoint_end_to_end_in_bf16(tmp_path, arch, fmt):
    """bf16 activations and dequantized weights rounded to bf16: each greedy token within 0.75 logits
    of transformers' maximum on the dequantized model (fp32), as test_fp8_gpu allows."""
    from test_int4 import MOE_SHAPES, SHAPES, save_quantized

    from nanovllm import LLM, SamplingParams
    src = make_model(str(tmp_path / "src"), arch, **(MOE_SHAPES if arch == "qwen3_moe" else SHAPES))
    path = save_quantized(src, str(tmp_path / fmt), fmt)
    llm = LLM(path, device="cuda", dtype="bfloat16", kvcache_block_size=16, num_kvcache_blocks=64,
              gpu_memory_utilization=0.3)
    assert llm.model_runner.graphs is not None
    oracle = HFOracle(path + "-dequantized")
    prompts = random_prompts(4, [1, 9, 17, 40], seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    try:
        for prompt, out in zip(prompts, llm.generate(prompts, greedy, use_tqdm=False)):
            oracle.assert_greedy(prompt, out.outputs[0].token_ids, atol=0.75)
    finally:
        llm.shutdown()
