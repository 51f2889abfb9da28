"""vLLM's offline API on the tiny Qwen3 model: constructor options, default sampling params,
EngineArgs, prompt dicts, stop semantics, SamplingParams extras, prompt logprobs, beam search, chat."""
import pytest
import torch

from conftest import EOS, REPO, HFOracle, make_model, tokens
from nanovllm import LLM, LoRARequest, SamplingParams
from nanovllm.config import Config

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ENGINE = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=200)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, **ENGINE)


# ---- constructor options ------------------------------------------------------------------

@pytest.mark.parametrize("dtype, name", [
    ("auto", "auto"), ("half", "float16"), ("float16", "float16"), ("bfloat16", "bfloat16"),
    ("float", "float32"), ("float32", "float32"), (torch.float16, "float16"), (torch.bfloat16, "bfloat16"),
    (torch.float32, "float32")])
def test_dtype_spellings(qwen3_dir, dtype, name):
    assert Config.create(qwen3_dir, dtype=dtype).dtype == name


@pytest.mark.parametrize("options, message", [
    (dict(dtype="fp16"), "dtype must be one of"), (dict(dtype=torch.int8), "dtype must be one of"),
    (dict(tokenizer_mode="mistral"), "tokenizer_mode must be one of"),
    (dict(generation_config="nowhere"), "generation_config must be"),
    (dict(hf_overrides=3), "hf_overrides must be a dict"),
    (dict(max_logprobs=-2), "max_logprobs must be an integer >= -1"),
    (dict(trust_remote_code="yes"), "trust_remote_code must be True or False"),
    (dict(disable_log_stats=None), "disable_log_stats must be True or False"),
    (dict(revision=3), "revision must be a string"),
])
def test_bad_option_values(qwen3_dir, options, message):
    with pytest.raises(ValueError, match=message):
        Config.create(qwen3_dir, **options)


def test_version_has_one_source():
    # vLLM's vllm.__version__; the server's /version and the package metadata read the same constant
    import re

    import nanovllm
    from nanovllm.version import __version__
    assert nanovllm.__version__ == __version__ and re.fullmatch(r"\d+\.\d+\.\d+\S*", __version__)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and '{attr = "nanovllm.version.__version__"}' in pyproject
    assert not re.search(r"^version\s*=\s*\"", pyproject, re.MULTILINE)   # no second copy


def test_unknown_option_is_type_error(qwen3_dir):
    with pytest.raises(TypeError, match="unknown option.*'swap_spac'"):
        LLM(qwen3_dir, swap_spac=4)


def test_vllm_options_accepted(qwen3_dir):
    c = Config.create(qwen3_dir, tokenizer=qwen3_dir, tokenizer_mode="slow", revision="main",
                      trust_remote_code=True, seed=None, disable_log_stats=False, generation_config="vllm",
                      max_logprobs=-1)
    assert isinstance(c.seed, int) and c.tokenizer == qwen3_dir and c.max_logprobs == -1


def test_vllm_s_names_and_no_op_settings_are_accepted(qwen3_dir, tmp_path):
    # as vLLM scripts pass them: block_size is kvcache_block_size; the rest mean what nanovllm does
    c = Config.create(qwen3_dir, block_size=32, swap_space=4, max_seq_len_to_capture=8192,
                      enable_chunked_prefill=True, quantization=None, task="generate",
                      skip_tokenizer_init=False, download_dir=str(tmp_path))
    assert c.kvcache_block_size == c.block_size == 32
    assert Config.create(qwen3_dir, kvcache_block_size=48).block_size == 48
    for bad, message in [(dict(block_size=16, kvcache_block_size=32), "name the same setting"),
                         (dict(quantization=4), "quantization must be a method name"),
                         (dict(enable_chunked_prefill=False), "always chunks"),
                         (dict(task="embed"), "task must be one of"),
                         (dict(swap_space=-1), "swap_space must be"),
                         (dict(block_size=0), "block_size must be an integer >= 1")]:
        with pytest.raises(ValueError, match=message):
            Config.create(qwen3_dir, **bad)


def test_skip_tokenizer_init_serves_token_ids(qwen3_dir):
    llm = LLM(qwen3_dir, skip_tokenizer_init=True, **ENGINE)
    assert llm.get_tokenizer() is None
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.text == ""
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["w5 w6"], use_tqdm=False)


