"""vLLM's offline API on the tiny Qwen3 model: constructor options, default sampling params,
EngineArgs, prompt dicts, stop semantics, SamplingParams extras, prompt logprobs, beam search, chat."""
import pytest
import torch

from conftest import EOS, HFOracle, make_model, tokens
from nanovllm import LLM, SamplingParams
from nanovllm.config import Config

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ENGINE = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=200)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, **ENGINE)


# ---- constructor options ------------------------------------------------------------------

@pytest.mark.parametrize("dtype, name", [("auto", "auto"), ("half", "float16"), ("float16", "float16"),
                                         ("bfloat16", "bfloat16"), ("float", "float32"), ("float32", "float32"),
                                         (torch.float16, "float16"), (torch.bfloat16, "bfloat16"),
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


def test_unknown_option_is_type_error(qwen3_dir):
    with pytest.raises(TypeError, match="unknown option.*'swap_spac'"):
        LLM(qwen3_dir, swap_spac=4)


def test_vllm_options_accepted(qwen3_dir):
    c = Config.create(qwen3_dir, tokenizer=qwen3_dir, tokenizer_mode="slow", revision="main", trust_remote_code=True,
                      seed=None, disable_log_stats=False, generation_config="vllm", max_logprobs=-1)
    assert isinstance(c.seed, int) and c.tokenizer == qwen3_dir and c.max_logprobs == -1


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
    with pytest.raises(ValueError, match=r"prompt 0: prompt key\(s\) \['multi_modal_data'\] are not supported"):
        llm.generate({"prompt": "w5", "multi_modal_data": {"image": None}}, greedy, use_tqdm=False)


# ---- stop semantics (vLLM v1) -------------------------------------------------------------------

@pytest.mark.parametrize("skip", [True, False])
def test_stop_token_stays_in_ids_not_in_text(llm, skip):
    free = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    ids = tokens(free)[0]
    k = next(i for i in range(1, 8) if ids[i] not in ids[:i] and ids[i] > 2)   # an ordinary word, "w<id>"
    stop_id = ids[k]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id],
                            skip_special_tokens=skip)
    c = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert c.token_ids == ids[:k + 1] and (c.finish_reason, c.stop_reason) == ("stop", stop_id)
    assert c.text == " ".join(f"w{t}" for t in ids[:k])
    params.include_stop_str_in_output = True
    assert llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].text.endswith(f"w{stop_id}")
