"""Qwen3.5 / Qwen3.6 and Qwen3-Next hybrid models (Gated DeltaNet linear attention + gated full
attention) against transformers on tiny random configs (3 linear-attention layers + 1 full-attention
layer): the torch conv and delta rule against transformers' torch fallbacks, carried across chunks;
the state slots and the memory split with no model; greedy tokens as argmax choices of transformers'
logits through the engine (a batch of mixed lengths, prompts longer than a step, preemption under a
small KV cache, a repeated prompt, an aborted prompt, decode through the CUDA graphs' static inputs,
n > 1 sampling, fewer state slots than max_num_seqs, bf16); MoE with a shared expert; Qwen3-Next; the
multimodal checkpoint names; TP=2 on CPU. CUDA (fla-core kernels when installed, decode CUDA graphs):
the test at the end, skipped without a GPU."""
import logging

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_5")   # transformers >= 5.2
from conftest import EOS, HFOracle, _tokenizer, edit_checkpoint, random_prompts
from test_decode_graphs import EagerGraphs
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_next import Qwen3NextConfig

from nanovllm import LLM, SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.decode_graphs import DecodeInputs
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.state_cache import split_budget
from nanovllm.engine.step_input import StepInput
from nanovllm.kernels.linear_attention_ref import (causal_conv_step, causal_conv_varlen,
                                                   gated_delta_rule_step, gated_delta_rule_varlen)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=EOS,
            tie_word_embeddings=False)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