def test_vllm_s_small_helpers(llm):
    # methods and fields vLLM scripts reach for
    assert llm.llm_engine.model_config.max_model_len == ENGINE["max_model_len"]
    assert llm.llm_engine.model_config.hf_config.vocab_size > 0
    params = SamplingParams(temperature=0.5, stop=["x"])
    copy = params.clone()
    copy.stop.append("y")
    assert copy.temperature == 0.5 and params.stop == ["x"]
    assert vars(SamplingParams.from_optional(temperature=None, top_p=0.5)) == vars(SamplingParams(top_p=0.5))
    out = llm.generate([[5, 6]], SamplingParams(max_tokens=1), use_tqdm=None)[0]   # None: no bar
    assert out.metrics is None and out.lora_request is None and out.outputs[0].lora_request is None
    # reset_prefix_cache: a cached prefix is forgotten (and refused while requests are queued)
    prompt = list(range(10, 60))
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0].num_cached_tokens > 0
    llm.add_request([5, 6], SamplingParams(max_tokens=1))
    assert llm.reset_prefix_cache() is False
    while not llm.is_finished():
        llm.step()
    assert llm.reset_prefix_cache() is True
    assert llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0].num_cached_tokens == 0


def test_hf_overrides_dict_and_function(qwen3_dir):
    assert Config.create(qwen3_dir, hf_overrides={"max_position_embeddings": 64}).max_model_len == 64

    def shorter(cfg):
        cfg.max_position_embeddings = 32
        return cfg
    c = Config.create(qwen3_dir, hf_overrides=shorter)
    assert c.max_model_len == 32 and c.hf_config.max_position_embeddings == 32
    import pickle
    assert pickle.loads(pickle.dumps(c)).hf_config.max_position_embeddings == 32   # TP workers get it applied


def test_tokenizer_from_another_folder(tmp_path, qwen3_dir):
    bare = make_model(str(tmp_path / "bare"), tokenizer=False)
    llm = LLM(bare, tokenizer=qwen3_dir, **ENGINE)
    out = llm.generate("w5 w6 w7", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert out[0].prompt_token_ids == [5, 6, 7] and len(out[0].outputs[0].token_ids) == 3


# ---- default sampling params, llm_engine, EngineArgs ----------------------------------------

def test_default_sampling_params_from_generation_config(tmp_path, qwen3_dir):
    import json
    import shutil
    folder = tmp_path / "m"
    shutil.copytree(qwen3_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 7, "eos_token_id": EOS}))
    llm = LLM(str(folder), **ENGINE)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.6, 0.95, 20, 7)
    out = llm.generate([[5, 6, 7]], use_tqdm=False)   # no params: the defaults
    assert len(out[0].outputs[0].token_ids) <= 7
    plain = LLM(str(folder), generation_config="vllm", **ENGINE).get_default_sampling_params()
    assert (plain.temperature, plain.top_p, plain.max_tokens) == (1.0, 1.0, 16)


def test_llm_engine_and_tokenizer(llm):
    assert llm.llm_engine.get_tokenizer() is llm.get_tokenizer() is llm.tokenizer
    assert llm.get_default_sampling_params() == SamplingParams()   # the tiny model has no generation config


def test_engine_args_on_argparse(qwen3_dir):
    import argparse
    import dataclasses
    from nanovllm import EngineArgs
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", qwen3_dir, "--max-model-len", "200", "--kvcache-block-size", "16",
                              "--num-kvcache-blocks", "64", "--no-enable-prefix-caching", "--dtype", "float",
                              "--hf-overrides", '{"max_position_embeddings": 300}', "--seed", "3"])
    llm = LLM(**vars(args))
    c = llm.config
    assert (c.max_model_len, c.enable_prefix_caching, c.dtype, c.seed) == (200, False, "float32", 3)
    e = EngineArgs.from_cli_args(args)
    assert e.max_num_seqs == 512 and LLM(**dataclasses.asdict(e)).config.num_kvcache_blocks == 64
    # vLLM's --block-size, through EngineArgs (which passes every option, kvcache_block_size too)
    vllm_style = EngineArgs.from_cli_args(parser.parse_args(["--model", qwen3_dir, "--block-size", "32"]))
    assert Config.create(**dataclasses.asdict(vllm_style)).kvcache_block_size == 32
    assert Config.create(**dataclasses.asdict(EngineArgs(model=qwen3_dir))).kvcache_block_size == 256


