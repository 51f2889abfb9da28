"""Choosing the prefill attention (Config.prefill_attention) without a GPU: the choices, the
fall-back of "auto" and its hint, the errors of a forced FlashAttention-4 that cannot run, the
start-up line, and the deprecated attention_backend option. The GPU's capability and the package's
import are monkeypatched; FA4 itself runs in tests/test_fa4_gpu.py."""
import pytest
import torch

from nanovllm import LLM
from nanovllm.kernels import prefill_attention
from nanovllm.layers import prefill_attention as ab

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


def fake_fa4_prefill(*args, **kwargs):
    raise AssertionError("selection must not run attention")


@pytest.fixture
def hopper(monkeypatch):
    """A CUDA device of compute capability 9.0 on the kernels' GPU path."""
    monkeypatch.setattr(ab, "KERNELS", "triton")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def missing_package():
    raise ModuleNotFoundError("No module named 'flash_attn'")


def test_auto_on_cpu_is_torch_flash_and_never_imports_fa4(monkeypatch):
    monkeypatch.setattr(ab, "import_fa4_prefill", lambda: pytest.fail("imported FA4 on CPU"))
    backend = ab.select_prefill_attention("auto", CPU, torch.float32, torch.float32)
    assert backend.name == "torch_flash" and backend.prefill is prefill_attention
    assert "needs a CUDA device" in backend.description


def test_auto_without_the_package_is_the_triton_kernel_on_hopper(hopper, monkeypatch):
    from nanovllm.kernels.triton_prefill import prefill_attention_triton_or_torch
    monkeypatch.setattr(ab, "import_fa4_prefill", missing_package)
    backend = ab.select_prefill_attention("auto", CUDA, torch.bfloat16, torch.bfloat16)
    assert backend.name == "triton" and backend.prefill is prefill_attention_triton_or_torch
    assert "nanovllm[flash]" in backend.description


def test_triton_is_triton_even_where_fa4_could_run_and_an_error_off_cuda(hopper, monkeypatch):
    monkeypatch.setattr(ab, "import_fa4_prefill", lambda: fake_fa4_prefill)
    for capability in ((8, 0), (9, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        backend = ab.select_prefill_attention("triton", CUDA, torch.bfloat16, torch.float8_e4m3fn)
        assert backend.name == "triton" and backend.hint is None
    with pytest.raises(ValueError, match="prefill_attention='triton' needs a CUDA device"):
        ab.select_prefill_attention("triton", CPU, torch.float32, torch.float32)
    monkeypatch.setattr(ab, "KERNELS", "torch")
    with pytest.raises(ValueError, match="prefill_attention='triton' is off with the torch reference"):
        ab.select_prefill_attention("triton", CUDA, torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize("capability,name", [((9, 0), "triton"), ((10, 0), "triton"),
                                             ((12, 0), "torch_flash"), ((8, 9), "torch_flash")])
def test_auto_without_fa4_takes_triton_only_where_its_tiles_fit(hopper, monkeypatch, capability, name):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(ab, "import_fa4_prefill", missing_package)
    assert ab.select_prefill_attention("auto", CUDA, torch.bfloat16, torch.bfloat16).name == name


def test_auto_on_ampere_is_torch_flash(hopper, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(ab, "import_fa4_prefill", lambda: fake_fa4_prefill)
    backend = ab.select_prefill_attention("auto", CUDA, torch.bfloat16, torch.bfloat16)
    assert backend.name == "torch_flash" and "8.0" in backend.description


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)])
def test_auto_with_the_package_on_hopper_or_newer_is_fa4(hopper, monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(ab, "import_fa4_prefill", lambda: fake_fa4_prefill)
    for name in ("auto", "flash_attn_4"):
        backend = ab.select_prefill_attention(name, CUDA, torch.bfloat16, torch.bfloat16)
        assert backend.name == "flash_attn_4" and backend.prefill is fake_fa4_prefill
        assert "FP8" not in backend.description


def test_fa4_with_an_fp8_cache_says_which_prefills_take_todays_path(hopper, monkeypatch):
    monkeypatch.setattr(ab, "import_fa4_prefill", lambda: fake_fa4_prefill)
    backend = ab.select_prefill_attention("auto", CUDA, torch.bfloat16, torch.float8_e4m3fn)
    assert backend.name == "flash_attn_4"
    assert "FP8 KV cache" in backend.description and "FlashAttention-2" in backend.description


def test_torch_flash_is_torch_flash_even_where_fa4_could_run(hopper, monkeypatch):
    monkeypatch.setattr(ab, "import_fa4_prefill", lambda: fake_fa4_prefill)
    backend = ab.select_prefill_attention("torch_flash", CUDA, torch.bfloat16, torch.bfloat16)
    assert backend.name == "torch_flash" and backend.prefill is prefill_attention


def test_forcing_fa4_without_the_package_names_the_extra(hopper, monkeypatch):
    monkeypatch.setattr(ab, "import_fa4_prefill", missing_package)
    with pytest.raises(ValueError, match=r"flash_attn_4.*nanovllm\[flash\]"):
        ab.select_prefill_attention("flash_attn_4", CUDA, torch.bfloat16, torch.bfloat16)


def test_forcing_fa4_on_cpu_or_an_old_gpu_is_an_error(hopper, monkeypatch):
    monkeypatch.setattr(ab, "import_fa4_prefill", lambda: fake_fa4_prefill)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ab.select_prefill_attention("flash_attn_4", CPU, torch.float32, torch.float32)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    with pytest.raises(ValueError, match=r"compute capability 9\.x.*8\.6"):
        ab.select_prefill_attention("flash_attn_4", CUDA, torch.bfloat16, torch.bfloat16)


def test_unknown_name_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match="auto.*flash_attn_4.*torch_flash"):
        ab.select_prefill_attention("flash_attn", CPU, torch.float32, torch.float32)


def test_llm_validates_the_option_and_fails_at_once_when_forced_on_cpu(qwen3_dir, monkeypatch):
    with pytest.raises(ValueError, match="prefill_attention must be one of"):
        LLM(qwen3_dir, device="cpu", prefill_attention="FLASH_ATTN")
    monkeypatch.setattr(ab, "import_fa4_prefill", lambda: pytest.fail("imported FA4 on CPU"))
    with pytest.raises(ValueError, match="prefill_attention='flash_attn_4' needs a CUDA device"):
        LLM(qwen3_dir, device="cpu", prefill_attention="flash_attn_4")


def test_the_engine_binds_and_logs_its_choice(qwen3_dir, caplog):
    with caplog.at_level("INFO", logger="nanovllm.engine.model_runner"):
        llm = LLM(qwen3_dir, device="cpu", prefill_attention="auto", num_kvcache_blocks=8)
    runner = llm.model_runner
    assert runner.prefill_attention.name == "torch_flash"
    assert all(layer.backend.prefill_kernel is prefill_attention for layer in runner.attention_layers)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels:")] == [
        "kernels: torch reference (CPU)"]
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