# 16-token blocks, 48-token steps: the 70-token prompt is prefilled in two chunks and a half
SMALL = dict(device="cpu", kvcache_block_size=16, max_num_batched_tokens=48, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = random_prompts(5, [5, 17, 33, 40, 70], seed=1)


def _randomize(model: torch.nn.Module, seed: int):
    """Weights large enough for peaked logits; the zero-centred norms and the gated norm away from
    their initial values (so a norm loaded without its + 1, or a dim out of order, shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
            elif name.endswith("dt_bias"):   # per head (HF starts it at ones): a split shows
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "norm" in name:
                centre = 1.0 if "linear_attn.norm" in name else 0.0   # the gated norm is not zero-centred
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + centre)


def make_qwen35(path: str, config, seed: int = 0, cls=AutoModelForCausalLM) -> str:
    torch.manual_seed(seed)
    model = cls.from_config(config, dtype=torch.float32) if cls is AutoModelForCausalLM else cls(config)
    _randomize(model, seed)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    path = make_qwen35(str(tmp_path_factory.mktemp("qwen35")), Qwen3_5TextConfig(**TEXT))
    return path, HFOracle(path)


@pytest.fixture(scope="module")
def dense_llm(dense):
    # 9 blocks of 16 tokens: the first four prompts fill them, so decoding preempts
    llm = LLM(dense[0], num_kvcache_blocks=9, **SMALL)
    yield llm
    llm.shutdown()


def greedy(llm, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_slots_free(llm):
    sched = llm.scheduler
    slots = sched.block_manager.state_slots
    assert not sched.waiting and not sched.running
    assert slots.num_free == slots.num_slots


# ---- the torch reference against transformers' torch fallbacks --------------------------------

def _delta_inputs(n: int, g: torch.Generator, hk=2, hv=4, dk=16, dv=8):
    q, k = torch.randn(n, hk, dk, generator=g), torch.randn(n, hk, dk, generator=g)
    v = torch.randn(n, hv, dv, generator=g)
    decay = -torch.rand(n, hv, generator=g) * 0.5      # log decay <= 0
    beta = torch.rand(n, hv, generator=g)
    return q, k, v, decay, beta


def test_delta_rule_matches_transformers_across_chunks_and_steps():
    """Two sequences (150 tokens: three CHUNKs with a ragged end; 9 tokens) after given states, split
    into pieces that carry the state, then decode steps, against transformers' token-by-token rule."""
    g = torch.Generator().manual_seed(0)
    lengths = [150, 9]
    inputs = [_delta_inputs(n, g) for n in lengths]
    states = torch.randn(2, 4, 16, 8, generator=g) * 0.3
    for i, (q, k, v, decay, beta) in enumerate(inputs):
        ref, ref_state = hf.torch_recurrent_gated_delta_rule(
            q[None], k[None], v[None], decay[None], beta[None], initial_state=states[i:i + 1].clone(),
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        # ours: a first piece of both sequences side by side, then the rest, then the last token alone
        cut = [100, 4][i]
        s = states[i:i + 1]
        outs = []
        for a, b in ((0, cut), (cut, lengths[i] - 1)):
            o, s = gated_delta_rule_varlen(q[a:b], k[a:b], v[a:b], decay[a:b], beta[a:b], s, [0, b - a])
            outs.append(o)
        o, s = gated_delta_rule_step(q[-1:], k[-1:], v[-1:], decay[-1:], beta[-1:], s)
        outs.append(o)
        torch.testing.assert_close(torch.cat(outs), ref[0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(s, ref_state, atol=2e-5, rtol=1e-4)


def test_conv_matches_transformers_across_chunks_and_steps():
    g = torch.Generator().manual_seed(1)
    channels, width = 12, 4
    weight = torch.randn(channels, width, generator=g)
    xs = [torch.randn(n, channels, generator=g) for n in (7, 2, 5)]
    # transformers: each whole sequence at once, from a zero state
    refs = [hf.causal_conv1d_fn(x.t()[None], weight, activation="silu")[0].t() for x in xs]
    # ours: the sequences back to back, in two pieces (the second of one token each: decode)
    states = torch.zeros(3, channels, width - 1)
    firsts = [x[:-1] for x in xs]
    cu = torch.tensor([0, *torch.tensor([len(x) for x in firsts]).cumsum(0).tolist()])
    out, states = causal_conv_varlen(torch.cat(firsts), weight, states, cu)
    step, _ = causal_conv_step(torch.stack([x[-1] for x in xs]), weight, states)
    for i, ref in enumerate(refs):
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], ref[:-1])
        torch.testing.assert_close(step[i], ref[-1])


# ---- state slots and the memory split, with no model ---------------------------------------------

def test_state_slots_are_taken_with_blocks_and_given_back_with_them():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False, num_state_slots=2)
    a, b, c = (Sequence(list(range(5))) for _ in range(3))
    bm.allocate(a)
    bm.allocate(b)
    assert {a.state_slot, b.state_slot} == {1, 2}   # row 0 is the graphs' scratch row
    assert bm.num_free_blocks == 4 and not bm.can_allocate(c)   # blocks left, but no slot
    bm.deallocate(a)   # finished or preempted: blocks and slot go back together
    assert a.state_slot is None and bm.can_allocate(c)
    bm.allocate(c)
    assert c.state_slot not in (None, b.state_slot)
    bm.reset()
    assert bm.state_slots.num_free == 2


def test_decode_inputs_carry_the_state_slots_and_pad_to_the_scratch_row():
    """The CUDA graphs read each row's state slot from the packed decode inputs; padding rows write
    into row 0, which no sequence owns."""
    step = StepInput(is_prefill=False, seq_ids=[0, 1], starts=[5, 3], token_ids=[[7], [8]],
                     block_tables=[[0], [1]], samples=[True, True], state_slots=[2, 1])
    inputs = DecodeInputs.view(DecodeInputs.pack(step, 4, 2, 16), 4, 2)
    assert inputs.state_slots.tolist() == [2, 1, 0, 0]


def test_split_budget_gives_the_slots_at_most_half():
    assert split_budget(1000, block_bytes=10, slot_bytes=40, max_num_seqs=4) == (4, 84)
    assert split_budget(200, block_bytes=10, slot_bytes=40, max_num_seqs=4) == (2, 12)
    assert split_budget(60, block_bytes=10, slot_bytes=40, max_num_seqs=4) == (1, 2)   # one at least
    assert split_budget(40, block_bytes=10, slot_bytes=40, max_num_seqs=4) == (0, 4)   # too small


# ---- end to end, dense ----------------------------------------------------------------------------

def test_batch_chunked_prefill_and_preemption_match_transformers(dense, dense_llm):
    path, oracle = dense
    sched, preempted, batches = dense_llm.scheduler, [], []
    preempt, schedule = sched._preempt, sched.schedule
    sched._preempt = lambda seq: (preempted.append(seq.seq_id), preempt(seq))
    sched.schedule = lambda: batches.append(schedule()) or batches[-1]
    try:
        outs = greedy(dense_llm)
    finally:
        sched._preempt, sched.schedule = preempt, schedule
    assert preempted, "9 blocks should have forced a preemption"
    assert any(b.is_prefill and not all(b.samples) for b in batches), "a prompt should run in chunks"
    for prompt, out in zip(PROMPTS, outs):
        oracle.assert_greedy(prompt, out)
    assert_slots_free(dense_llm)
    # The same prompts again, one of them twice in the batch: the same tokens (no prefix cache, and
    # no state left behind in the reused slots).
    again = greedy(dense_llm, PROMPTS + [PROMPTS[2]])
    assert again == outs + [outs[2]]


def test_bfloat16_stays_within_transformers_own_bfloat16_error(dense):
    """bf16 weights and conv states, fp32 recurrent states: each token's logit (in transformers' fp32
    logits) is within transformers' own bf16 error (its bf16 logits' largest distance from its fp32
    ones, on the same tokens) of the maximum."""
    path, oracle = dense
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    llm = LLM(path, dtype="bfloat16", num_kvcache_blocks=9, **SMALL)
    for prompt, out in zip(PROMPTS, greedy(llm)):
        rows = oracle.logits(prompt + out)[len(prompt) - 1:-1]
        with torch.no_grad():
            rows16 = hf16(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1].float()
        gap = rows.max(-1).values - rows.gather(1, torch.tensor(out)[:, None])[:, 0]
        assert gap.max() <= (rows16 - rows).abs().max()
    llm.shutdown()


def test_an_aborted_sequence_gives_its_slot_back(dense, dense_llm):
    """Aborted part-way through its chunked prefill: its slot is free again, and the sequence that
    takes it next starts from a zero state (transformers' tokens)."""
    path, oracle = dense
    engine = dense_llm.llm_engine
    long, other = engine.add_request(PROMPTS[4], GREEDY)[0], engine.add_request(PROMPTS[1], GREEDY)[0]
    engine.step()   # the long prompt's first chunk
    assert long.state_slot is not None and long.num_computed_tokens < long.num_prompt_tokens
    engine.abort([long])
    assert long.state_slot is None and long.finish_reason == "abort"
    while not engine.is_finished():
        engine.step()
    assert_slots_free(dense_llm)
    oracle.assert_greedy(PROMPTS[1], other.completion_token_ids)
    oracle.assert_greedy(PROMPTS[0], greedy(dense_llm, PROMPTS[:1])[0])


def test_decode_through_the_graphs_static_inputs(dense):
    """Decode through DecodeGraphs (replayed eagerly on the CPU: the same static input buffer, the
    state slots among its fields, batches padded to 2 or 4 whose padding rows write the scratch
    row): transformers' argmax, as eager decode."""
    path, oracle = dense
    llm = LLM(path, num_kvcache_blocks=40, max_model_len=128, **SMALL)
    runner = llm.model_runner
    with torch.inference_mode():
        runner.graphs = EagerGraphs(runner.decode_forward, 4, 128 // 16, 16, TEXT["hidden_size"],
                                    runner.dtype, runner.device)
    replays = []
    for bs, replay in runner.graphs.replays.items():
        runner.graphs.replays[bs] = lambda bs=bs, replay=replay: replays.append(bs) or replay()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 8, 12)]
    outs = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
    assert set(replays) == {2, 4}   # 3 sequences pad to 4, then 2 and 1 to 2
    for prompt, out in zip(PROMPTS, outs):
        oracle.assert_greedy(prompt, out)
    llm.shutdown()


