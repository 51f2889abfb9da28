"""Qwen3-MoE against transformers on tiny random models (8 experts, top 2, dense layers among sparse
ones): the router and experts against transformers' sparse block, the layer pattern, greedy tokens as
argmax choices of transformers' logits (batch, prefix cache, preemption, chunked prefill, TP=2 on
CPU), the loader's per-expert names, and the Triton kernels under the interpreter."""
import os

import pytest
import torch
from conftest import (CONFIGS, HFOracle, edit_checkpoint, interp, make_model, random_prompts,
                      randomize_tensors, run_interpreted_tests)

from nanovllm import LLM, SamplingParams
from nanovllm.kernels.moe_reference import fused_moe_ref, select_experts
from nanovllm.layers.fused_moe import SparseMoeBlock
from nanovllm.models.llama import LlamaMLP

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# 9 blocks of 16 tokens and 48-token steps: long prompts are prefilled in chunks and decoding preempts
SMALL = dict(kvcache_block_size=16, num_kvcache_blocks=9, max_num_batched_tokens=48, max_num_seqs=4)
VARIANTS = {
    "moe": {},   # layer 1 dense (mlp_only_layers), top-k renormalised
    "moe-step2": dict(decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False),   # layer 1 sparse
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def moe(request, tmp_path_factory):
    path = make_model(str(tmp_path_factory.mktemp(request.param)), "qwen3_moe", **VARIANTS[request.param])
    # the layers' RMSNorm weights away from 1: the dense layers fold theirs into their GEMMs
    g = torch.Generator().manual_seed(5)
    randomize_tensors(path, "layernorm.weight", lambda shape: torch.rand(shape, generator=g) + 0.5)
    return path, HFOracle(path)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("moe_tp")), "qwen3_moe", tokenizer=False)


# ---- layers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_sparse_block_matches_transformers(norm_topk_prob):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    config = CONFIGS["qwen3_moe"](norm_topk_prob=norm_topk_prob)
    torch.manual_seed(0)
    hf = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = SparseMoeBlock(config)
    ours.gate.weight.data.copy_(hf.gate.weight)
    inter = config.moe_intermediate_size
    for e in range(config.num_experts):   # transformers keeps the experts stacked too (gate rows, then up)
        gate_up = hf.experts.gate_up_proj[e].detach()
        ours.experts.w13.weight_loader(ours.experts.w13, gate_up[:inter], (e, 0))
        ours.experts.w13.weight_loader(ours.experts.w13, gate_up[inter:], (e, 1))
        ours.experts.w2.weight_loader(ours.experts.w2, hf.experts.down_proj[e].detach(), (e, 0))
    x = torch.randn(2, 11, config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(ours(x.view(-1, config.hidden_size)), hf(x).view(-1, config.hidden_size),
                                   atol=1e-5, rtol=1e-5)


def test_select_experts_picks_top_k_and_renormalises():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.0]])
    weights, ids = select_experts(logits, 2, renormalize=False)
    probs = logits.softmax(-1)
    assert ids.tolist() == [[1, 3], [0, 3]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))


def test_fused_moe_ref_is_the_weighted_sum_of_experts():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=g)
    w13, w2 = torch.randn(4, 12, 8, generator=g), torch.randn(4, 8, 6, generator=g)
    weights, ids = torch.rand(5, 2, generator=g), torch.tensor([[0, 3], [3, 1], [1, 0], [2, 3], [3, 0]])
    out = fused_moe_ref(x, w13, w2, weights, ids)
    for t in range(5):
        silu = torch.nn.functional.silu
        want = sum(weights[t, k] * (w2[e] @ (silu(w13[e, :6] @ x[t]) * (w13[e, 6:] @ x[t])))
                   for k, e in enumerate(ids[t].tolist()))
        torch.testing.assert_close(out[t], want)


def test_layer_pattern_follows_the_config(moe):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    path, oracle = moe
    llm = LLM(path, num_kvcache_blocks=4, kvcache_block_size=16)   # kept: a deleted engine frees its model
    model = llm.model_runner.model
    theirs = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in oracle.model.model.layers]
    ours = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert ours == theirs and True in ours and False in ours
    dense = [layer.mlp for layer, sparse in zip(model.model.layers, ours) if not sparse]
    assert all(isinstance(mlp, LlamaMLP) for mlp in dense)
    # the dense layers fold their RMSNorm weights into their GEMMs, the sparse ones keep the norms;
    # the end-to-end tests below run that mix against transformers
    assert [layer.folded for layer in model.model.layers] == [not sparse for sparse in ours]


# ---- end to end against transformers -----------------------------------------------------------

