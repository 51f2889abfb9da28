"""The roofline (nanovllm/utils/roofline.py) behind bench.py's fraction of the limit: the figures
docs/benchmarks.md quotes, the two regimes of a decode step (weights and K/V at copy bandwidth, or
FLOPs at the bf16 peak), how tensor and data parallelism, the KV dtype and experts scale it, what a
hybrid linear-attention model adds (its states, its delta rule; K/V in its full-attention layers only),
and the measurements of the GPU's figures."""
import json
import math
import os
import time
from types import SimpleNamespace

import pytest
import torch

import bench
from nanovllm.utils import roofline
from nanovllm.utils.roofline import H200, ModelShapes, workload_limit

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
# hidden 64, 2 layers, 4 heads of 16, 2 KV heads, intermediate 128, vocab 1000
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, vocab_size=1000)
TINY_PARAMS = 2 * (64 * (4 + 2 * 2) * 16 + 4 * 16 * 64 + 3 * 64 * 128) + 1000 * 64
TINY_MOE = dict(TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def config_of(model: str) -> dict:
    with open(os.path.join(CONFIGS, model, "config.json")) as f:
        return json.load(f)


def test_default_workload_lengths_are_bench_s():
    prompts, params = bench.workload(256, 1024, 1024, 0.6)
    assert roofline.default_workload_lens() == ([len(p) for p in prompts], [p.max_tokens for p in params])


@pytest.mark.parametrize("model,tp,kv_bytes,expected", [
    ("qwen3-0.6b", 1, 2, 36_329), ("qwen3-0.6b", 1, 1, 64_569),
    ("qwen3-8b", 1, 2, 12_923), ("qwen3-8b", 2, 2, 25_846),
    ("qwen3.5-9b", 1, 2, 12_757), ("qwen3.6-35b-a3b", 1, 2, 6_702)])
def test_limits_of_the_default_workload(model, tp, kv_bytes, expected):
    """benchmarks/RESULTS.md's, docs/benchmarks.md's and docs/hybrid.md's figures, at the documented
    H200 figures."""
    prompt_lens, output_lens = roofline.default_workload_lens()
    assert round(workload_limit(config_of(model), prompt_lens, output_lens, H200, tp, kv_bytes)) == expected


def test_one_sequence_is_bound_by_reading_the_weights():
    # One token of prompt, 1000 output tokens: each step reads the bf16 weights and <= 1000 tokens of
    # K/V (2 layers x K, V x 2 heads x 16 x 2 bytes = 256 bytes each), far below the FLOP time.
    kv_per_token = 2 * 2 * 2 * 16 * 2
    reads = sum(2 * TINY_PARAMS + kv_per_token * (1 + step) for step in range(1000))
    prefill = (2 * (TINY_PARAMS - 64_000) + 2 * 64_000 + 4 * 2 * 4 * 16 / 2) / H200.bf16_flop_per_s
    expected = 1000 / (reads / H200.copy_bytes_per_s + prefill)
    assert workload_limit(TINY, [1], [1000]) == pytest.approx(expected, rel=1e-9)
    slow_memory = roofline.DeviceLimits(H200.copy_bytes_per_s / 2, H200.bf16_flop_per_s, "test")
    assert workload_limit(TINY, [1], [1000], slow_memory) == pytest.approx(
        1000 / (2 * reads / H200.copy_bytes_per_s + prefill), rel=1e-9)


def test_a_large_batch_is_bound_by_flops():
    # 100,000 sequences of one prompt token and one output token: a step's FLOPs (2 per weight per
    # sequence) take longer than reading the weights once.
    decode_flops = 2 * TINY_PARAMS * 100_000 + 4 * 2 * 4 * 16 * 100_000
    prefill_flops = 2 * TINY_PARAMS * 100_000 + 4 * 2 * 4 * 16 / 2 * 100_000
    expected = 100_000 / ((decode_flops + prefill_flops) / H200.bf16_flop_per_s)
    assert workload_limit(TINY, [1] * 100_000, [1] * 100_000) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("model", ["qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b"])
def test_tensor_parallelism_divides_every_gpu_s_time(model):
    # Weights, K/V heads and FLOPs all split N ways; the all-reduces are not charged (the docstring).
    prompt_lens, output_lens = [300, 900, 120], [200, 50, 400]
    one = workload_limit(config_of(model), prompt_lens, output_lens)
    for tp in (2, 4, 8):
        assert workload_limit(config_of(model), prompt_lens, output_lens, tp=tp) == pytest.approx(tp * one)


def test_fp8_kv_halves_the_kv_term():
    # Reads-bound steps (4 sequences of 1000-token contexts): a step is weights + K/V at copy bandwidth.
    shapes = ModelShapes.from_config(TINY)
    prompt_lens, output_lens = [1000] * 4, [10] * 4
    weights = 10 * 2 * shapes.params_read(4) / H200.copy_bytes_per_s
    bf16 = roofline.decode_seconds(shapes, prompt_lens, output_lens, H200, kv_bytes=2)
    fp8 = roofline.decode_seconds(shapes, prompt_lens, output_lens, H200, kv_bytes=1)
    assert bf16 - weights == pytest.approx(2 * (fp8 - weights), rel=1e-9)
    assert fp8 - weights == pytest.approx(sum(4 * (1000 + s) for s in range(10)) * 2 * 2 * 2 * 16
                                          / H200.copy_bytes_per_s, rel=1e-9)


def test_moe_counts_active_experts_only():
    shapes, expert = ModelShapes.from_config(TINY_MOE), 3 * 64 * 32
    attention, routers = 2 * (64 * (4 + 2 * 2) * 16 + 4 * 16 * 64), 2 * 8 * 64
    assert shapes.body_params == attention + routers    # no dense MLP: both layers have experts
    assert shapes.active_params == attention + routers + 2 * 2 * expert          # top 2 of 8
    assert shapes.params_read(1) == pytest.approx(shapes.active_params + 64_000)  # one token: its 2
    assert shapes.params_read(10_000) == pytest.approx(attention + routers + 2 * 8 * expert + 64_000)
    # Prefill computes with the top_k experts: 64 experts instead of 8 add only router FLOPs.
    wide = ModelShapes.from_config(dict(TINY_MOE, num_experts=64))
    extra = roofline.prefill_seconds(wide, [500], H200) - roofline.prefill_seconds(shapes, [500], H200)
    assert extra == pytest.approx(2 * 500 * 2 * (64 - 8) * 64 / H200.bf16_flop_per_s, rel=1e-9)


def test_data_parallel_replicas_take_their_share():
    # Two equal halves: each replica runs half the sequences, both at once.
    prompt_lens, output_lens = [500] * 8, [100] * 8
    half = workload_limit(TINY, prompt_lens[:4], output_lens[:4])
    assert workload_limit(TINY, prompt_lens, output_lens, dp=2) == pytest.approx(2 * half)
    assert workload_limit(TINY, prompt_lens, output_lens, dp=2, tp=2) == pytest.approx(4 * half)
    # More replicas than requests: the idle ones change nothing.
    assert workload_limit(TINY, [500], [100], dp=3) == pytest.approx(workload_limit(TINY, [500], [100]))


@pytest.mark.parametrize("kwargs,match", [
    (dict(tp=0), "tp must be a positive integer"), (dict(dp=1.5), "dp must be a positive integer"),
    (dict(kv_bytes=0), "kv_bytes"), (dict(output_lens=[1, 2]), "one length")])
def test_bad_arguments_say_what_to_change(kwargs, match):
    args = dict(config=TINY, prompt_lens=[10], output_lens=[10]) | kwargs
    with pytest.raises(ValueError, match=match):
        workload_limit(**args)


def test_a_config_without_the_shapes_is_refused():
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelShapes.from_config({k: v for k, v in TINY.items() if k != "intermediate_size"})
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        ModelShapes.from_config({k: v for k, v in TINY_MOE.items() if k != "moe_intermediate_size"})
    # An MoE model with a dense layer (mlp_only_layers) needs the dense MLP's size too.
    no_dense_size = {k: v for k, v in TINY_MOE.items() if k != "intermediate_size"}
    ModelShapes.from_config(no_dense_size)   # every layer sparse: not needed
    with pytest.raises(ValueError, match="lacks intermediate_size .1 of its layers"):
        ModelShapes.from_config(dict(no_dense_size, mlp_only_layers=[0]))


def test_measurements_run_on_cpu():
    copy = roofline.measure_copy_bandwidth("cpu", nbytes=1 << 20, repeats=3)
    peak = roofline.measure_bf16_peak("cpu", n=64, repeats=3)
    assert math.isfinite(copy) and copy > 1e6 and math.isfinite(peak) and peak > 1e5
    cpu = roofline.device_limits("cpu")   # no GPU: the documented figures, and it says so
    assert (cpu.copy_bytes_per_s, cpu.bf16_flop_per_s) == (4.3e12, 770e12) and "no GPU" in cpu.source


def test_timing_warms_up_for_its_seconds_then_times_repeats():
    calls = []

    def fn():
        calls.append(time.perf_counter())
        time.sleep(0.002)

    median = roofline._median_seconds(fn, torch.device("cpu"), repeats=5, warmup=1, warmup_seconds=0.05)
    assert 0.002 <= median < 0.05
    timed_from = calls[-5]
    assert timed_from - calls[0] >= 0.05   # the repeats start only after the warm-up's time
    assert len(calls) > 1 + 5              # more warm-up calls than its count of 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measured_gpu_figures_are_plausible_and_measured_once():
    gpu = roofline.device_limits()
    assert 1e11 < gpu.copy_bytes_per_s < 2e13 and 1e13 < gpu.bf16_flop_per_s < 1e16
    assert "measured on" in gpu.source and roofline.device_limits() is gpu


def test_bench_limits_follow_its_options():
    prompts, params = bench.workload(8, 1024, 1024, 0.6)
    lens, outs = [len(p) for p in prompts], [p.max_tokens for p in params]
    args = SimpleNamespace(model=os.path.join(CONFIGS, "qwen3-8b"), tensor_parallel_size=2,
                           data_parallel_size=1, kv_cache_dtype="fp8")
    fast = roofline.DeviceLimits(8e12, 1e15, "test")
    limit, documented = bench.workload_limits(args, prompts, params, fast)
    assert limit == pytest.approx(workload_limit(config_of("qwen3-8b"), lens, outs, fast, 2, 1))
    assert documented == pytest.approx(workload_limit(config_of("qwen3-8b"), lens, outs, H200, 2, 1))
    # FP8 weights: --quantization fp8, or a config with a quantization_config
    for fp8 in (SimpleNamespace(**vars(args), quantization="fp8"),
                SimpleNamespace(**{**vars(args), "model": os.path.join(CONFIGS, "qwen3-8b-fp8")})):
        assert bench.workload_limits(fp8, prompts, params, fast)[0] == pytest.approx(
            workload_limit(config_of("qwen3-8b"), lens, outs, fast, 2, 1, weight_bytes=1))
    no_config = SimpleNamespace(model="no/such/folder")
    assert bench.workload_limits(no_config, prompts, params, fast) == (None, None)


def test_long_workload_is_prefill_heavy_and_leaves_the_default_alone():
    prompts, params = bench.long_workload(256, 0.6)
    lens = [len(p) for p in prompts]
    assert len(prompts) == 256 and min(lens) >= 4000 and max(lens) <= 8000
    assert {p.max_tokens for p in params} == {64} and all(p.ignore_eos for p in params)
    assert bench.long_workload(256, 0.6)[0] == prompts   # seeded
    _, default_params = bench.workload(256, 1024, 1024, 0.6)
    assert sum(p.max_tokens for p in default_params) == 133_966   # nano-vllm's workload, unchanged


def test_the_overlap_bound_sums_all_flops_and_all_decode_reads():
    # One sequence (memory-bound steps) and 100,000 one-token prompts (compute-bound prefill): the
    # overlap bound hides the prefill's FLOPs under the decode steps' reads, up to the larger total.
    lens, outs = [1] + [1] * 100_000, [1000] + [1] * 100_000
    shapes = ModelShapes.from_config(TINY)
    steps = roofline.decode_steps(shapes, lens, outs, kv_bytes=2)
    flops = roofline.prefill_flops(shapes, lens) + sum(f for _, f in steps)
    reads = sum(r for r, _ in steps)
    expected = sum(outs) / max(flops / H200.bf16_flop_per_s, reads / H200.copy_bytes_per_s)
    assert workload_limit(TINY, lens, outs, bound="overlap") == pytest.approx(expected, rel=1e-9)
    assert workload_limit(TINY, lens, outs, bound="overlap") > workload_limit(TINY, lens, outs)
    with pytest.raises(ValueError, match="bound must be one of"):
        workload_limit(TINY, lens, outs, bound="sum")


@pytest.mark.parametrize("model", ["qwen3-0.6b", "qwen3-8b"])
def test_the_overlap_bound_is_never_below_separate_phases(model):
    prompt_lens, output_lens = roofline.default_workload_lens()
    separate = workload_limit(config_of(model), prompt_lens, output_lens)
    overlap = workload_limit(config_of(model), prompt_lens, output_lens, bound="overlap")
    assert separate < overlap < 2 * separate


# ---- hybrid linear-attention models (Qwen3.5 / Qwen3.6, Qwen3-Next) ------------------------------
# 4 layers (3 Gated DeltaNet, then gated full attention) of hidden 64; the linear layers have 2 key
# heads and 4 value heads of 8 dims and a conv of kernel 4.
LINEAR, FULL = "linear_attention", "full_attention"
TINY_HYBRID = dict(TINY, num_hidden_layers=4, layer_types=[LINEAR, LINEAR, LINEAR, FULL],
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                   linear_value_head_dim=8, linear_conv_kernel_dim=4)
GATED_ATTENTION = 64 * (2 * 4 * 16 + 2 * 2 * 16) + 4 * 16 * 64   # q_proj makes the gate too; k, v, o
# in_proj_qkvz, in_proj_ba, conv1d over q | k | v, A_log + dt_bias, the gated norm, out_proj
DELTANET = 64 * (16 + 16 + 32 + 32) + 64 * 8 + (16 + 16 + 32) * 4 + 2 * 4 + 8 + 32 * 64
DELTA_RULE_FLOPS = 3 * 6 * 4 * 8 * 8               # 3 layers x 6 per state value x 4 heads x 8 x 8
STATE_BYTES = 3 * ((16 + 16 + 32) * 3 * 2 + 4 * 8 * 8 * 4)   # conv (3 inputs, bf16) + recurrent (fp32)
# every layer's MLP a mixture of 8 experts (top 2) plus a shared expert of 48 and its gate
TINY_HYBRID_MOE = dict({k: v for k, v in TINY_HYBRID.items() if k != "intermediate_size"}, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def test_a_hybrid_model_counts_kv_and_attention_only_in_its_full_attention_layers():
    shapes = ModelShapes.from_config(TINY_HYBRID)
    assert shapes.body_params == GATED_ATTENTION + 3 * DELTANET + 4 * 3 * 64 * 128
    assert shapes.kv_values_per_token == 2 * 1 * 2 * 16        # K and V of 1 layer x 2 heads x 16
    assert shapes.attention_flops_per_key == 4 * 1 * 4 * 16
    assert shapes.linear_flops_per_token == DELTA_RULE_FLOPS
    assert shapes.state_bytes_per_seq == STATE_BYTES == 3 * 1408


def test_a_hybrid_decode_step_reads_and_writes_every_sequence_s_state():
    shapes = ModelShapes.from_config(TINY_HYBRID)
    body = GATED_ATTENTION + 3 * DELTANET + 4 * 3 * 64 * 128
    (reads, flops), = roofline.decode_steps(shapes, [100, 300], [1, 1], kv_bytes=2)
    assert reads == 2 * (body + 64_000) + 64 * 2 * (100 + 300) + 2 * 2 * STATE_BYTES
    assert flops == 2 * (2 * (body + 64_000) + DELTA_RULE_FLOPS) + 4 * 4 * 16 * (100 + 300)
    # prefill: the delta rule per prompt token, attention in one layer
    assert roofline.prefill_flops(shapes, [100, 300]) == (
        (2 * body + DELTA_RULE_FLOPS) * 400 + 2 * 2 * 64_000 + 4 * 4 * 16 * (100 ** 2 + 300 ** 2) / 2)


def test_a_hybrid_moe_counts_its_shared_expert_as_active():
    shapes = ModelShapes.from_config(TINY_HYBRID_MOE)
    always = GATED_ATTENTION + 3 * DELTANET + 4 * (8 * 64 + 3 * 64 * 48 + 64)   # + routers, shared experts
    assert shapes.body_params == always and shapes.sparse_layers == 4
    assert shapes.active_params == always + 4 * 2 * 3 * 64 * 32
    assert shapes.params_read(10_000) == pytest.approx(always + 4 * 8 * 3 * 64 * 32 + 64_000)


def test_hybrid_layers_from_the_interval_and_a_multimodal_text_config():
    # Qwen3-Next's config may give full_attention_interval alone (transformers derives layer_types).
    by_interval = {k: v for k, v in TINY_HYBRID.items() if k != "layer_types"}
    by_interval["full_attention_interval"] = 4
    assert ModelShapes.from_config(by_interval) == ModelShapes.from_config(TINY_HYBRID)
    # the published Qwen3.5 checkpoints: the decoder is the text_config of a multimodal config
    multimodal = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": TINY_HYBRID,
                  "vision_config": {"depth": 2, "hidden_size": 32}}
    assert ModelShapes.from_config(multimodal) == ModelShapes.from_config(TINY_HYBRID)
    with pytest.raises(ValueError, match="linear_attention layers but lacks linear_conv_kernel_dim"):
        ModelShapes.from_config({k: v for k, v in TINY_HYBRID.items() if k != "linear_conv_kernel_dim"})


def _built_weights(model) -> int:
    """The parameters of a nanovllm model that the roofline counts: all but the embedding and the
    residual stream's and attention's q/k RMSNorms (the gated norm of linear attention counts)."""
    skip = ("embed_tokens", "layernorm", "model.norm.", "q_norm", "k_norm")
    return sum(p.numel() for name, p in model.named_parameters() if not any(s in name for s in skip))


def _roofline_weights(config: dict) -> int:
    s = ModelShapes.from_config(config)
    return s.body_params + s.sparse_layers * s.experts * s.expert_params + s.lm_head_params


@pytest.mark.parametrize("arch", ["Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"])
def test_the_hybrid_count_is_the_model_nanovllm_builds(arch):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    from nanovllm.models import qwen3_5
    experts = "Moe" in arch or "Next" in arch
    config = dict(TINY_HYBRID_MOE if experts else TINY_HYBRID, max_position_embeddings=64)
    if "Next" in arch:   # a dense MLP in layer 1, experts elsewhere
        config.update(mlp_only_layers=[1], intermediate_size=128)
    hf = {"Qwen3_5ForCausalLM": Qwen3_5TextConfig, "Qwen3_5MoeForCausalLM": Qwen3_5MoeTextConfig,
          "Qwen3NextForCausalLM": Qwen3NextConfig}[arch](**config)
    with torch.device("meta"):
        model = getattr(qwen3_5, arch)(hf)
    assert _built_weights(model) == _roofline_weights(config)


@pytest.mark.parametrize("model,total,active", [
    ("qwen3.5-9b", 8.95e9, 8.95e9),          # the text model of the 9.65B checkpoint (vision, MTP aside)
    ("qwen3.6-35b-a3b", 34.66e9, 3.46e9)])   # 35B total, 3B active ("A3B") with vision and MTP
def test_the_shipped_hybrid_configs_count_what_nanovllm_builds(model, total, active):
    from nanovllm.config import Config
    from nanovllm.models import get_model_class
    hf = Config(os.path.join(CONFIGS, model), device="cpu").hf_config
    with torch.device("meta"):
        built = get_model_class(hf)(hf)
    assert _built_weights(built) == _roofline_weights(config_of(model))
    params = sum(p.numel() for p in built.parameters())
    shapes = ModelShapes.from_config(config_of(model))
    idle_experts = shapes.sparse_layers * (shapes.experts - shapes.top_k) * shapes.expert_params
    assert params == pytest.approx(total, rel=0.005)
    assert params - idle_experts == pytest.approx(active, rel=0.005)