def test_sampling_n_completions_have_transformers_logprobs(dense, dense_llm):
    """n = 3 sampled completions of one prompt, each in a slot of its own: every sampled token's
    logprob is transformers' log-softmax at that position of that completion."""
    path, oracle = dense
    prompt = PROMPTS[1]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=3, logprobs=0, ignore_eos=True)
    out = dense_llm.generate([prompt], params, use_tqdm=False)[0]
    completions = [list(c.token_ids) for c in out.outputs]
    assert len({tuple(c) for c in completions}) > 1, "three samples at temperature 1 should differ"
    for c in out.outputs:
        ids = list(c.token_ids)
        ref = oracle.logits(prompt + ids).log_softmax(-1)
        for i, tok in enumerate(ids):
            ours = c.logprobs[i][tok].logprob
            assert abs(ours - ref[len(prompt) - 1 + i, tok].item()) < 1e-3
    assert_slots_free(dense_llm)


def test_fewer_state_slots_than_max_num_seqs(dense, caplog):
    """A budget whose half holds two sequences' states, not max_num_seqs = 4: two run at a time, the
    others wait for a slot; tokens as transformers'."""
    path, oracle = dense
    probe = LLM(path, num_kvcache_blocks=8, **SMALL)
    runner = probe.model_runner
    state = runner.state_cache
    slot, block = state.nbytes // (state.num_slots + 1), runner.kv_bytes_per_block()
    probe.shutdown()
    caplog.clear()   # the probe's own lines (when an earlier test left nanovllm's logger at INFO)
    with caplog.at_level(logging.INFO):
        llm = LLM(path, kv_cache_memory_bytes=2 * slot + 8 * block, **SMALL)   # < 6 slots' worth
    assert llm.scheduler.block_manager.state_slots.num_slots == 2
    assert sum("prefix caching is off" in r.getMessage() for r in caplog.records) == 1
    assert any("state cache: 2 sequence slots" in r.getMessage() for r in caplog.records)
    most = []
    original = llm.scheduler.schedule

    def schedule():
        batch = original()
        most.append(len(llm.scheduler.running))
        return batch
    llm.scheduler.schedule = schedule
    outs = greedy(llm)
    assert max(most) == 2
    for prompt, out in zip(PROMPTS, outs):
        oracle.assert_greedy(prompt, out)
    llm.shutdown()