def test_batch_and_prefix_cache_match_transformers(moe):
    path, oracle = moe
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=64)
    prompts = random_prompts(5, [1, 7, 16, 17, 45], seed=3)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        oracle.assert_greedy(prompt, out.outputs[0].token_ids)
    shared = prompts[4][:40]
    again = [shared + [5, 6, 7], shared[:33]]
    hits_before = llm.scheduler.block_manager.num_free_blocks
    for prompt, out in zip(again, llm.generate(again, GREEDY, use_tqdm=False)):
        oracle.assert_greedy(prompt, out.outputs[0].token_ids)
    assert hits_before == llm.scheduler.block_manager.num_free_blocks


def test_prefix_cache_is_hit(moe):
    path, oracle = moe
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=64)
    shared = random_prompts(1, [40], seed=7)[0]
    llm.generate([shared], GREEDY, use_tqdm=False)   # fills and registers two full blocks
    computed, launch = [], llm.model_runner.launch

    def recording(batch, **kwargs):
        if batch.is_prefill:
            computed.extend(batch.num_new_tokens)
        return launch(batch, **kwargs)
    llm.model_runner.launch = recording
    prompts = [shared + [5, 6, 7], shared]
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        oracle.assert_greedy(prompt, out.outputs[0].token_ids)
    assert sum(computed) <= sum(len(p) for p in prompts) - 2 * 32


