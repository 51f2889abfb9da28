"""benchmarks/vs_vllm.py's pieces that run without a GPU or vLLM: which kernels count as the experts'
GEMMs, and vLLM's child environment for a mixture-of-experts model (its routing simulator, so that
both engines route uniformly)."""
import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import vs_vllm  # noqa: E402

MOE, DENSE = "configs/qwen3-30b-a3b", "configs/qwen3-8b"


def args_for(model, routing="uniform", **kw):
    base = dict(model=model, workload="default", kv_cache_dtype="auto", runs=1, num_seqs=4,
                prefix_caching="off", lora=0, vllm_moe_routing=routing, vllm_path=None, nano_option=[],
                vllm_option=[], nano_set=[], out=None, timeout=5)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("name, expected", [
    ("fused_moe_kernel", "moe"),                                  # vLLM's Triton experts
    ("_gate_up_kernel", "moe"), ("_down_kernel", "moe"),          # ours
    ("void vllm::moe::topkGating<8, 128, 4, 16, 32, int, __nv_bfloat16>", "other"),   # routing
    ("void vllm::moe::moe_align_block_size_kernel<int>(int const*)", "other"),
    ("triton_red_fused_fused_add_rms_norm_moe_forward_1", "other"),
    ("nvjet_sm90_qqtst_128x128_128x6_1x2_h_bz_ovscale_TNT", "gemm"),
    ("_decode_split_kernel", "attention"),
])
def test_kernel_categories(name, expected):
    assert vs_vllm.category(name) == expected


def test_a_moe_model_gets_uniform_simulated_routing_in_vllm_only_by_default():
    assert vs_vllm.is_moe(MOE) and not vs_vllm.is_moe(DENSE) and not vs_vllm.is_moe("no/such/folder")
    # multimodal checkpoints: the experts are in text_config
    assert vs_vllm.is_moe("configs/qwen3.6-35b-a3b") and not vs_vllm.is_moe("configs/qwen3.5-9b")
    assert vs_vllm.vllm_env(args_for(MOE)) == {"VLLM_MOE_ROUTING_SIMULATION_STRATEGY": "uniform_random"}
    assert vs_vllm.vllm_env(args_for(MOE, "model")) == {}
    assert vs_vllm.vllm_env(args_for(DENSE)) == {}
    # a MoE record's name says which routing vLLM ran
    assert "_vllm-routing-model" in vs_vllm.tag(args_for(MOE, "model"))
    assert "_vllm-routing-uniform" in vs_vllm.tag(args_for(MOE))
    assert "routing" not in vs_vllm.tag(args_for(DENSE, "model"))


def test_run_child_hands_the_routing_to_vllms_child_and_the_option_on(monkeypatch):
    seen = {}

    class FakeChild:
        pid, returncode = -1, 0

        def __init__(self, cmd, env, start_new_session):
            seen.setdefault("runs", []).append((cmd, env))

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(vs_vllm.subprocess, "Popen", FakeChild)
    monkeypatch.setattr(vs_vllm.os, "killpg", lambda pid, sig: None)
    monkeypatch.setattr(vs_vllm, "wait_gpu_free", lambda: None)
    monkeypatch.delenv("VLLM_MOE_ROUTING_SIMULATION_STRATEGY", raising=False)
    for engine in ("vllm", "nanovllm"):
        assert vs_vllm.run_child(args_for(MOE), engine, profile=False) is None   # the fake writes nothing
    # a value the parent had does not reach vLLM's child when its own router is asked for
    monkeypatch.setenv("VLLM_MOE_ROUTING_SIMULATION_STRATEGY", "uniform_random")
    vs_vllm.run_child(args_for(MOE, "model"), "vllm", profile=False)
    (vllm_cmd, vllm_env), (nano_cmd, nano_env), (_, model_env) = seen["runs"]
    assert vllm_env["VLLM_MOE_ROUTING_SIMULATION_STRATEGY"] == "uniform_random"
    assert "VLLM_MOE_ROUTING_SIMULATION_STRATEGY" not in nano_env
    assert "VLLM_MOE_ROUTING_SIMULATION_STRATEGY" not in model_env
    assert vllm_cmd[vllm_cmd.index("--vllm-moe-routing") + 1] == "uniform"