# ---- MoE, the multimodal checkpoints -----------------------------------------------------------

def test_moe_matches_transformers(tmp_path):
    path = make_qwen35(str(tmp_path), Qwen3_5MoeTextConfig(**TEXT, **MOE))
    oracle = HFOracle(path)
    llm = LLM(path, num_kvcache_blocks=16, **SMALL)
    for prompt, out in zip(PROMPTS, greedy(llm)):
        oracle.assert_greedy(prompt, out)
    llm.shutdown()


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """Qwen3-Next: fused in_proj_qkvz / in_proj_ba tensors (each key head's rows together), experts in
    layers 0 and 2 (mlp_only_layers), dense MLPs in 1 and 3."""
    config = Qwen3NextConfig(**TEXT, **MOE, decoder_sparse_step=1, mlp_only_layers=[1, 3],
                             norm_topk_prob=False)
    path = make_qwen35(str(tmp_path_factory.mktemp("qwen3_next")), config)
    llm = LLM(path, num_kvcache_blocks=16, **SMALL)
    yield path, greedy(llm)
    llm.shutdown()


def test_qwen3_next_matches_transformers(qwen3_next):
    path, outs = qwen3_next
    oracle = HFOracle(path)
    for prompt, out in zip(PROMPTS, outs):
        oracle.assert_greedy(prompt, out)


