"""The server with --enable-lora --lora-modules: two adapters on a tiny random Qwen3, driven by the
openai client; each adapter's completion equals LLM.generate's under the same LoRARequest, both are
listed in /v1/models, and an unknown model name is a 404."""
import importlib.util

import pytest

for _module in ("fastapi", "uvicorn", "openai", "peft"):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"needs {_module} (pip install 'nanovllm[test]')", allow_module_level=True)

import openai  # noqa: E402

from conftest import make_model, serve_process  # noqa: E402
from nanovllm import LLM, LoRARequest, SamplingParams  # noqa: E402
from test_lora import ALL, make_adapter  # noqa: E402

ENGINE = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256, max_num_seqs=8,
              enable_lora=True, max_loras=2)
PROMPT = "w5 w9 w33 w70 w101"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_lora")
    model = make_model(str(root / "model"), "qwen3", seed=3)
    a = make_adapter(model, str(root / "a"), 8, ALL, seed=1)
    b = make_adapter(model, str(root / "b"), 16, ["q_proj", "v_proj", "down_proj"], seed=2)
    return model, {"alpha": a, "beta": b}, root


@pytest.fixture(scope="module")
def server(setup):
    model, adapters, root = setup
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items() if k != "enable_lora"]
    log = open(root / "server.log", "w+")
    yield from serve_process([model, "--served-model-name", "tiny", "--enable-lora", *flags, "--lora-modules",
                              *(f"{n}={p}" for n, p in adapters.items())], log, 180)


def test_the_server_serves_two_adapters_to_the_openai_client(setup, server):
    model, adapters, _ = setup
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "alpha", "beta"}
    llm = LLM(model, **ENGINE)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        texts = {}
        for i, name in enumerate((None, "alpha", "beta"), 0):
            lora = None if name is None else LoRARequest(name, i, adapters[name])
            want = llm.generate([PROMPT], greedy, use_tqdm=False, lora_request=lora)[0].outputs[0].text
            got = client.completions.create(model=name or "tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert got.choices[0].text == want and got.model == (name or "tiny")
            texts[name] = want
        assert len(set(texts.values())) == 3   # each adapter changes the text
    finally:
        llm.shutdown()
    with pytest.raises(openai.NotFoundError, match="`gamma` does not exist"):
        client.completions.create(model="gamma", prompt=PROMPT, max_tokens=2)
