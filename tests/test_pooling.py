"""The pooling runner against transformers on tiny random models, fp32 on the CPU:
embeddings (last token, mean, CLS; chunked prompts; Matryoshka), token-wise embeddings, classifiers
(Qwen3/LlamaForSequenceClassification), a causal LM converted to a yes/no reranker, rewards, scores;
the scheduler's prompt-only steps; and bad input."""
import json
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from conftest import CONFIGS, _tokenizer, assert_clean, make_model, random_prompts
from nanovllm import LLM, PoolingParams
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.pooler import SequencePooling

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# a prompt of 40 tokens runs in three chunks
SMALL = dict(max_num_batched_tokens=16, kvcache_block_size=8, num_kvcache_blocks=64)
PROMPTS = random_prompts(4, [5, 40, 17, 9], seed=1)


def cosine(a, b) -> float:
    a, b = torch.as_tensor(a).float().flatten(), torch.as_tensor(b).float().flatten()
    return F.cosine_similarity(a, b, dim=0).item()


@torch.no_grad()
def hf_hidden(path: str, ids: list[int]) -> torch.Tensor:
    """transformers' last_hidden_state: [len(ids), hidden]."""
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return model(torch.tensor([ids])).last_hidden_state[0]


def make_classifier(path: str, arch: str = "qwen3", num_labels: int = 3) -> str:
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(CONFIGS[arch](num_labels=num_labels),
                                                           dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen2"])
def embedder(request, tmp_path_factory):
    path = make_model(str(tmp_path_factory.mktemp(request.param)), request.param)
    llm = LLM(path, runner="pooling", **SMALL)
    yield path, llm
    llm.shutdown()


def test_embeddings_are_the_last_hidden_state_normalized(embedder):
    path, llm = embedder
    outs = llm.embed(PROMPTS, use_tqdm=False)   # the 40-token prompt runs in three chunks
    for ids, out in zip(PROMPTS, outs):
        ref = F.normalize(hf_hidden(path, ids)[-1], dim=-1)
        assert out.outputs.hidden_size == 64 and out.prompt_token_ids == ids
        assert cosine(out.outputs.embedding, ref) >= 0.99999
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-5, rtol=1e-5)
    assert_clean(llm)   # every block free again: nothing kept once pooled


def test_token_embeddings_and_unnormalized(embedder):
    path, llm = embedder
    ids = PROMPTS[1]
    ref = hf_hidden(path, ids)
    (tok,) = llm.encode([ids], pooling_task="token_embed", use_tqdm=False)
    assert tok.outputs.data.shape == (len(ids), 64)   # every chunk's rows, in order
    torch.testing.assert_close(tok.outputs.data, F.normalize(ref, dim=-1), atol=1e-5, rtol=1e-5)
    (raw,) = llm.encode(ids, PoolingParams(normalize=False), pooling_task="embed", use_tqdm=False)
    torch.testing.assert_close(raw.outputs.data, ref[-1], atol=1e-5, rtol=1e-5)


def test_last_token_pooling_reads_the_prefix_cache(embedder):
    _, llm = embedder
    long = random_prompts(1, [35], seed=7)[0]   # a prompt no other test computed
    first, = llm.embed([long], use_tqdm=False)
    again, = llm.embed([long], use_tqdm=False)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32   # 4 full blocks of 8
    assert cosine(first.outputs.embedding, again.outputs.embedding) >= 0.99999


@pytest.mark.parametrize("how", ["pooler_config", "sentence_transformers"])
@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_mean_and_cls_pooling_over_every_chunk(tmp_path, how, pooling_type):
    path = make_model(str(tmp_path), "qwen3")
    options = {}
    if how == "pooler_config":
        options["pooler_config"] = {"pooling_type": pooling_type, "normalize": False}
    else:   # modules.json + 1_Pooling/config.json, with no Normalize module: not normalized
        mode = {"MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token"}[pooling_type]
        os.makedirs(tmp_path / "1_Pooling")
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                         mode: True}))
        (tmp_path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    llm = LLM(path, runner="pooling", **SMALL, **options)
    try:
        llm.embed([PROMPTS[1]], use_tqdm=False)
        outs = llm.embed(PROMPTS, use_tqdm=False)
        for ids, out in zip(PROMPTS, outs):
            hidden = hf_hidden(path, ids)
            ref = hidden.mean(0) if pooling_type == "MEAN" else hidden[0]
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-5, rtol=1e-5)
            assert out.num_cached_tokens == 0   # these poolers read every position: no cached prefix
        assert_clean(llm)
    finally:
        llm.shutdown()