def test_preemption_and_chunked_prefill_match_transformers(moe):
    path, oracle = moe
    llm = LLM(path, **SMALL)
    preempted, preempt = [], llm.scheduler._preempt
    llm.scheduler._preempt = lambda seq: (preempted.append(seq.seq_id), preempt(seq))[1]
    prompts = random_prompts(4, [5, 17, 33, 40], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        oracle.assert_greedy(prompt, out.outputs[0].token_ids)
    assert preempted, "the small cache should have forced a preemption"


def test_tp2_matches_transformers_and_tp1(moe_dir):
    prompts = random_prompts(4, [5, 17, 33, 40], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tp1 = LLM(moe_dir, **SMALL)
    expected = [o.outputs[0].token_ids for o in tp1.generate(prompts, params, use_tqdm=False)]
    llm = LLM(moe_dir, tensor_parallel_size=2, **SMALL)
    try:
        experts = llm.model_runner.model.model.layers[0].mlp.experts
        assert experts.w13.shape == (8, 32, 64) and experts.w2.shape == (8, 64, 16)   # half of 32 per rank
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == expected
    oracle = HFOracle(moe_dir)
    for prompt, ids in zip(prompts, got):
        oracle.assert_greedy(prompt, ids)


# ---- the workload's limit (nanovllm/utils/roofline.py) ------------------------------------------

def test_limit_reads_only_the_touched_experts():
    from nanovllm.utils.roofline import H200, workload_limit
    # one sequence: each decode step touches exactly top_k experts of each MoE layer
    config = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=128, vocab_size=1000, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, mlp_only_layers=[1])
    attn, router, expert = 64 * (4 + 2 * 2) * 16 + 4 * 16 * 64, 8 * 64, 3 * 64 * 32
    body = 3 * attn + 3 * 64 * 128 + 2 * router   # layer 1 dense, layers 0 and 2 with experts
    active, lm_head = body + 2 * 2 * expert, 1000 * 64
    kv_per_token = 3 * 2 * 2 * 16 * 2
    reads = sum(2 * (body + lm_head + 2 * 2 * expert) + kv_per_token * (1 + step) for step in range(1000))
    prefill = (2 * active + 2 * lm_head + 4 * 3 * 4 * 16 / 2) / H200.bf16_flop_per_s
    expected = 1000 / (reads / H200.copy_bytes_per_s + prefill)
    assert workload_limit(config, [1], [1000]) == pytest.approx(expected, rel=1e-9)


def test_limit_of_qwen3_30b_a3b():
    """docs/moe.md's figures: at batch 256 every step reads all 128 experts of all 48 layers."""
    import json

    from nanovllm.utils.roofline import default_workload_lens, workload_limit
    with open(os.path.join(os.path.dirname(__file__), "..", "configs", "qwen3-30b-a3b", "config.json")) as f:
        config = json.load(f)
    lens, outs = default_workload_lens()
    assert workload_limit(config, lens, outs) == pytest.approx(7_673, rel=0.002)
    assert workload_limit(config, lens, outs, tp=2) == pytest.approx(15_346, rel=0.002)


# ---- the loader --------------------------------------------------------------------------------

def test_loader_names_a_missing_expert_tensor(tmp_path):
    path = make_model(str(tmp_path), "qwen3_moe", tokenizer=False)
    edit_checkpoint(path, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    missing = r"no tensor for: model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight$"
    with pytest.raises(ValueError, match=missing):
        LLM(path, num_kvcache_blocks=4, kvcache_block_size=16)


def test_loader_refuses_an_expert_past_num_experts(tmp_path):
    path = make_model(str(tmp_path), "qwen3_moe", tokenizer=False)
    name = "model.layers.0.mlp.experts.8.gate_proj.weight"   # experts 0-7
    edit_checkpoint(path, lambda t: t.update({name: torch.zeros(32, 64)}))
    with pytest.raises(ValueError, match=rf"{name}.*expert 8 is past the config's num_experts \(8\)"):
        LLM(path, num_kvcache_blocks=4, kvcache_block_size=16)


def test_loader_refuses_a_misshapen_expert_tensor(tmp_path):
    path = make_model(str(tmp_path), "qwen3_moe", tokenizer=False)
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    edit_checkpoint(path, lambda t: t.update({name: torch.zeros(64, 31)}))
    with pytest.raises(ValueError, match=rf"{name}.*shape"):
        LLM(path, num_kvcache_blocks=4, kvcache_block_size=16)


# ---- the Triton kernels under the interpreter (fp32: tl.dot on bf16 is wrong there) ----------

def test_tile_choice_and_block_bound():
    from nanovllm.kernels import fused_moe as fm
    from nanovllm.kernels.moe_routing import max_blocks
    assert fm.choose_tiles(256 * 8, 128).block_m == fm.DECODE_BLOCK_M
    assert fm.choose_tiles(16384 * 8, 128).block_m == fm.PREFILL_BLOCK_M
    # FP8 experts' K slices: never across two scale groups
    assert fm.choose_tiles(16384 * 8, 128, fp8_group=2048).block_k == fm.PREFILL_BLOCK_K_FP8
    assert fm.choose_tiles(16384 * 8, 128, fp8_group=32).block_k == 32
    g = torch.Generator().manual_seed(0)
    for num_pairs, experts, block_m in [(1, 128, 16), (16, 8, 16), (2048, 128, 16), (999, 64, 64)]:
        counts = torch.bincount(torch.randint(0, experts, (num_pairs,), generator=g), minlength=experts)
        needed = int(((counts + block_m - 1) // block_m).sum())
        assert needed <= max_blocks(num_pairs, experts, block_m)


def test_triton_moe_under_interpreter():
    run_interpreted_tests(__file__)


@interp
@pytest.mark.parametrize("one_program", [False, True], ids=["three-kernels", "one-program"])
@pytest.mark.parametrize("num_tokens,experts,top_k", [(1, 8, 2), (13, 8, 2), (40, 4, 3), (9, 6, 2)])
def test_interp_align_by_expert_groups_every_pair_once(num_tokens, experts, top_k, one_program, monkeypatch):
    """one_program: moe_routing.ONE_PROGRAM_MAX_PAIRS above the pairs (the single-launch path)."""
    from nanovllm.kernels import moe_routing
    from nanovllm.kernels.moe_routing import align_by_expert
    monkeypatch.setattr(moe_routing, "ONE_PROGRAM_MAX_PAIRS", 4096 if one_program else 0)
    g = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(num_tokens)])
    a = align_by_expert(ids, experts, 16)
    num_pairs, used = ids.numel(), int(a.num_padded)
    assert used % 16 == 0
    rows = a.sorted_pairs[:used].view(-1, 16)
    assert sorted(r for r in a.sorted_pairs.tolist() if r < num_pairs) == list(range(num_pairs))
    assert (a.sorted_pairs[used:] == num_pairs).all()
    for block, expert in zip(rows, a.block_expert[:used // 16].tolist()):
        pairs = block[block < num_pairs]
        assert len(pairs) and (ids.view(-1)[pairs] == expert).all()
    assert (a.block_expert[used // 16:] == experts).all()


@interp
@pytest.mark.parametrize("num_tokens,inter,block_m,block_n",
                         [(1, 32, 16, 16), (13, 48, 16, 32), (37, 32, 32, 16)])
def test_interp_fused_moe_matches_reference(num_tokens, inter, block_m, block_n):
    from nanovllm.kernels.fused_moe import Tiles, fused_moe_triton
    g = torch.Generator().manual_seed(num_tokens)
    hidden, experts, top_k = 48, 8, 2
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.2
    logits = torch.randn(num_tokens, experts, generator=g)
    logits[:, 5] = -1e9   # an expert no token picks
    weights, ids = select_experts(logits, top_k, renormalize=True)
    out = fused_moe_triton(x, w13, w2, weights, ids, Tiles(block_m, block_n, 16, 4, 1))
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


@interp
@pytest.mark.parametrize("num_tokens,experts,top_k,renormalize",
                         [(1, 8, 2, True), (37, 6, 3, False), (20, 128, 8, True)])
def test_interp_select_experts_matches_reference(num_tokens, experts, top_k, renormalize):
    from nanovllm.kernels.moe_routing import select_experts_triton
    logits = torch.randn(num_tokens, experts, generator=torch.Generator().manual_seed(experts))
    weights, ids = select_experts_triton(logits, top_k, renormalize)
    want_weights, want_ids = select_experts(logits, top_k, renormalize)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights)
