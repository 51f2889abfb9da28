"""Gemma 2 and Gemma 3 (text) against transformers on tiny random configs (fp32, CPU): sliding-window
(8 tokens) and global layers, soft-capped scores and logits, q/k norms and a local rotary base; greedy
tokens are argmax choices of transformers' logits through the engine, with prompts several windows
long, chunked prefill across window edges, a prefix-cache hit and preemption under a small KV cache;
tensor parallelism over two CPU ranks; the multimodal Gemma 3 checkpoint's text model; Qwen2/3
configs with sliding-window layers; the reference attention's window and softcap; the pooling runner's
refusal."""
import pytest
import torch
from conftest import EOS, HFOracle, _tokenizer, make_model, random_prompts
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3Config, Gemma3TextConfig

from nanovllm import LLM, SamplingParams
from nanovllm.kernels.reference import causal_mask, paged_decode_attention_ref, prefill_attention_ref

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 8
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
              bos_token_id=0, eos_token_id=EOS, pad_token_id=2, sliding_window=WINDOW,
              query_pre_attn_scalar=24, attn_implementation="eager")
# 16-token blocks, 24-token steps: a 40-token prompt is prefilled in two chunks, the second one across
# several window edges
SMALL = dict(device="cpu", kvcache_block_size=16, max_num_batched_tokens=24, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = random_prompts(4, [5, 13, 29, 40], seed=3)


def _save(config, path: str, seed: int) -> str:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            # peaked logits; the zero-centred norms away from zero (a norm loaded without its + 1 shows)
            p.copy_(torch.randn(p.shape, generator=g) * (0.15 if p.dim() > 1 else 0.2))
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


def gemma2_config(**kw):
    # softcaps small enough to bend the scores and logits of these weights
    return Gemma2Config(**{**COMMON, "num_hidden_layers": 2, "attn_logit_softcapping": 3.0,
                           "final_logit_softcapping": 5.0, **kw})


def gemma3_config(**kw):
    # six layers: five sliding to one global; the sliding layers' rotary on their own base
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    return Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6, "rope_parameters": rope, **kw})


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def model(request, tmp_path_factory):
    config = gemma2_config() if request.param == "gemma2" else gemma3_config()
    path = _save(config, str(tmp_path_factory.mktemp(request.param)), seed=1)
    return path, HFOracle(path)


def _check(llm, oracle, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        oracle.assert_greedy(prompt, out["token_ids"])
    return outs


def test_greedy_matches_transformers(model):
    path, oracle = model
    # 7 blocks of 16 tokens for 4 prompts of up to 50 tokens: decoding preempts
    llm = LLM(path, num_kvcache_blocks=7, **SMALL)
    sched, preempted = llm.scheduler, []
    preempt = sched._preempt
    sched._preempt = lambda seq: (preempted.append(seq.seq_id), preempt(seq))
    try:
        first = _check(llm, oracle, PROMPTS)
        assert preempted, "7 blocks should have forced a preemption"
        # the longest prompt again: a prefix-cache hit on its two full blocks (the window's keys
        # come from cached pages), and one that extends it past them
        again = _check(llm, oracle, [PROMPTS[3], PROMPTS[3] + PROMPTS[1]])
        assert again[0]["token_ids"] == first[3]["token_ids"]
        assert again[0].num_cached_tokens >= 32
        # logprobs: the final softcap (Gemma 2) bends the logits without moving the argmax
        out = llm.generate([{"prompt_token_ids": PROMPTS[2]}],
                           SamplingParams(temperature=0.0, max_tokens=3, logprobs=0, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        ref = torch.log_softmax(oracle.logits(PROMPTS[2] + out.token_ids), -1)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert abs(entry[token].logprob - ref[len(PROMPTS[2]) - 1 + i, token].item()) < 1e-4
    finally:
        sched._preempt = preempt
        llm.shutdown()


def test_window_and_softcap_reference():
    """The reference's window and softcap against a dense masked softmax written out here."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 16, generator=g) for n, h in ((20, 4), (20, 2), (20, 2)))
    cu = torch.tensor([0, 20], dtype=torch.int32)
    out = prefill_attention_ref(q, k, v, None, None, cu, cu, 20, 20, None, 0.3, window=5, softcap=2.0)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * 0.3
    s = 2.0 * torch.tanh(s / 2.0)
    pos = torch.arange(20)
    visible = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 5)
    ref = torch.einsum("hqk,khd->qhd", s.masked_fill(~visible, float("-inf")).softmax(-1), vv)
    torch.testing.assert_close(out, ref)
    assert causal_mask(3, 10, "cpu", window=2).sum(-1).tolist() == [2, 2, 2]
    # decode: the last query row of the prefill, over a paged cache
    cache_k, cache_v = k.view(5, 4, 2, 16), v.view(5, 4, 2, 16)
    table = torch.arange(5, dtype=torch.int32)[None]
    dec = paged_decode_attention_ref(q[-1:], cache_k, cache_v, table, torch.tensor([20], dtype=torch.int32),
                                     0.3, window=5, softcap=2.0)
    torch.testing.assert_close(dec[0], out[-1])


def test_gemma3_multimodal_checkpoint_runs_its_text_model(tmp_path):
    """Gemma3ForConditionalGeneration: the text model's weights under language_model.model., a vision
    tower and projector beside them (skipped)."""
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    config = Gemma3Config(text_config=gemma3_config(num_hidden_layers=2).to_dict(), vision_config=vision,
                          mm_tokens_per_image=4, architectures=["Gemma3ForConditionalGeneration"])
    path = _save(config, str(tmp_path), seed=2)
    oracle = HFOracle(path)
    llm = LLM(path, num_kvcache_blocks=16, **SMALL)
    try:
        _check(llm, oracle, PROMPTS[2:])
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_qwen_sliding_window_layers_match_transformers(tmp_path, arch):
    # layer 0 full attention, layer 1 a window of 8 (from max_window_layers on)
    path = make_model(str(tmp_path), arch, use_sliding_window=True, sliding_window=WINDOW,
                      max_window_layers=1)
    oracle = HFOracle(path)
    llm = LLM(path, num_kvcache_blocks=16, **SMALL)
    try:
        layers = llm.model_runner.model.model.layers
        assert [layer.self_attn.attn.sliding_window for layer in layers] == [0, WINDOW]
        _check(llm, oracle, PROMPTS[2:])
    finally:
        llm.shutdown()


def test_pooling_runner_refuses_gemma(model):
    with pytest.raises(ValueError, match="Llama-family decoders"):
        LLM(model[0], runner="pooling", **SMALL)


def test_tensor_parallel_two_ranks_match_transformers(model):
    # heads, the MLP and the vocabulary split over two CPU ranks; the norms and softcaps replicated
    path, oracle = model
    llm = LLM(path, tensor_parallel_size=2, num_kvcache_blocks=16, **SMALL)
    try:
        _check(llm, oracle, PROMPTS)
    finally:
        llm.shutdown()