def test_matryoshka_dimensions(tmp_path):
    path = make_model(str(tmp_path), "qwen3")
    plain = LLM(path, runner="pooling", **SMALL)
    try:
        with pytest.raises(ValueError, match="Matryoshka"):
            plain.embed(PROMPTS[:1], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
    finally:
        plain.shutdown()
    llm = LLM(path, runner="pooling", hf_overrides={"matryoshka_dimensions": [16, 32]}, **SMALL)
    try:
        out, = llm.embed(PROMPTS[1:2], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
        ref = F.normalize(hf_hidden(path, PROMPTS[1])[-1, :16], dim=-1)   # cut, then normalized
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match=r"only the Matryoshka dimensions \[16, 32\]"):
            llm.embed(PROMPTS[:1], pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_sequence_classifier_against_transformers(tmp_path, arch):
    path = make_classifier(str(tmp_path), arch, num_labels=3)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, **SMALL)   # runner and convert "auto": the architecture's name says classify
    try:
        assert llm.config.pooling.convert == "classify"
        outs = llm.classify(PROMPTS, use_tqdm=False)
        raw = llm.classify(PROMPTS[:2], pooling_params=PoolingParams(use_activation=False),
                           use_tqdm=False)
        rewards = llm.reward(PROMPTS[1:2], use_tqdm=False)
        with torch.no_grad():
            logits = [hf(torch.tensor([ids])).logits[0] for ids in PROMPTS]
            per_token = hf.score(hf.model(torch.tensor([PROMPTS[1]])).last_hidden_state[0])
        for out, ref in zip(outs, logits):
            assert out.outputs.num_classes == 3
            torch.testing.assert_close(torch.tensor(out.outputs.probs), ref.softmax(-1), atol=1e-5,
                                       rtol=1e-5)
        for out, ref in zip(raw, logits):
            torch.testing.assert_close(torch.tensor(out.outputs.probs), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rewards[0].outputs.data, per_token.softmax(-1), atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="num_labels=1"):
            llm.score("w5 w6", "w7 w8", use_tqdm=False)   # three labels: no cross-encoder score
        assert_clean(llm)
    finally:
        llm.shutdown()
    if arch == "qwen3":   # convert="reward": the score head on every token, raw values by default
        reward = LLM(path, convert="reward", **SMALL)
        try:
            raw, = reward.reward(PROMPTS[1:2], use_tqdm=False)
            torch.testing.assert_close(raw.outputs.data, per_token, atol=1e-5, rtol=1e-5)
            with pytest.raises(ValueError, match="Classification API is not supported"):
                reward.classify(PROMPTS[:1])
        finally:
            reward.shutdown()


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_reranker_from_the_lm_heads_yes_and_no_rows(tmp_path, tied):
    path = make_model(str(tmp_path), "qwen3", tie_word_embeddings=tied)
    no, yes = 5, 7   # tokens "w5" and "w7" play "no" and "yes"
    llm = LLM(path, runner="pooling", **SMALL, hf_overrides={
        "architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["w5", "w7"],
        "is_original_qwen3_reranker": True})
    try:
        query, docs = "w10 w11 w12", ["w20 w21", "w30 " * 30, "w40 w41 w42 w43"]
        outs = llm.score(query, docs, use_tqdm=False)
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for out in outs:
            with torch.no_grad():
                last = lm(torch.tensor([out.prompt_token_ids])).logits[0, -1]
            ref = torch.stack([last[no], last[yes]]).softmax(-1)[1]   # P(yes) of the two
            assert abs(out.outputs.score - ref.item()) < 1e-5
        tokenizer = llm.get_tokenizer()
        assert outs[0].prompt_token_ids == tokenizer.encode(query) + tokenizer.encode(docs[0])
        assert_clean(llm)
    finally:
        llm.shutdown()


def test_bi_encoder_scores_are_cosine_similarities(embedder):
    path, llm = embedder
    outs = llm.score(PROMPTS[0], [PROMPTS[1], PROMPTS[2]], use_tqdm=False)
    ref = [F.cosine_similarity(hf_hidden(path, PROMPTS[0])[-1], hf_hidden(path, p)[-1], dim=0)
           for p in PROMPTS[1:3]]
    assert [round(o.outputs.score, 5) for o in outs] == [round(r.item(), 5) for r in ref]
    pairs = llm.score(PROMPTS[:2], PROMPTS[2:4], use_tqdm=False)
    assert len(pairs) == 2
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        llm.score(PROMPTS[:2], PROMPTS[:3], use_tqdm=False)


def test_tensor_parallel_reranker(tmp_path):
    """TP=2 on the CPU: the workers run the same pooling steps (their shares dropped), rank 0's scores
    equal transformers'; the LM-head rows come whole to each rank's replicated score head."""
    path = make_model(str(tmp_path), "qwen3")
    llm = LLM(path, tensor_parallel_size=2, **SMALL, hf_overrides={
        "architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["w5", "w7"]})
    try:
        outs = llm.score("w10 w11", ["w20 w21", "w30 " * 30], use_tqdm=False)
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for out in outs:
            with torch.no_grad():
                last = lm(torch.tensor([out.prompt_token_ids])).logits[0, -1]
            assert abs(out.outputs.score - torch.sigmoid(last[7] - last[5]).item()) < 1e-5
        assert_clean(llm)
    finally:
        llm.shutdown()


def test_bad_input(qwen3_dir):
    llm = LLM(qwen3_dir, runner="pooling", **SMALL)
    with pytest.raises(ValueError, match="pooling_task is required"):
        llm.encode(PROMPTS[:1])
    with pytest.raises(ValueError, match="only supported for generative models"):
        llm.generate(PROMPTS[:1])
    with pytest.raises(ValueError, match="Classification API is not supported"):
        llm.classify(PROMPTS[:1])
    with pytest.raises(ValueError, match="takes only"):
        llm.embed(PROMPTS[:1], pooling_params=PoolingParams(use_activation=True))
    with pytest.raises(ValueError, match="pooling_params 1"):
        llm.embed(PROMPTS[:2], pooling_params=[PoolingParams(), PoolingParams(dimensions=8)])
    with pytest.raises(ValueError, match="prompt 1"):
        llm.embed([PROMPTS[0], [9999]])
    for bad in (dict(dimensions=0), dict(normalize="yes"), dict(truncate_prompt_tokens=0), dict(task="x")):
        with pytest.raises(ValueError):
            PoolingParams(**bad)
    assert_clean(llm)
    llm.shutdown()
    generator = LLM(qwen3_dir, num_kvcache_blocks=8, kvcache_block_size=8)
    try:
        with pytest.raises(ValueError, match="only supported for pooling models"):
            generator.embed(["w5 w6"])
        with pytest.raises(ValueError, match="only supported for pooling models"):
            generator.score("w5", "w6")
    finally:
        generator.shutdown()
    with pytest.raises(ValueError, match="runner must be one of"):
        LLM(qwen3_dir, runner="embed")
    with pytest.raises(ValueError, match="also pass runner='pooling'"):
        LLM(qwen3_dir, runner="generate", convert="embed")
    with pytest.raises(TypeError, match="pooler_config keys"):
        LLM(qwen3_dir, runner="pooling", pooler_config={"pooling": "MEAN"})
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        LLM(qwen3_dir, runner="pooling", pooler_config={"pooling_type": "MAX"})


def test_prompt_only_steps_fill_the_token_budget_and_free_at_once():
    """Scheduler alone: prompt-only sequences of mixed lengths are packed into full steps (the last
    prompt of a step chunked), never enter the running queue, and free their blocks when their step
    is applied."""
    sched = Scheduler(max_num_seqs=64, max_num_batched_tokens=32, max_model_len=256, num_blocks=64,
                      block_size=8, eos_token_ids={1})
    params = PoolingParams().resolved("embed", {})
    seqs = [Sequence(ids, pooling=SequencePooling(params, "LAST"))
            for ids in random_prompts(5, [5, 20, 13, 40, 9], seed=3)]
    for seq in seqs:
        sched.add(seq)
    sizes = []
    while not sched.is_finished():
        batch = sched.schedule()
        assert batch.is_prefill and not sched.running and not any(batch.samples)
        sizes.append(batch.num_tokens)
        finished = sched.postprocess(batch, [])
        assert {s.seq_id for s in finished} == {s.seq_id for s, p in zip(batch.seqs, batch.pools) if p}
        assert all(not s.block_table for s in finished)
    assert sizes == [32, 32, 23] and all(s.is_finished and s.finish_reason == "stop" for s in seqs)
    assert sched.block_manager.num_free_blocks == 64
