"""Choosing the attention back end (Config.attention_backend) without a GPU: the choices, the
fall-back of "auto", and the errors of a forced FlashAttention-4 that cannot run. The GPU's
capability and the package's import are monkeypatched; FA4 itself runs in tests/test_fa4_gpu.py."""
import pytest
import torch

from nanovllm import LLM
from nanovllm.kernels import prefill_attention
from nanovllm.layers import attention_backends as ab

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


def fake_fa4_prefill(*args, **kwargs):
    raise AssertionError("selection must not run attention")


@pytest.fixture
def hopper(monkeypatch):
    """A CUDA device of compute capability 9.0 on the kernels' GPU path."""
    monkeypatch.setattr(ab, "KERNEL_BACKEND", "triton")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def missing_package():
    raise ModuleNotFoundError("No module named 'flash_attn'")


def test_auto_on_cpu_is_todays_path_and_never_imports_fa4(monkeypatch):
    monkeypatch.setattr(ab, "import_fa4_prefill", lambda: pytest.fail("imported FA4 on CPU"))
    backend = ab.select_attention_backend("auto", CPU, torch.float32)
    assert backend.name == "triton" and backend.prefill is prefill_attention
    assert "needs a CUDA device" in backend.description


def test_auto_without_the_package_is_todays_path(hopper, monkeypatch):
    monkeypatch.setattr(ab, "import_fa4_prefill", missing_package)
    backend = ab.select_attention_backend("auto", CUDA, torch.bfloat16)
    assert backend.name == "triton" and backend.prefill is prefill_attention
    assert "nanovllm[flash]" in backend.description


def test_auto_on_ampere_is_todays_path(hopper, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(ab, "import_fa4_prefill", lambda: fake_fa4_prefill)
    backend = ab.select_attention_backend("auto", CUDA, torch.bfloat16)
    assert backend.name == "triton" and "8.0" in backend.description


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)])
def test_auto_with_the_package_on_hopper_or_newer_is_fa4(hopper, monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(ab, "import_fa4_prefill", lambda: fake_fa4_prefill)
    for name in ("auto", "flash_attn_4"):
        backend = ab.select_attention_backend(name, CUDA, torch.bfloat16)
        assert backend.name == "flash_attn_4" and backend.prefill is fake_fa4_prefill
        assert "FP8" not in backend.description


def test_fa4_with_an_fp8_cache_says_which_prefills_take_todays_path(hopper, monkeypatch):
    monkeypatch.setattr(ab, "import_fa4_prefill", lambda: fake_fa4_prefill)
    backend = ab.select_attention_backend("auto", CUDA, torch.float8_e4m3fn)
    assert backend.name == "flash_attn_4"
    assert "FP8 KV cache" in backend.description and "FlashAttention-2" in backend.description


def test_triton_is_todays_path_even_where_fa4_could_run(hopper, monkeypatch):
    monkeypatch.setattr(ab, "import_fa4_prefill", lambda: fake_fa4_prefill)
    backend = ab.select_attention_backend("triton", CUDA, torch.bfloat16)
    assert backend.name == "triton" and backend.prefill is prefill_attention


def test_forcing_fa4_without_the_package_names_the_extra(hopper, monkeypatch):
    monkeypatch.setattr(ab, "import_fa4_prefill", missing_package)
    with pytest.raises(ValueError, match=r"flash_attn_4.*nanovllm\[flash\]"):
        ab.select_attention_backend("flash_attn_4", CUDA, torch.bfloat16)


def test_forcing_fa4_on_cpu_or_an_old_gpu_is_an_error(hopper, monkeypatch):
    monkeypatch.setattr(ab, "import_fa4_prefill", lambda: fake_fa4_prefill)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ab.select_attention_backend("flash_attn_4", CPU, torch.float32)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    with pytest.raises(ValueError, match=r"compute capability 9\.x.*8\.6"):
        ab.select_attention_backend("flash_attn_4", CUDA, torch.bfloat16)


def test_unknown_name_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match="auto.*flash_attn_4.*triton"):
        ab.select_attention_backend("flash_attn", CPU, torch.float32)


def test_llm_validates_the_option_and_fails_at_once_when_forced_on_cpu(qwen3_dir, monkeypatch):
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        LLM(qwen3_dir, device="cpu", attention_backend="FLASH_ATTN")
    monkeypatch.setattr(ab, "import_fa4_prefill", lambda: pytest.fail("imported FA4 on CPU"))
    with pytest.raises(ValueError, match="attention_backend='flash_attn_4' needs a CUDA device"):
        LLM(qwen3_dir, device="cpu", attention_backend="flash_attn_4")


def test_the_engine_binds_and_logs_its_choice(qwen3_dir, caplog):
    with caplog.at_level("INFO", logger="nanovllm.engine.model_runner"):
        llm = LLM(qwen3_dir, device="cpu", attention_backend="auto", num_kvcache_blocks=8)
    runner = llm.model_runner
    assert runner.attention_backend.name == "triton"
    assert all(layer.prefill_attention is prefill_attention for layer in runner.attention_layers)
    assert any("attention: triton" in r.getMessage() for r in caplog.records)
