"""LoRA adapters against transformers + PEFT (the oracle): PEFT folders made with get_peft_model on a
tiny random Qwen3 (random nonzero A and B, RMSNorm weights randomised so the norm fold into A is
exercised), a batch mixing the base model and two adapters of different ranks (one rsLoRA) gives
tokens that are argmaxes of PEFT's logits; also with one GPU slot (the scheduler splits the batch),
under TP=2, with beam search and chat. Bad adapters are clear errors that queue nothing; the prefix
cache is keyed by adapter; the batched kernel against its torch reference under the interpreter."""
import json
import os

import pytest
import torch

from conftest import INTERPRETED, assert_clean, interp, make_model, random_prompts, randomize_tensors, \
    run_interpreted_tests

peft = pytest.importorskip("peft")

from nanovllm import LLM, LoRARequest, SamplingParams  # noqa: E402
from nanovllm.lora.request import LoRARequest as LoRARequestFromModule  # noqa: E402
from nanovllm.lora.slots import SlotTable  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OPTIONS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_num_batched_tokens=64,
               max_num_seqs=8, enable_lora=True, max_loras=2, max_lora_rank=16)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = random_prompts(3, [7, 21, 12], seed=3)


def make_adapter(model_dir: str, out: str, r: int, targets, seed: int, **extra) -> str:
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0, **extra)
    model = peft.get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:   # B is zero at PEFT's init: random, so the adapter changes the tokens
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_model(str(tmp_path_factory.mktemp("qwen3_lora")), "qwen3", seed=5)
    g = torch.Generator().manual_seed(9)
    randomize_tensors(path, "layernorm.weight", lambda shape: 1 + 0.5 * torch.randn(shape, generator=g))
    return path


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    a = make_adapter(model_dir, str(root / "a"), 8, ALL, seed=1)
    b = make_adapter(model_dir, str(root / "b"), 16, ["q_proj", "v_proj", "o_proj", "down_proj"], seed=2,
                     use_rslora=True)
    return LoRARequest("a", 1, a), LoRARequest("b", 2, b)


class PeftOracle:
    def __init__(self, model_dir: str, adapter: LoRARequest | None):
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                     attn_implementation="eager")
        self.model = model if adapter is None else peft.PeftModel.from_pretrained(model, adapter.lora_path)
        self.model.eval()

    @torch.no_grad()
    def assert_greedy(self, prompt: list[int], output: list[int], atol: float = 1e-3):
        logits = self.model(input_ids=torch.tensor([prompt + output])).logits[0]
        for i, tok in enumerate(output):
            row = logits[len(prompt) - 1 + i]
            assert row[tok] >= row.max() - atol, f"token {i}: {tok} is not PEFT's argmax {row.argmax()}"


@pytest.fixture(scope="module")
def oracles(model_dir, adapters):
    return {None: PeftOracle(model_dir, None), **{r.lora_int_id: PeftOracle(model_dir, r) for r in adapters}}


@pytest.fixture(scope="module")
def llm(model_dir):
    engine = LLM(model_dir, **OPTIONS)
    yield engine
    engine.shutdown()


def mixed(adapters):
    """Every prompt under the base model and under each adapter, interleaved."""
    prompts, loras = [], []
    for p in PROMPTS:
        for lora in (None, *adapters):
            prompts.append(p)
            loras.append(lora)
    return prompts, loras


def check_mixed(llm, adapters, oracles):
    prompts, loras = mixed(adapters)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    got = [o.outputs[0].token_ids for o in outs]
    for p, lora, out in zip(prompts, loras, got):
        oracles[lora and lora.lora_int_id].assert_greedy(p, out)
    # each adapter changes the tokens (a LoRA that is not applied would fail here)
    for i in range(0, len(got), 3):
        assert got[i] != got[i + 1] and got[i] != got[i + 2]
    assert_clean(llm)
    return got


def test_a_batch_mixing_the_base_model_and_two_adapters_is_peft_s_greedy_argmax(llm, adapters, oracles):
    got = check_mixed(llm, adapters, oracles)
    # the same request alone gives the same tokens as in the mixed batch
    alone = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=adapters[1])
    assert alone[0].outputs[0].token_ids == got[5]


