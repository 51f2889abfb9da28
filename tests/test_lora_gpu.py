"""LoRA on CUDA: the batched Triton kernels, unfolded and folded, at Qwen3-0.6B shapes against the
torch reference (also replayed in a CUDA graph after the slots change), and a batch mixing the base
model and two adapters of different ranks on the engine (CUDA graphs on and off) against PEFT's
argmax. Run on the H200."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

pytest.importorskip("peft")

from conftest import random_prompts  # noqa: E402
from nanovllm import LLM  # noqa: E402
from nanovllm.kernels.lora import LoRABatch, expand_folded_triton, lora_reference, lora_triton  # noqa: E402
from test_lora import GREEDY, adapters, mixed, model_dir, oracles  # noqa: E402,F401

ATOL = {"float32": 1e-3, "bfloat16": 0.3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n,rank,tokens", [(1024, 4096, 48, 256), (1024, 6144, 32, 7),
                                             (3072, 1024, 16, 512), (2048, 1024, 16, 4000)])
def test_lora_kernels_at_0_6b_shapes(dtype, k, n, rank, tokens):
    g = torch.Generator(device="cuda").manual_seed(0)
    num_slots = 4
    a = (torch.randn(num_slots, rank, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
    b = (torch.randn(n, num_slots, rank, device="cuda", generator=g) / rank ** 0.5).to(dtype)
    x = torch.randn(tokens, k, device="cuda", generator=g).to(dtype)
    y = torch.randn(tokens, n, device="cuda", generator=g).to(dtype)
    slots = torch.randint(-1, num_slots, (tokens,), device="cuda", generator=g, dtype=torch.int32)
    want = lora_reference(x.float(), y.float(), a.float(), b.float(), slots)
    got = lora_triton(x, y.clone(), a, b, LoRABatch.of(slots, num_slots))
    tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    base = slots < 0
    assert torch.equal(got[base], y[base])   # base-model tokens untouched
    # folded: y's GEMM and every slot's A x in one ([W; A]), then the expand, alone or into a residual
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
    yf = x @ torch.cat([w, a.reshape(-1, k)]).t()
    want = lora_reference(x.float(), (x @ w.t()).float(), a.float(), b.float(), slots)
    batch = LoRABatch.of(slots, num_slots)
    torch.testing.assert_close(expand_folded_triton(yf, b, batch).float(), want, **tol)
    got = expand_folded_triton(yf, b, batch, y.clone())
    torch.testing.assert_close(got.float(), want + y.float(), **tol)


def test_lora_kernels_replay_in_a_cuda_graph_with_new_slots():
    g = torch.Generator(device="cuda").manual_seed(1)
    # scaled as trained adapters are (outputs of order 1): unscaled, bf16's rounding of the rank-32
    # intermediate alone passes any absolute tolerance that would still catch a wrong slot
    a = (torch.randn(4, 32, 1024, device="cuda", generator=g) / 32).bfloat16()
    b = (torch.randn(2048, 4, 32, device="cuda", generator=g) / 32 ** 0.5).bfloat16()
    x = torch.randn(64, 1024, device="cuda", generator=g).bfloat16()
    y0 = torch.randn(64, 2048, device="cuda", generator=g).bfloat16()
    slots = torch.full((64,), -1, dtype=torch.int32, device="cuda")
    y = y0.clone()

    w = (torch.randn(2048, 1024, device="cuda", generator=g) / 32).bfloat16()
    wa = torch.cat([w, a.reshape(-1, 1024)])
    folded = torch.empty_like(y0)

    def step():
        y.copy_(y0)
        batch = LoRABatch.of(slots, 4)
        lora_triton(x, y, a, b, batch)
        folded.copy_(expand_folded_triton(x @ wa.t(), b, batch))
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        g.manual_seed(seed)
        slots.copy_(torch.randint(-1, 4, (64,), device="cuda", generator=g, dtype=torch.int32))
        graph.replay()
        want = lora_reference(x.float(), y0.float(), a.float(), b.float(), slots)
        torch.testing.assert_close(y.float(), want, atol=5e-2, rtol=2e-2)
        want = lora_reference(x.float(), (x @ w.t()).float(), a.float(), b.float(), slots)
        torch.testing.assert_close(folded.float(), want, atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("eager", [False, True])
def test_a_mixed_batch_on_the_gpu_is_peft_s_argmax(model_dir, adapters, oracles, dtype, eager):  # noqa: F811
    llm = LLM(model_dir, device="cuda", dtype=dtype, kvcache_block_size=16, num_kvcache_blocks=64,
              enforce_eager=eager, max_num_seqs=16, enable_lora=True, max_loras=2)
    try:
        prompts, loras = mixed(adapters)
        prompts += random_prompts(3, [40, 5, 70], seed=8)
        loras += [adapters[0], None, adapters[1]]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        exact = total = 0
        for p, lora, out in zip(prompts, loras, outs):
            ids = out.outputs[0].token_ids
            oracle = oracles[lora and lora.lora_int_id]
            oracle.assert_greedy(p, ids, atol=ATOL[dtype])
            with torch.no_grad():
                logits = oracle.model(input_ids=torch.tensor([p + ids])).logits[0, len(p) - 1:-1]
            exact += int((logits.argmax(-1) == torch.tensor(ids)).sum())
            total += len(ids)
        assert exact / total >= (1.0 if dtype == "float32" else 0.9)
        # one slot: the scheduler splits the adapters over steps, evicting to the host
        if not eager:
            one = LLM(model_dir, device="cuda", dtype=dtype, kvcache_block_size=16, num_kvcache_blocks=64,
                      max_num_seqs=16, enable_lora=True, max_loras=1)
            try:
                again = one.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
                for p, lora, out in zip(prompts, loras, again):
                    oracles[lora and lora.lora_int_id].assert_greedy(p, out.outputs[0].token_ids,
                                                                     atol=ATOL[dtype])
            finally:
                one.shutdown()
    finally:
        llm.shutdown()