def test_conditional_generation_reads_the_text_model_and_skips_the_rest(tmp_path, caplog):
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
                  patch_size=4, spatial_merge_size=1, temporal_patch_size=1)
    config = Qwen3_5Config(text_config=TEXT, vision_config=vision, tie_word_embeddings=False)
    path = make_qwen35(str(tmp_path), config, cls=Qwen3_5ForConditionalGeneration)
    # a multi-token-prediction head, as the published checkpoints have
    edit_checkpoint(path, lambda t: t.update({"mtp.fc.weight": torch.zeros(64, 128)}))
    hf_model = Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with caplog.at_level(logging.INFO):
        llm = LLM(path, num_kvcache_blocks=16, **SMALL)
    skips = [r.getMessage() for r in caplog.records
             if "checkpoint tensors the model does not run" in r.getMessage()]
    assert len(skips) == 1 and "model.visual." in skips[0]
    for prompt, out in zip(PROMPTS[:2], greedy(llm, PROMPTS[:2])):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out])).logits[0]
        assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out
    llm.shutdown()


# ---- tensor parallelism ----------------------------------------------------------------------------

def test_tp2_matches_tp1(dense, dense_llm):
    """Linear-attention heads, conv channels and states split over two ranks (gloo): TP=1's tokens,
    through chunked prefill and preemption."""
    path, _ = dense
    expected = greedy(dense_llm)
    llm = LLM(path, tensor_parallel_size=2, num_kvcache_blocks=9, **SMALL)
    try:
        assert greedy(llm) == expected
    finally:
        llm.shutdown()


def test_tp2_matches_tp1_qwen3_next(qwen3_next):
    """The fused projections are split by key head before they are split over the ranks; experts and
    shared experts sharded as the dense MLP."""
    path, expected = qwen3_next
    llm = LLM(path, tensor_parallel_size=2, num_kvcache_blocks=16, **SMALL)
    try:
        assert greedy(llm) == expected
    finally:
        llm.shutdown()


# ---- CUDA -----------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graphs_match_transformers(dense):
    """On CUDA (fla-core's kernels when installed), decode in CUDA graphs with the state slots as graph
    inputs: argmax choices of transformers' logits, also after preemption and chunked prefill."""
    path, oracle = dense
    llm = LLM(path, device="cuda", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=9,
              max_num_batched_tokens=48, max_num_seqs=4)
    assert llm.model_runner.graphs is not None
    for prompt, out in zip(PROMPTS, greedy(llm)):
        oracle.assert_greedy(prompt, out, atol=1e-2)
    llm.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fla_kernels_match_the_torch_reference():
    """fla-core's chunk (prefill, sequences back to back after their states) and fused-recurrent
    (decode) kernels as the layer calls them, against the torch reference, in bf16."""
    pytest.importorskip("fla")
    from nanovllm.layers.gated_deltanet import GatedDeltaNet
    from nanovllm.utils.context import Context
    g = torch.Generator().manual_seed(0)
    q, k, v, decay, beta = (x.cuda() for x in _delta_inputs(150, g, dk=64, dv=64))
    q, k, v, beta = (x.bfloat16() for x in (q, k, v, beta))
    states = (torch.randn(2, 4, 64, 64, generator=g) * 0.3).cuda()
    cu = [0, 141, 150]
    ctx = Context(is_prefill=True, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device="cuda"))
    out, new = GatedDeltaNet._delta_rule_fla(q, k, v, decay, beta, states, ctx)
    ref, ref_new = gated_delta_rule_varlen(q, k, v, decay, beta, states, cu)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(new, ref_new, atol=3e-2, rtol=3e-2)
    step = Context(is_prefill=False)
    out, new = GatedDeltaNet._delta_rule_fla(q[:2], k[:2], v[:2], decay[:2], beta[:2], states, step)
    ref, ref_new = gated_delta_rule_step(q[:2], k[:2], v[:2], decay[:2], beta[:2], states)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(new, ref_new, atol=3e-2, rtol=3e-2)