def test_one_gpu_slot_splits_the_batch_and_evicts_to_the_cpu(model_dir, adapters, oracles):
    llm = LLM(model_dir, **{**OPTIONS, "max_loras": 1, "max_cpu_loras": 1})
    try:
        check_mixed(llm, adapters, oracles)
        check_mixed(llm, adapters, oracles)   # adapters read again from disk (one kept on the host)
    finally:
        llm.shutdown()


def test_tensor_parallel_splits_the_adapters_with_their_layers(model_dir, adapters, oracles):
    llm = LLM(model_dir, tensor_parallel_size=2, **OPTIONS)
    try:
        check_mixed(llm, adapters, oracles)
    finally:
        llm.shutdown()


def test_without_norm_folding(model_dir, adapters, oracles, monkeypatch):
    from nanovllm.models import llama
    monkeypatch.setattr(llama, "FOLD_NORMS", False)
    llm = LLM(model_dir, **OPTIONS)
    try:
        assert not any(layer.folded for layer in llm.model_runner.model.model.layers)
        check_mixed(llm, adapters, oracles)
    finally:
        llm.shutdown()


def check_one_adapter(path: str, oracle_path: str, lora: LoRARequest) -> dict:
    """Prompts alternately under the base model and lora give PEFT's greedy argmax on the model in
    oracle_path, the adapter changing the tokens; returns {layer name: whether it runs folded}."""
    oracles = {None: PeftOracle(oracle_path, None), 1: PeftOracle(oracle_path, lora)}
    llm = LLM(path, **OPTIONS)
    try:
        loras = [None, lora] * len(PROMPTS)
        prompts = [p for p in PROMPTS for _ in range(2)]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        for p, r, out in zip(prompts, loras, outs):
            oracles[r and r.lora_int_id].assert_greedy(p, out.outputs[0].token_ids)
        assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids
        return {name: lora.folded for (i, name), lora in llm.model_runner.lora.layers.items() if i == 0}
    finally:
        llm.shutdown()


def test_a_biased_layer_keeps_its_adapters_apart_from_its_weight(tmp_path):
    # Qwen2's qkv_proj has a bias: its slots' A are not folded under the weight (the shrink, then
    # the expand add to its output); the other layers fold
    path = make_model(str(tmp_path / "qwen2"), "qwen2", seed=6)
    lora = LoRARequest("q2", 1, make_adapter(path, str(tmp_path / "a"), 8, ALL, seed=3))
    folded = check_one_adapter(path, path, lora)
    assert folded == {"qkv_proj": False, "o_proj": True, "gate_up_proj": True, "down_proj": True}


def test_adapters_on_fp8_weights(tmp_path):
    # an FP8 checkpoint (compressed-tensors, per channel): every layer keeps its adapters apart;
    # PEFT on the dequantized weights is the oracle (the CPU path computes on them)
    from test_fp8 import SHAPES, save_fp8
    src = make_model(str(tmp_path / "src"), "qwen3", seed=7, **SHAPES)
    fp8 = save_fp8(src, str(tmp_path / "fp8"), "compressed-tensors")
    lora = LoRARequest("f", 1, make_adapter(fp8 + "-dequantized", str(tmp_path / "a"), 8, ALL, seed=4))
    assert not any(check_one_adapter(fp8, fp8 + "-dequantized", lora).values())