# ---- the start-up line and the FlashAttention-4 hint ----------------------------------------

TRITON_DECODE = "; decode attention: Triton paged kernel"


def test_start_up_line_says_what_runs_on_a_gpu(hopper, monkeypatch):
    monkeypatch.setattr(ab, "import_fa4_prefill", lambda: fake_fa4_prefill)
    assert ab.select_prefill_attention("auto", CUDA, torch.bfloat16, torch.bfloat16).startup_line == (
        "kernels: triton; prefill attention: FlashAttention-4 over the paged cache" + TRITON_DECODE)
    assert ab.select_prefill_attention("torch_flash", CUDA, torch.bfloat16, torch.bfloat16).startup_line == (
        "kernels: triton; prefill attention: torch FlashAttention-2" + TRITON_DECODE)
    assert ab.select_prefill_attention("triton", CUDA, torch.bfloat16, torch.bfloat16).startup_line == (
        "kernels: triton; prefill attention: the Triton FlashAttention kernel over the paged cache"
        + TRITON_DECODE)
    # float32 models take the torch reference inside each (the kernels run fp16/bf16)
    for name, kernel in (("auto", "FlashAttention-4"), ("torch_flash", "FlashAttention-2"),
                         ("triton", "the Triton kernel")):
        line = ab.select_prefill_attention(name, CUDA, torch.float32, torch.float32).startup_line
        assert line.startswith(f"kernels: triton; prefill attention: the torch reference (float32: {kernel}")
    monkeypatch.setattr(ab, "KERNELS", "torch")
    assert ab.select_prefill_attention("auto", CUDA, torch.bfloat16, torch.bfloat16).startup_line == (
        "kernels: torch reference (NANOVLLM_KERNELS=torch, or no triton)")


def test_auto_on_hopper_without_the_package_says_so_and_hints_at_fa4(hopper, monkeypatch):
    monkeypatch.setattr(ab, "import_fa4_prefill", missing_package)
    choice = ab.select_prefill_attention("auto", CUDA, torch.bfloat16, torch.bfloat16)
    assert choice.startup_line == ("kernels: triton; prefill attention: the Triton FlashAttention kernel "
                                   "over the paged cache (flash_attn_4 is not installed: pip install "
                                   "'nanovllm[flash]')" + TRITON_DECODE)
    assert "faster" in choice.hint and choice.hint.endswith("pip install 'nanovllm[flash]'")