# ---- prompt dicts -----------------------------------------------------------------------------

def test_tokens_and_text_prompts(llm):
    import nanovllm
    from nanovllm.inputs import TextPrompt, TokensPrompt
    assert nanovllm.TokensPrompt is TokensPrompt and nanovllm.TextPrompt is TextPrompt
    greedy = SamplingParams(temperature=0, max_tokens=3)
    outs = llm.generate([TextPrompt(prompt="w5 w6 w7"), TokensPrompt(prompt_token_ids=[5, 6, 7]),
                         TokensPrompt(prompt_token_ids=[5, 6, 7], prompt="w5 w6 w7")], greedy, use_tqdm=False)
    assert tokens(outs)[0] == tokens(outs)[1] == tokens(outs)[2]
    assert [o.prompt for o in outs] == ["w5 w6 w7", None, "w5 w6 w7"]   # a TokensPrompt's text is reported
    with pytest.raises(ValueError, match=r"prompt 0: prompt key\(s\) \['multi_modal_data'\] are not"):
        llm.generate({"prompt": "w5", "multi_modal_data": {"image": None}}, greedy, use_tqdm=False)


# ---- stop semantics (vLLM v1) -------------------------------------------------------------------

@pytest.mark.parametrize("skip", [True, False])
def test_stop_token_stays_in_ids_not_in_text(llm, skip):
    free = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    ids = tokens(free)[0]
    k = next(i for i in range(1, 8) if ids[i] not in ids[:i] and ids[i] > 2)   # an ordinary word, "w<id>"
    stop_id = ids[k]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id],
                            skip_special_tokens=skip)
    c = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert c.token_ids == ids[:k + 1] and (c.finish_reason, c.stop_reason) == ("stop", stop_id)
    assert c.text == "".join(f" w{t}" for t in ids[:k])   # read after the prompt: " w5 w6 w7" + text
    params.include_stop_str_in_output = True
    assert llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].text.endswith(f"w{stop_id}")


def test_generation_config_eos_ids_stop_with_their_id(tmp_path, qwen3_dir, llm):
    # vLLM: the tokenizer's EOS ends with stop_reason None; generation_config.json's other EOS ids
    # are stop tokens (stop_reason = the id) unless ignore_eos
    import json
    import shutil
    ids = tokens(llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                              use_tqdm=False))[0]
    k = next(i for i in range(1, 8) if ids[i] not in ids[:i] and ids[i] > 2)
    folder = tmp_path / "m"
    shutil.copytree(qwen3_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, ids[k]]}))
    other = LLM(str(folder), **ENGINE)
    c = other.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert list(c.token_ids) == ids[:k + 1] and (c.finish_reason, c.stop_reason) == ("stop", ids[k])
    free = other.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert list(free.token_ids) == ids and free.finish_reason == "length"