def test_the_prefix_cache_is_keyed_by_adapter(llm, adapters):
    prompt = random_prompts(1, [40], seed=11)[0]
    one = SamplingParams(temperature=0, max_tokens=1)
    first = llm.generate([prompt], one, use_tqdm=False, lora_request=adapters[0])[0]
    again = llm.generate([prompt], one, use_tqdm=False, lora_request=adapters[0])[0]
    other = llm.generate([prompt], one, use_tqdm=False, lora_request=adapters[1])[0]
    base = llm.generate([prompt], one, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0


def test_beam_search_and_chat_take_lora_requests(llm, adapters, oracles):
    from nanovllm import BeamSearchParams
    params = BeamSearchParams(beam_width=1, max_tokens=4)
    outs = llm.beam_search([PROMPTS[0], PROMPTS[0]], params, lora_request=[None, adapters[0]])
    base, tuned = (o.sequences[0].tokens[len(PROMPTS[0]):] for o in outs)
    oracles[1].assert_greedy(PROMPTS[0], tuned)
    oracles[None].assert_greedy(PROMPTS[0], base)
    assert base != tuned
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    chat = [{"role": "user", "content": "w5 w6 w7"}]
    out = llm.chat(chat, GREEDY, use_tqdm=False, lora_request=adapters[1], chat_template=template)[0]
    oracles[2].assert_greedy(out.prompt_token_ids, out.outputs[0].token_ids)


def test_bad_adapters_are_clear_errors_and_queue_nothing(llm, model_dir, adapters, tmp_path):
    assert LoRARequest is LoRARequestFromModule
    ok = [[5, 6]]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        llm.generate(ok * 2, GREEDY, use_tqdm=False,
                     lora_request=[adapters[0], LoRARequest("gone", 7, str(tmp_path / "gone"))])
    big = make_adapter(model_dir, str(tmp_path / "big"), 32, ["q_proj"], seed=3)
    with pytest.raises(ValueError, match=r"rank r=32 is more than max_lora_rank=16"):
        llm.generate(ok, GREEDY, use_tqdm=False, lora_request=LoRARequest("big", 8, big))
    head = make_adapter(model_dir, str(tmp_path / "head"), 4, ["q_proj", "lm_head"], seed=4)
    with pytest.raises(ValueError, match=r"target module\(s\) \['lm_head'\]"):
        llm.generate(ok, GREEDY, use_tqdm=False, lora_request=LoRARequest("head", 9, head))
    # a config naming a module the file's tensors do not fit
    odd = tmp_path / "odd"
    odd.mkdir()
    cfg = json.load(open(os.path.join(adapters[0].lora_path, "adapter_config.json")))
    json.dump({**cfg, "r": 4}, open(odd / "adapter_config.json", "w"))
    weights = "adapter_model.safetensors"
    os.symlink(os.path.join(adapters[0].lora_path, weights), odd / weights)
    with pytest.raises(ValueError, match="has shape"):
        llm.generate(ok, GREEDY, use_tqdm=False, lora_request=LoRARequest("odd", 10, str(odd)))
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'a'"):
        llm.generate(ok, GREEDY, use_tqdm=False, lora_request=LoRARequest("b", 1, adapters[1].lora_path))
    with pytest.raises(ValueError, match="2 LoRARequests for 1 prompts"):
        llm.generate(ok, GREEDY, use_tqdm=False, lora_request=list(adapters))
    with pytest.raises(TypeError, match="lora_request 0 is str"):
        llm.generate(ok, GREEDY, use_tqdm=False, lora_request=["a"])
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a", 0, adapters[0].lora_path)
    assert_clean(llm)
    # the engine serves the next request
    assert llm.generate(ok, GREEDY, use_tqdm=False, lora_request=adapters[0])[0].outputs[0].token_ids


def test_lora_request_without_enable_lora_is_refused(model_dir, adapters):
    llm = LLM(model_dir, device="cpu", num_kvcache_blocks=8, kvcache_block_size=16)
    try:
        with pytest.raises(ValueError, match="enable_lora=True"):
            llm.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=adapters[0])
        assert_clean(llm)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="max_cpu_loras must be an integer >= 2"):
        LLM(model_dir, device="cpu", enable_lora=True, max_loras=2, max_cpu_loras=1)


def test_slot_table_is_lru_over_what_the_step_does_not_use():
    a, b, c = (LoRARequest(n, i, "/x") for i, n in enumerate("abc", 1))
    table = SlotTable(2)
    assert table.assign([a, None, a]) == ([0, -1, 0], [(0, a)])
    assert table.assign([b]) == ([1], [(1, b)])
    assert table.assign([a]) == ([0], [])          # a used last: b is now the least recent
    assert table.assign([c, a]) == ([1, 0], [(1, c)])
    assert table.assign([b, c]) == ([0, 1], [(0, b)])   # a evicted: c is in the step