def test_a_broken_fa4_install_is_named_as_such(hopper, monkeypatch):
    def broken():
        raise RuntimeError("CUDA driver too old")
    monkeypatch.setattr(ab, "import_fa4_prefill", broken)
    choice = ab.select_prefill_attention("auto", CUDA, torch.bfloat16, torch.bfloat16)
    assert "flash_attn_4 failed to import (RuntimeError: CUDA driver too old)" in choice.description
    assert choice.hint is not None


def test_no_hint_where_fa4_cannot_run_or_was_not_asked_for(hopper, monkeypatch):
    monkeypatch.setattr(ab, "import_fa4_prefill", missing_package)
    assert ab.select_prefill_attention("torch_flash", CUDA, torch.bfloat16, torch.bfloat16).hint is None
    assert ab.select_prefill_attention("auto", CPU, torch.float32, torch.float32).hint is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert ab.select_prefill_attention("auto", CUDA, torch.bfloat16, torch.bfloat16).hint is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(ab, "import_fa4_prefill", lambda: fake_fa4_prefill)
    assert ab.select_prefill_attention("auto", CUDA, torch.bfloat16, torch.bfloat16).hint is None


def test_the_engine_logs_the_hint_once(qwen3_dir, monkeypatch, caplog):
    # CPU has no hint of its own: the runner is given a choice that carries one
    import dataclasses

    from nanovllm.engine import model_runner
    real = model_runner.select_prefill_attention
    monkeypatch.setattr(model_runner, "select_prefill_attention",
                        lambda *a: dataclasses.replace(real(*a), hint="install the faster kernel"))
    with caplog.at_level("INFO", logger="nanovllm.engine.model_runner"):
        LLM(qwen3_dir, device="cpu", num_kvcache_blocks=8)
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert ("INFO", "kernels: torch reference (CPU)") in messages
    assert [m for m in messages if m[0] == "WARNING"] == [("WARNING", "install the faster kernel")]
    caplog.clear()
    choice = real("auto", CPU, torch.float32, torch.float32)
    with caplog.at_level("INFO", logger="nanovllm.engine.model_runner"):
        dataclasses.replace(choice, hint="h").log(model_runner.logger, first_rank=False)   # a TP worker
    assert [r.levelname for r in caplog.records] == ["INFO"]


# ---- the deprecated attention_backend option ------------------------------------------------

@pytest.fixture
def fresh_warning(monkeypatch):
    from nanovllm import config
    monkeypatch.setattr(config, "_warned_attention_backend", False)


@pytest.mark.parametrize("old,new", [("triton", "torch_flash"), ("flash_attn_4", "flash_attn_4"),
                                     ("auto", "auto")])
def test_attention_backend_maps_to_prefill_attention(qwen3_dir, fresh_warning, caplog, old, new):
    from nanovllm.config import Config
    with caplog.at_level("WARNING", logger="nanovllm.config"):
        first = Config.create(qwen3_dir, attention_backend=old)
        again = Config.create(qwen3_dir, attention_backend=old, prefill_attention=new)
    assert first.prefill_attention == again.prefill_attention == new
    assert first.attention_backend is None
    assert [r.getMessage() for r in caplog.records] == [   # once a process
        f"attention_backend is deprecated: pass prefill_attention={new!r} instead of "
        f"attention_backend={old!r}"]


def test_attention_backend_errors(qwen3_dir, fresh_warning):
    from nanovllm.config import Config
    with pytest.raises(ValueError, match=r"attention_backend \(deprecated: use prefill_attention\) "
                                         r"must be one of \('auto', 'flash_attn_4', 'triton'\), "
                                         r"got 'torch_flash'"):
        Config.create(qwen3_dir, attention_backend="torch_flash")
    with pytest.raises(ValueError, match="disagree: pass prefill_attention only"):
        Config.create(qwen3_dir, attention_backend="triton", prefill_attention="flash_attn_4")


def test_the_cli_takes_both_flags(qwen3_dir, fresh_warning):
    import argparse
    import dataclasses

    from nanovllm import EngineArgs
    from nanovllm.config import Config
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    for flags in (["--prefill-attention", "torch_flash"], ["--attention-backend", "triton"]):
        args = EngineArgs.from_cli_args(parser.parse_args(["--model", qwen3_dir, *flags]))
        assert Config.create(**dataclasses.asdict(args)).prefill_attention == "torch_flash"