def _sentencepiece_style_tokenizer():
    """Words as Llama 2's tokenizer writes them ("▁w5"), decoded by its decoder, which drops the
    first token's leading space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from conftest import VOCAB
    vocab = {"<s>": 0, "</s>": EOS, "<unk>": 2, **{f"▁w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_output_text_reads_after_the_prompt_with_a_sentencepiece_tokenizer(tmp_path):
    # vLLM decodes an output behind the prompt's last tokens: its text keeps the first word's
    # leading space, and a stop string may begin with it
    path = make_model(str(tmp_path), "qwen3", tokenizer=False)
    tokenizer = _sentencepiece_style_tokenizer()
    tokenizer.save_pretrained(path)
    llm = LLM(path, **ENGINE)
    prompt = "w5 w6 w7"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    whole = tokenizer.decode(ids + list(free.token_ids))
    assert free.text == whole[len(tokenizer.decode(ids)):] and free.text.startswith(" w")
    first = f" w{free.token_ids[0]}"
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop=[first])
    stopped = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (stopped.text, stopped.stop_reason, len(stopped.token_ids)) == ("", first, 1)
    params.include_stop_str_in_output = True
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text == first


# ---- SamplingParams extras ------------------------------------------------------------------------

def test_sampling_params_vllm_spellings():
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(logprobs=True).logprobs == 1
    assert SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    assert SamplingParams(logprobs=-1).logprobs == -1
    assert SamplingParams(logit_bias={"7": 500, 8: -3}).logit_bias == {7: 100.0, 8: -3.0}   # clamped as vLLM
    for bad, message in [(dict(logprobs=-2), "logprobs must be an integer >= 0, -1"),
                         (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
                         (dict(allowed_token_ids=[-1]), "allowed_token_ids must be a list of integers"),
                         (dict(logit_bias={"x": 1}), "logit_bias keys must be token ids"),
                         (dict(logit_bias={3: "big"}), r"logit_bias\[3\] must be a number"),
                         (dict(bad_words=[""]), "bad_words must be a non-empty string"),
                         (dict(detokenize=False, stop=["x"]), "stop strings need detokenize=True"),
                         (dict(spaces_between_special_tokens=1), "spaces_between_special_tokens must")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**bad)


def test_engine_checks_of_new_params(llm):
    for params, message in [(SamplingParams(logit_bias={512: 1.0}), "logit_bias token ids must be in"),
                            (SamplingParams(allowed_token_ids=[600]), "allowed_token_ids token ids must"),
                            (SamplingParams(logprobs=21), "logprobs=21 is more than max_logprobs=20"),
                            (SamplingParams(prompt_logprobs=-1), "prompt_logprobs=-1 is more than")]:
        with pytest.raises(ValueError, match=message):
            llm.generate([[5, 6]], params, use_tqdm=False)


def test_generate_and_chat_take_vllm_s_lora_request_and_priority_at_their_defaults(llm):
    # vLLM code (lm-eval-harness, say) passes lora_request=None explicitly
    greedy = SamplingParams(temperature=0, max_tokens=2)
    want = tokens(llm.generate([[5, 6]], greedy, use_tqdm=False))
    assert tokens(llm.generate([[5, 6]], greedy, use_tqdm=False, lora_request=None, priority=[0])) == want
    chat = [{"role": "user", "content": "w5"}]
    out = llm.chat(chat, greedy, use_tqdm=False, chat_template=TEMPLATE, lora_request=None)[0]
    assert out.outputs[0].token_ids
    for options, message in [(dict(lora_request=LoRARequest("x", 1, "/nowhere")), "no LoRA adapters"),
                             (dict(priority=[1]), "first come, first served"),
                             (dict(priority=[0, 0]), "2 entries for 1 prompts")]:
        with pytest.raises(ValueError, match=message):
            llm.generate([[5, 6]], greedy, use_tqdm=False, **options)


def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens(llm):
    # vLLM's left truncation: the output is the one the last k tokens alone give
    prompt = list(range(5, 45))
    greedy = dict(temperature=0, max_tokens=4, ignore_eos=True)
    cut = llm.generate([prompt], SamplingParams(truncate_prompt_tokens=6, **greedy), use_tqdm=False)[0]
    alone = llm.generate([prompt[-6:]], SamplingParams(**greedy), use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-6:] and tokens([cut]) == tokens([alone])
    queued = llm.llm_engine.add_request(prompt, SamplingParams(truncate_prompt_tokens=6, **greedy))
    assert queued[0].prompt_token_ids == prompt[-6:]
    llm.llm_engine.abort(queued)
    # -1: as much as max_model_len (200) leaves room for, one output token; a longer prompt is refused
    long = [5 + i % 400 for i in range(250)]
    out = llm.generate([long], SamplingParams(truncate_prompt_tokens=-1, temperature=0, max_tokens=None),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-199:] and len(out.outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match="too many for max_model_len"):
        llm.generate([long], SamplingParams(**greedy), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt 0: truncate_prompt_tokens=200 leaves no room for output"):
        llm.generate([long], SamplingParams(truncate_prompt_tokens=200, **greedy), use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1"):
        SamplingParams(truncate_prompt_tokens=0)


def test_logit_bias_and_allowed_token_ids(qwen3_dir, llm):
    prompt = [5, 6, 7, 8]
    biased = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                   logit_bias={42: 100.0}), use_tqdm=False)
    assert tokens(biased)[0] == [42] * 5
    allowed = [11, 200, 300, 400]
    outs = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                 allowed_token_ids=allowed), use_tqdm=False)
    ids = tokens(outs)[0]
    oracle = HFOracle(qwen3_dir)
    logits = oracle.logits(prompt + ids)
    for i, t in enumerate(ids):   # each token is the best of the allowed ones
        row = logits[len(prompt) - 1 + i]
        assert t in allowed and row[t] >= row[allowed].max() - 1e-3
    sampled = llm.generate([prompt] * 4, SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True,
                                                        allowed_token_ids=allowed, seed=1), use_tqdm=False)
    assert all(set(t) <= set(allowed) for t in tokens(sampled))


def test_raw_logprobs_are_not_biased(llm):
    plain = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=1, logprobs=1), use_tqdm=False)
    biased = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=1, logprobs=1,
                                                      logit_bias={42: 100.0}), use_tqdm=False)
    assert biased[0].outputs[0].token_ids == [42]
    lp_plain = plain[0].outputs[0].logprobs[0]
    top = next(iter(lp_plain))
    assert biased[0].outputs[0].logprobs[0][top].logprob == pytest.approx(lp_plain[top].logprob, abs=1e-5)


def test_bad_words_single_and_multi_token(llm):
    prompt = [5, 6, 7]
    free = tokens(llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                               use_tqdm=False))[0]
    a = free[0]
    no_a = tokens(llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                        bad_words=[f"w{a}"]), use_tqdm=False))[0]
    assert a not in no_a
    # Two words: the second may not follow the first, but each alone is fine.
    pair = f"w{free[0]} w{free[1]}"
    out = tokens(llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                       bad_words=[pair]), use_tqdm=False))[0]
    assert out[0] == free[0] and out[1] != free[1]
    assert all(out[i:i + 2] != free[:2] for i in range(len(out) - 1))


def test_detokenize_false(llm):
    p = dict(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    with_text, ids_only = (llm.generate([[5, 6, 7]], SamplingParams(**p, detokenize=d),
                                        use_tqdm=False)[0].outputs[0] for d in (True, False))
    assert ids_only.token_ids == with_text.token_ids and with_text.text and ids_only.text == ""
    assert all(lp.decoded_token is None for d in ids_only.logprobs for lp in d.values())


@pytest.mark.parametrize("engine", [dict(), dict(max_num_batched_tokens=16), dict(max_num_batched_tokens=13)],
                         ids=["whole", "chunked", "last-chunk-one-token"])
def test_prompt_logprobs_match_transformers(qwen3_dir, engine):
    # 13: chunks of 13, 13, 13 and 1; the last has no prompt position to score while the earlier
    # chunks' logprobs are still on their way to the host (async scheduling)
    llm = LLM(qwen3_dir, **{**ENGINE, **engine})
    prompt = list(range(10, 50))   # 40 tokens: over two full blocks of 16
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    # Fills the prefix cache.
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0   # prompt logprobs compute every position, as vLLM (no cache hits)
    lp = out.prompt_logprobs
    assert len(lp) == len(prompt) and lp[0] is None
    ref = torch.log_softmax(HFOracle(qwen3_dir).logits(prompt), dim=-1)
    for i in range(1, len(prompt)):
        entry, row = lp[i], ref[i - 1]
        tok = prompt[i]
        assert list(entry)[0] == tok and entry[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(3)
        for rank, (value, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert entry[t].logprob == pytest.approx(value, abs=1e-4)
            assert t == tok or entry[t].rank == rank
        assert entry[tok].decoded_token == f"w{tok}"
    again = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert again.num_cached_tokens == 32 and again.prompt_logprobs is None   # two full blocks from the cache
    one = llm.generate([[5]], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]


# ---- beam search ----------------------------------------------------------------------------------

def test_beam_search_params_validation():
    from nanovllm.sampling_params import BeamSearchParams
    for bad, message in [(dict(beam_width=0, max_tokens=3), "beam_width must be an integer >= 1"),
                         (dict(beam_width=2, max_tokens=0), "max_tokens must be an integer >= 1"),
                         (dict(beam_width=2, max_tokens=3, temperature=-1), "temperature must be a number")]:
        with pytest.raises(ValueError, match=message):
            BeamSearchParams(**bad)


def test_beam_search_takes_vllm_s_arguments(llm):
    from nanovllm import BeamSearchParams
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    prompts = ["w5 w6", "w7", [9, 10, 11]]
    whole = llm.beam_search(prompts, params, lora_request=None, use_tqdm=False)
    bars = []

    class Bar:   # one bar over the token steps, as vLLM draws it
        def __init__(self, **kwargs):
            self.kwargs, self.n, self.closed = kwargs, 0, False
            bars.append(self)

        def update(self, n):
            self.n += n

        def close(self):
            self.closed = True
    two_at_a_time = llm.beam_search(prompts, params, use_tqdm=Bar, concurrency_limit=2)
    assert [[b.tokens for b in o.sequences] for o in two_at_a_time] == \
        [[b.tokens for b in o.sequences] for o in whole]
    assert len(bars) == 1 and bars[0].kwargs["desc"] == "Beam search" and bars[0].closed
    assert bars[0].n == bars[0].kwargs["total"] == 2 * 3   # two chunks of three steps
    # beams that reach max_model_len early: the bar still ends full
    llm.beam_search([[5] * (ENGINE["max_model_len"] - 1)], params, use_tqdm=Bar)
    assert bars[1].n == bars[1].kwargs["total"] == 3
    with pytest.raises(ValueError, match="lora_request"):
        llm.beam_search(prompts, params, lora_request=LoRARequest("x", 1, "/nowhere"))
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search(prompts, params, concurrency_limit=0)
    with pytest.raises(ValueError, match=r"beam_width=11 needs the 22 most likely tokens.*beam_width <= 10"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=11, max_tokens=1))


def test_beam_search_best_beam_is_exhaustive_best(tmp_path):
    """A 24-token vocabulary, 2 new tokens, beam_width = vocabulary: the best beam's score is the
    best score over every continuation of up to two tokens (an EOS ends one early)."""
    from nanovllm import BeamSearchParams
    vocab, prompt = 24, [5, 6, 7, 8]
    folder = make_model(str(tmp_path / "v24"), vocab_size=vocab, tokenizer=False)
    llm = LLM(folder, max_logprobs=-1, **ENGINE)
    out = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=vocab, max_tokens=2))[0]
    oracle = HFOracle(folder)
    first = torch.log_softmax(oracle.logits(prompt)[-1], dim=-1)
    best = first[EOS].item() / len(prompt)   # [EOS]: the EOS does not count in the length
    for t in range(vocab):
        if t == EOS:
            continue
        second = torch.log_softmax(oracle.logits(prompt + [t])[-1], dim=-1)
        for u in range(vocab):
            length = len(prompt) + 2 - (u == EOS)
            best = max(best, (first[t] + second[u]).item() / length)
    top = out.sequences[0]
    length = len(top.tokens) - (top.tokens[-1] == EOS)
    assert top.tokens[:len(prompt)] == prompt and top.cum_logprob / length == pytest.approx(best, abs=1e-4)
    assert len(out.sequences) == vocab
    scores = [s.cum_logprob / (len(s.tokens) - (s.tokens[-1] == EOS)) for s in out.sequences]
    assert scores == sorted(scores, reverse=True)


def test_beam_search_shares_prompt_blocks_and_width_one_is_greedy(llm, monkeypatch):
    from nanovllm import BeamSearchParams
    prompt = list(range(10, 50))   # two full blocks of 16
    cached = []
    generate = llm.generate

    def spy(*args, **kwargs):
        outs = generate(*args, **kwargs)
        cached.append([o.num_cached_tokens for o in outs])
        return outs
    monkeypatch.setattr(llm, "generate", spy)
    out = llm.beam_search(["w5 w6 w7", {"prompt_token_ids": prompt}],
                          BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True))
    assert [len(o.sequences) for o in out] == [3, 3]
    assert all(len(s.tokens) == 3 + 4 for s in out[0].sequences)
    assert out[0].sequences[0].text.startswith("w5 w6 w7")
    assert all(n >= 32 for n in cached[-1][-3:])   # the long prompt's beams read its blocks from the cache
    monkeypatch.undo()
    greedy = tokens(llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                                 use_tqdm=False))[0]
    one = llm.beam_search([{"prompt_token_ids": prompt}],
                          BeamSearchParams(beam_width=1, max_tokens=4, ignore_eos=True))
    assert one[0].sequences[0].tokens == prompt + greedy


# ---- chat -------------------------------------------------------------------------------------------

TEMPLATE = ("{% if tools %}w{{ 10 + tools | length }} {% endif %}{% for m in messages %}{{ m['content'] }} "
            "{% endfor %}{% if add_generation_prompt %}w9{% endif %}")


def test_chat_template_tools_and_content_parts(llm, tmp_path):
    greedy = SamplingParams(temperature=0, max_tokens=2)
    parts = [{"type": "text", "text": "w5"}, {"type": "text", "text": "w6"}]
    out = llm.chat([{"role": "user", "content": parts}],
                   greedy, use_tqdm=False, chat_template=TEMPLATE)[0]
    assert out.prompt == "w5\nw6 w9" and out.prompt_token_ids == [5, 6, 9]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}] * 2
    out = llm.chat([{"role": "user", "content": "w5"}], greedy, use_tqdm=False, chat_template=TEMPLATE,
                   tools=tools)[0]
    assert out.prompt_token_ids == [12, 5, 9]
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert llm.chat([[{"role": "user", "content": "w7"}]], greedy, use_tqdm=False,
                    chat_template=str(path))[0].prompt_token_ids == [7, 9]


def test_chat_takes_vllm_s_arguments(llm):
    greedy = SamplingParams(temperature=0, max_tokens=2)
    conversation = [{"role": "user", "content": "w5"}]
    # vLLM's order: lora_request is the fourth argument; its multimodal and tokenization options at
    # their defaults; chat_template_kwargs override the named defaults, as in vLLM
    out = llm.chat(conversation, greedy, False, None, TEMPLATE, mm_processor_kwargs=None,
                   tokenization_kwargs=None)[0]
    assert out.prompt_token_ids == [5, 9]
    bare = llm.chat(conversation, greedy, use_tqdm=False, chat_template=TEMPLATE,
                    chat_template_kwargs={"add_generation_prompt": False})[0]
    assert bare.prompt_token_ids == [5]
    with pytest.raises(ValueError, match="tokenization_kwargs"):
        llm.chat(conversation, greedy, chat_template=TEMPLATE, tokenization_kwargs={"truncation": True})
    with pytest.raises(ValueError, match="may not set 'tokenize'"):
        llm.chat(conversation, greedy, chat_template=TEMPLATE, chat_template_kwargs={"tokenize": True})


def test_chat_of_no_conversations_is_no_outputs(llm):
    # as vLLM's chat and as generate([]): [] is an empty batch, not a malformed conversation
    assert llm.chat([]) == [] and llm.chat([], use_tqdm=False) == [] and llm.generate([]) == []
    with pytest.raises(TypeError, match="messages must be a conversation"):
        llm.chat("hello")


def test_chat_errors(llm):
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        llm.chat([{"role": "user", "content": "w5"}])
    with pytest.raises(ValueError, match=r"conversation 1, message 1 \(role 'assistant'\) has no 'content'"):
        llm.chat([[{"role": "user", "content": "w5"}],
                  [{"role": "user", "content": "w5"}, {"role": "assistant"}]], chat_template=TEMPLATE)
    with pytest.raises(ValueError, match="continue_final_message=True continues the last message"):
        llm.chat([{"role": "user", "content": "w5"}], chat_template=TEMPLATE, continue_final_message=True)
    with pytest.raises(ValueError, match="content part of type 'image_url' is not supported"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                 chat_template=TEMPLATE)
    # a template that refuses the conversation, or does not parse: a ValueError naming it (a 400 when served)
    with pytest.raises(ValueError, match="conversation 0: the chat template failed: roles must alternate"):
        llm.chat([{"role": "user", "content": "w5"}],
                 chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="conversation 0: the chat template failed"):
        llm.chat([{"role": "user", "content": "w5"}], chat_template="{{ 'unclosed }}")


# ---- progress bar -----------------------------------------------------------------------------------

def test_progress_bar_counts_prompts_and_takes_a_callable(llm):
    import io
    from functools import partial

    from tqdm import tqdm
    bars = []

    def make(**kwargs):
        bar = tqdm(file=io.StringIO(), **kwargs)
        bars.append(bar)
        return bar
    outs = llm.generate([[5, 6], [7, 8, 9]], SamplingParams(n=3, max_tokens=4, ignore_eos=True),
                        use_tqdm=make)
    bar = bars[0]
    assert bar.total == 2 and bar.n == 2 and len(outs) == 2   # prompts, not the 6 sequences
    assert "est. speed input" in bar.postfix and "output" in bar.postfix
    # It draws when prompts finish, not every step: four that finish together draw the empty bar
    # and then the full one, once.
    log = io.StringIO()
    llm.generate([[5, 6]] * 4, SamplingParams(max_tokens=20, ignore_eos=True),
                 use_tqdm=partial(tqdm, file=log))
    assert log.getvalue().count("\r") == 2 and log.getvalue().count("4/4") == 1
    with pytest.raises(TypeError, match="use_tqdm must be True, False or a tqdm-like callable"):
        llm.generate([[5]], use_tqdm="yes")


def test_progress_bar_draws_as_vllm_s(llm):
    """vLLM's bar (LLM._run_engine): it advances as each prompt finishes, draws the full bar once,
    and its speeds are the finished prompts' tokens over the time: each prompt's tokens once per
    completion, cached or not, and every output token."""
    import io
    import re

    from tqdm import tqdm
    log = io.StringIO()

    class Bar(tqdm):   # tqdm drawing every update (no minimum interval) into `log`
        def __init__(self, **kwargs):
            super().__init__(file=log, **{**kwargs, "mininterval": 0})
    prefix = [5, 6, 7, 8] * 4   # one block, which the second prompt may find cached
    params = [SamplingParams(max_tokens=k, n=n, ignore_eos=True) for k, n in ((3, 2), (6, 1), (9, 1))]
    outs = llm.generate([prefix, prefix + [9], [5, 6]], params, use_tqdm=Bar)
    lines = [line for line in log.getvalue().split("\r") if line.strip()]
    assert [re.search(r"(\d)/3 ", line)[1] for line in lines] == ["0", "1", "2", "3"]
    speeds = re.search(r"input: ([\d.]+) toks/s, output: ([\d.]+) toks/s", lines[-1])
    prompt_tokens = sum(len(o.prompt_token_ids) * len(o.outputs) for o in outs)   # 2 * 16 + 17 + 2
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)        # 2 * 3 + 6 + 9
    assert float(speeds[1]) / float(speeds[2]) == pytest.approx(prompt_tokens / output_tokens, rel=1e-3)
    assert "input: 0.00 toks/s, output: 0.00 toks/s" in lines[0]


def test_log_stats_when_asked(qwen3_dir, caplog):
    import logging
    llm = LLM(qwen3_dir, disable_log_stats=False, **ENGINE)
    with caplog.at_level(logging.INFO, logger="nanovllm.engine.llm_engine"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert "generate: 1 prompts, est. speed input" in caplog.text


# ---- on the GPU (skipped without CUDA) ----------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_new_sampling_features_on_gpu(qwen3_dir):
    """With CUDA graphs and async scheduling: rows that take the sampler's torch path (logit_bias,
    allowed_token_ids, bad_words) in one batch with a plain sampled row and a chunked prompt with
    prompt_logprobs; a plain sampled batch alone still takes the fused kernel."""
    from nanovllm import BeamSearchParams
    llm = LLM(qwen3_dir, device="cuda", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=64,
              max_model_len=200, max_num_batched_tokens=32)
    prompt = list(range(10, 50))
    free = tokens(llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                               use_tqdm=False))[0]
    allowed = [11, 200, 300]
    params = [SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True, seed=3),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={42: 100.0}),
              SamplingParams(temperature=0.9, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[f"w{free[0]}"]),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=2)]
    outs = llm.generate([prompt] * 5, params, use_tqdm=False)
    fused = llm.generate([prompt] * 2, params[0], use_tqdm=False)   # temperature only: the fused kernel
    assert tokens(fused)[0] == tokens(fused)[1] and len(tokens(fused)[0]) == 8   # same seed, same tokens
    ids = tokens(outs)
    assert ids[1] == [42] * 8 and set(ids[2]) <= set(allowed) and free[0] not in ids[3] and ids[4] == free
    ref = torch.log_softmax(HFOracle(qwen3_dir).logits(prompt), dim=-1)
    lp = outs[4].prompt_logprobs
    assert lp[0] is None and len(lp) == len(prompt)
    for i in range(1, len(prompt)):
        assert lp[i][prompt[i]].logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-3)
    one = llm.beam_search([{"prompt_token_ids": prompt}],
                          BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))
    assert one[0].sequences[0].tokens == prompt + free