def test_interp_lora_kernels():
    from nanovllm.kernels.lora import (LoRABatch, expand_folded, expand_folded_triton, lora_reference,
                                       lora_triton)
    g = torch.Generator().manual_seed(0)
    # the fourth splits K; the last has 64-token tiles
    for slots_, rank, k, n, t in [(3, 24, 70, 90, 37), (1, 16, 64, 64, 5), (4, 48, 128, 200, 130),
                                       (2, 16, 1100, 64, 20), (3, 16, 64, 80, 1500)]:
        a = torch.randn(slots_, rank, k, generator=g)
        b = torch.randn(n, slots_, rank, generator=g)
        x, y = torch.randn(t, k, generator=g), torch.randn(t, n, generator=g)
        slots = torch.randint(-1, slots_, (t,), generator=g, dtype=torch.int32)
        want = y.clone()
        for i in range(t):
            if slots[i] >= 0:
                want[i] += b[:, slots[i]] @ (a[slots[i]] @ x[i])
        torch.testing.assert_close(lora_reference(x, y, a, b, slots), want, rtol=1e-4, atol=1e-3)
        batch = LoRABatch.of(slots, slots_)
        torch.testing.assert_close(lora_triton(x, y.clone(), a, b, batch), want, rtol=1e-4, atol=1e-3)
        # folded: y and every slot's A x from one GEMM ([W; A]); then y's columns + B (A x), or that
        # added into a residual
        w = torch.randn(n, k, generator=g)
        yf = x @ torch.cat([w, a.reshape(-1, k)]).t()
        want = lora_reference(x, x @ w.t(), a, b, slots)
        residual = torch.randn(t, n, generator=g)
        for fold in (expand_folded, expand_folded_triton):
            torch.testing.assert_close(fold(yf, b, batch), want, rtol=1e-4, atol=1e-3)
            torch.testing.assert_close(fold(yf, b, batch, residual.clone()), residual + want,
                                       rtol=1e-4, atol=1e-3)


@pytest.mark.skipif(INTERPRETED, reason="the subprocess itself")
def test_lora_kernels_under_the_interpreter():
    run_interpreted_tests(__file__)


test_interp_lora_kernels = interp(test_interp_lora_kernels)


def test_the_scheduler_runs_no_more_adapters_than_slots():
    from nanovllm.engine.scheduler import Scheduler
    from nanovllm.engine.sequence import Sequence
    a, b = LoRARequest("a", 1, "/x"), LoRARequest("b", 2, "/x")
    sched = Scheduler(8, 64, 64, num_blocks=32, block_size=4, eos_token_ids={1}, max_loras=1)
    seqs = [Sequence([5, 6, 7], SamplingParams(max_tokens=2), lora_request=r) for r in (a, None, b, a, None)]
    for seq in seqs:
        sched.add(seq)
    first = sched.schedule()
    # b waits (a holds the one slot); the prompts behind it, of a and of the base model, go first
    assert first.is_prefill and first.seqs == [seqs[0], seqs[1], seqs[3], seqs[4]]
    assert list(sched.waiting) == [seqs[2]]
    sched.postprocess(first, [9] * len(first.seqs))
    batch = sched.schedule()
    assert batch.seqs == first.seqs and not batch.is_prefill   # decode of what runs; b still waits
    while True:
        sched.postprocess(batch, [9] * len(batch.sampling_seqs))
        assert len({s.lora_int_id for s in sched.running} - {None}) <= 1
        if sched.is_finished():
            break
        batch = sched.schedule()
    assert all(s.is_finished and s.num_completion_tokens == 2 for s in seqs)   # b ran once a finished


def test_a_chunk_behind_a_skipped_adapter_goes_first_next_step():
    """A prompt chunked while an earlier one waits for a slot continues before it: its blocks are held,
    and the waiting prompt must not take the cache first."""
    from nanovllm.engine.scheduler import Scheduler
    from nanovllm.engine.sequence import Sequence
    a, b = LoRARequest("a", 1, "/x"), LoRARequest("b", 2, "/x")
    sched = Scheduler(8, 8, 64, num_blocks=32, block_size=4, eos_token_ids={1}, max_loras=1)
    first, blocked, long = (Sequence(list(range(5, 5 + n)), SamplingParams(max_tokens=2), lora_request=r)
                            for n, r in ((3, a), (3, b), (12, None)))
    for seq in (first, blocked, long):
        sched.add(seq)
    batch = sched.schedule()
    assert batch.seqs == [first, long] and batch.num_new_tokens == [3, 5]   # long: a chunk of 5
    assert list(sched.waiting) == [long, blocked]
    sched.postprocess(batch, [9] * len(batch.sampling_seqs))
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs[0] is long
