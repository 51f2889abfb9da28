"""The roofline of an offline generation workload: the output tokens/s no engine can exceed on given
GPUs, computed from the model's Hugging Face config (dense Qwen3/Llama/Qwen2, Qwen3-MoE, or the hybrid
linear-attention Qwen3.5/Qwen3.6/Qwen3-Next: see below), the workload's prompt and output lengths,
the tensor- and data-parallel sizes, the KV cache dtype, and two figures of the GPU: its copy
bandwidth and its bf16 peak, measured once per process on CUDA.

The model of time. A GPU moves memory at most at `copy_bytes_per_s` (bytes/s: the bytes read plus
the bytes written by a large device-to-device copy; a read-only stream is assumed no faster) and
computes at most at `bf16_flop_per_s` (FLOP/s: a large bf16 GEMM). Without a GPU the documented H200
figures stand in: 4.3e12 bytes/s (measured) and 770e12 FLOP/s (dense bf16 tensor cores, measured).
Weights are bf16 (2 bytes), or with `weight_bytes=1` FP8 (the LM head stays bf16) and their GEMMs
at twice the bf16 peak (FP8 tensor cores); K/V take `kv_bytes` bytes per value (2 for bf16, 1 for FP8).

- Prefill (seconds = FLOPs / bf16_flop_per_s): every prompt token through every layer, 2 FLOPs per
  weight it computes with (for a MoE layer the router, its top_k experts and a shared expert), causal
  attention at 4 x layers x heads x head_dim FLOPs per query-key pair (n^2 / 2 pairs for an n-token
  prompt), and the LM head once per prompt. Its weight reads and K/V writes are not counted (compute-bound).
- Decode: one step per output position; a step's batch is every sequence still generating (all
  sequences run from the start: the workload fits max_num_seqs and the KV cache), each with a context
  of its prompt plus the tokens it generated so far. Seconds per step = max(bytes / copy, FLOPs /
  peak), where bytes = all weights once (the LM head included; a MoE layer only the experts its batch
  touches, E x (1 - (1 - top_k / E)^B) of E under uniform routing, as dummy weights give) + every
  context token's K and V of every layer (+ the linear-attention state, below); FLOPs = 2 per active
  weight per sequence + the attention FLOPs per key of every context.
- Hybrid models (config.json's layer_types; a multimodal checkpoint's text_config is the decoder):
  only the full-attention layers hold K/V and attend ("layers" above counts them alone), their q_proj
  twice as wide (it makes the output gate too). A Gated DeltaNet layer's weights (in_proj_qkvz,
  in_proj_ba, conv1d, A_log, dt_bias, its gated norm, out_proj) count as any weight; its delta rule
  adds 6 FLOPs per recurrent-state value per token (S^T k, the rank-one update, S^T q), in prefill
  and decode. Each sequence keeps a conv state (bf16) and a recurrent state (fp32) per such layer
  (utils/hybrid_shapes.py): a decode step reads and writes all of it, for every sequence of the batch
  (for Qwen3.5-9B 49 MiB a sequence, so 98 MiB of traffic a sequence a step, beside 16 GB of weights).
  Prefill's state traffic is not counted (once per sequence and chunk; compute-bound).
- Tensor parallelism over N GPUs: the weights (column/row-parallel linears, the vocab-parallel LM
  head, every expert's slice), the K/V heads (num_key_value_heads is divisible by N, so none is
  replicated) and the FLOPs all split N ways, so a GPU's time is 1/N of one GPU's. The all-reduces
  are not charged: the limit assumes they overlap the GEMMs. (Two per layer of B x hidden bf16 values:
  for the Qwen3-8B shapes at B = 256, 72 x 2 MiB per step, about 0.34 ms at NVLink's 450 GB/s each
  way, against 3.8 ms for the workload's average decode step at TP=2.)
- Data parallelism: D replicas of N GPUs each get the requests DataParallelEngine assigns them; the
  limit is all output tokens over the slowest replica's time.
- Not counted: embedding lookups, norms, rotary, sampling, activations' traffic between kernels,
  writing new K/V, kernel launches, the host.

The limit ("separate" phases) is the workload's output tokens over the sum of those seconds: a bound
for an engine that runs prefill and decode in separate steps. A scheduler that puts prompt chunks
into the decode steps can hide prefill FLOPs under the decode steps' memory time, so beside it stands
the "overlap" bound: the larger of all FLOPs (prefill and decode) at the peak and all decode bytes
(one weight read per decode step, every context's K/V, the states) at the copy bandwidth; no engine
passes it. `python -m nanovllm.utils.roofline MODEL_FOLDER... [--tp N...]` prints this GPU's figures
and the limits of bench.py's default workload."""
import dataclasses
import functools
import random
import statistics
import time
from dataclasses import dataclass

import torch

from nanovllm.utils.balance import assign_by_cost, request_cost
from nanovllm.utils.hybrid_shapes import (LinearAttentionShapes, decoder_config, layer_kinds,
                                          linear_attention_shapes, shared_expert_params)

WEIGHT_BYTES = 2   # bf16


@dataclass(frozen=True)
class DeviceLimits:
    copy_bytes_per_s: float   # bytes read + written per second by a device-to-device copy
    bf16_flop_per_s: float    # dense bf16 matmul FLOP/s
    source: str               # where the figures come from, for the printout


H200 = DeviceLimits(4.3e12, 770e12, "documented H200 figures")


def _median_seconds(fn, device: torch.device, repeats: int, warmup: int = 3,
                    warmup_seconds: float = 0.0) -> float:
    """Median wall time of fn() on `device`: CUDA events around each call on CUDA, after `warmup`
    calls and then more until `warmup_seconds` have passed."""
    for _ in range(warmup):
        fn()
    deadline = time.perf_counter() + warmup_seconds
    while time.perf_counter() < deadline:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    times = []
    if device.type == "cuda":
        with torch.cuda.device(device):   # the events go on this device's current stream
            torch.cuda.synchronize()
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_copy_bandwidth(device="cuda", nbytes: int = 1 << 30, repeats: int = 30,
                           warmup_seconds: float = 0.2) -> float:
    """Bytes/s (read + written) of copying `nbytes` from one buffer of `device` to another, median of
    `repeats` after copying for `warmup_seconds`. 1 GiB is far past a GPU's L2 cache (50 MB on an
    H200), so this is HBM's bandwidth. The warm-up matters: on an H200 right after a second of GEMMs
    the first copies run ~4.02 TB/s and settle at ~4.21 after about a hundred (1 GiB; 4 GiB buffers
    ~4.28), so a median of a few copies moved with whatever ran before (benchmarks/RESULTS.md)."""
    device = torch.device(device)
    with torch.device(device):
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        return 2 * nbytes / _median_seconds(lambda: dst.copy_(src), device, repeats,
                                            warmup_seconds=warmup_seconds)


def measure_bf16_peak(device="cuda", n: int = 8192, repeats: int = 10) -> float:
    """FLOP/s of an n x n by n x n bf16 matmul on `device` (random values: zeros draw less power and
    run faster than real weights), median of `repeats`."""
    device = torch.device(device)
    with torch.device(device):
        a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
        out = torch.empty(n, n, dtype=torch.bfloat16)
        return 2 * n ** 3 / _median_seconds(lambda: torch.matmul(a, b, out=out), device, repeats)


@functools.cache
def device_limits(device: str | None = None) -> DeviceLimits:
    """This GPU's figures, measured once per process (CUDA, the current GPU by default); the
    documented H200 figures when there is no GPU. The buffers fit in what the engine leaves free
    (1 - gpu_memory_utilization), so it may run beside an engine."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return DeviceLimits(H200.copy_bytes_per_s, H200.bf16_flop_per_s,
                            f"no GPU ({device.type}): {H200.source}")
    free = torch.cuda.mem_get_info(device)[0]
    nbytes = min(1 << 30, free // 4)
    n = 8192 if free > 4 * 3 * 8192 ** 2 * 2 else 4096
    limits = DeviceLimits(measure_copy_bandwidth(device, nbytes), measure_bf16_peak(device, n),
                          f"measured on {torch.cuda.get_device_name(device)}")
    torch.cuda.empty_cache()   # the engine may count reserved memory as its own; give it back
    return limits


@dataclass(frozen=True)
class ModelShapes:
    """What the roofline needs of a decoder, in parameters (weights) and per-token sizes."""
    attention_layers: int  # layers that hold K/V: all but a hybrid model's linear-attention layers
    heads: int
    kv_heads: int
    head_dim: int
    body_params: int      # weights every token computes with: attention, linear attention, dense MLPs,
                          # routers, shared experts
    lm_head_params: int
    sparse_layers: int    # layers with experts (0 for a dense model)
    experts: int
    top_k: int
    expert_params: int    # gate, up and down of one expert
    linear_flops_per_token: int = 0   # the linear-attention layers' delta rule, beyond 2 per weight
    state_bytes_per_seq: int = 0      # a sequence's conv + recurrent state in all linear-attention layers
    weight_bytes: float = WEIGHT_BYTES   # of the body's and experts' weights (the LM head is bf16)

    @classmethod
    def from_config(cls, config: dict) -> "ModelShapes":
        """Dense Qwen3/Llama/Qwen2, Qwen3-MoE, or hybrid Qwen3.5/Qwen3.6/Qwen3-Next from the HF
        config.json (as a dict; a multimodal checkpoint's text_config is its decoder)."""
        config = decoder_config(config)
        experts = config.get("num_experts") or config.get("num_local_experts") or 0
        need = ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
        need += ["moe_intermediate_size", "num_experts_per_tok"] if experts else ["intermediate_size"]
        missing = [k for k in need if k not in config]
        if missing:
            raise ValueError(f"the model config lacks {', '.join(missing)}: pass a decoder's config.json")
        hidden, layers = config["hidden_size"], config["num_hidden_layers"]
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        sparse = _sparse_layers(config) if experts else 0
        if layers > sparse and "intermediate_size" not in config:   # an MoE model's dense layers
            raise ValueError(f"the model config lacks intermediate_size ({layers - sparse} of its layers "
                             "have a dense MLP): pass a decoder's config.json")
        linear = layer_kinds(config).count("linear_attention")
        mixer = linear_attention_shapes(config) if linear else LinearAttentionShapes(0, 0, 0)
        # a hybrid model's full attention gates its output: q_proj makes each head's gate too
        gated = linear > 0 and config.get("attn_output_gate", True)
        expert = 3 * hidden * config["moe_intermediate_size"] if experts else 0
        q_rows = (2 if gated else 1) * heads * head_dim
        attention = hidden * (q_rows + 2 * kv_heads * head_dim) + heads * head_dim * hidden   # qkv, o
        dense_mlp = 3 * hidden * config["intermediate_size"] if layers > sparse else 0   # gate_up, down
        routed = sparse * (experts * hidden + shared_expert_params(config))   # routers, shared experts
        body = (layers - linear) * attention + linear * mixer.params + (layers - sparse) * dense_mlp + routed
        return cls(layers - linear, heads, kv_heads, head_dim, body, config["vocab_size"] * hidden, sparse,
                   experts, config["num_experts_per_tok"] if experts else 0, expert,
                   linear * mixer.flops_per_token, linear * mixer.state_bytes)

    @property
    def active_params(self) -> int:
        """Weights one token computes with, LM head aside."""
        return self.body_params + self.sparse_layers * self.top_k * self.expert_params

    @property
    def kv_values_per_token(self) -> int:
        return 2 * self.attention_layers * self.kv_heads * self.head_dim

    @property
    def attention_flops_per_key(self) -> int:
        return 4 * self.attention_layers * self.heads * self.head_dim   # q.k and p.v, per query and key

    @property
    def gemm_time_factor(self) -> float:
        """A body GEMM FLOP's time in bf16 FLOPs: FP8 tensor cores run at twice the bf16 rate."""
        return 0.5 if self.weight_bytes == 1 else 1.0

    def params_read(self, batch: int) -> float:
        """Weights a decode step of `batch` sequences reads: all but the experts its batch misses."""
        touched = self.experts * (1 - (1 - self.top_k / self.experts) ** batch) if self.experts else 0
        return self.body_params + self.lm_head_params + self.sparse_layers * touched * self.expert_params

    def bytes_read(self, batch: int) -> float:
        """Weight bytes of a decode step: the body and experts at weight_bytes, the LM head in bf16."""
        body = self.params_read(batch) - self.lm_head_params
        return self.weight_bytes * body + WEIGHT_BYTES * self.lm_head_params


def _sparse_layers(config: dict) -> int:
    """Layers with experts: those not in mlp_only_layers, and of them every decoder_sparse_step-th
    (transformers' rule)."""
    step, dense = config.get("decoder_sparse_step") or 1, config.get("mlp_only_layers") or []
    return sum(i not in dense and (i + 1) % step == 0 for i in range(config["num_hidden_layers"]))


def prefill_flops(shapes: ModelShapes, prompt_lens: list[int]) -> float:
    return ((2 * shapes.active_params * shapes.gemm_time_factor + shapes.linear_flops_per_token)
            * sum(prompt_lens)
            + 2 * shapes.lm_head_params * len(prompt_lens)
            + sum(shapes.attention_flops_per_key * n * n / 2 for n in prompt_lens))


def decode_steps(shapes: ModelShapes, prompt_lens: list[int], output_lens: list[int],
                 kv_bytes: float) -> list[tuple[float, float]]:
    """(bytes moved, FLOPs) of each decode step."""
    steps = []
    for step in range(max(output_lens, default=0)):
        contexts = [n + step for n, out in zip(prompt_lens, output_lens) if step < out]
        reads = (shapes.bytes_read(len(contexts))
                 + shapes.kv_values_per_token * kv_bytes * sum(contexts)
                 + 2 * shapes.state_bytes_per_seq * len(contexts))   # each state read and written
        flops = ((2 * (shapes.active_params * shapes.gemm_time_factor + shapes.lm_head_params)
                  + shapes.linear_flops_per_token) * len(contexts)
                 + shapes.attention_flops_per_key * sum(contexts))
        steps.append((reads, flops))
    return steps


def prefill_seconds(shapes: ModelShapes, prompt_lens: list[int], gpu: DeviceLimits) -> float:
    return prefill_flops(shapes, prompt_lens) / gpu.bf16_flop_per_s


def decode_seconds(shapes: ModelShapes, prompt_lens: list[int], output_lens: list[int], gpu: DeviceLimits,
                   kv_bytes: float) -> float:
    """Each decode step at the larger of its reads at the copy bandwidth and its FLOPs at the peak."""
    return sum(max(reads / gpu.copy_bytes_per_s, flops / gpu.bf16_flop_per_s)
               for reads, flops in decode_steps(shapes, prompt_lens, output_lens, kv_bytes))


def workload_seconds(shapes: ModelShapes, prompt_lens: list[int], output_lens: list[int], gpu: DeviceLimits,
                     kv_bytes: float, bound: str) -> float:
    """"separate": prefill at the bf16 peak, then each decode step at the larger of its reads and
    its FLOPs; "overlap": the larger of all FLOPs at the peak and all decode reads at the copy
    bandwidth, as if prefill ran inside the memory-bound decode steps."""
    if bound == "separate":
        return (prefill_seconds(shapes, prompt_lens, gpu)
                + decode_seconds(shapes, prompt_lens, output_lens, gpu, kv_bytes))
    steps = decode_steps(shapes, prompt_lens, output_lens, kv_bytes)
    flops = prefill_flops(shapes, prompt_lens) + sum(f for _, f in steps)
    return max(flops / gpu.bf16_flop_per_s, sum(r for r, _ in steps) / gpu.copy_bytes_per_s)


BOUNDS = ("separate", "overlap")


def workload_limit(config: dict, prompt_lens: list[int], output_lens: list[int], gpu: DeviceLimits = H200,
                   tp: int = 1, kv_bytes: float = 2, dp: int = 1, bound: str = "separate",
                   weight_bytes: float = WEIGHT_BYTES) -> float:
    """Output tokens/s no engine can exceed on dp replicas of tp GPUs each with `gpu`'s figures, for
    prompts of prompt_lens tokens that each generate output_lens tokens (the module's docstring says
    what is counted). bound: "separate" phases (prefill steps, then decode steps) or "overlap"."""
    for name, value in (("tp", tp), ("dp", dp)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if kv_bytes <= 0:
        raise ValueError(f"kv_bytes (bytes per K/V value: 2 for bf16, 1 for fp8) must be positive, "
                         f"got {kv_bytes}")
    if len(prompt_lens) != len(output_lens) or not prompt_lens:
        raise ValueError("prompt_lens and output_lens must be non-empty lists of one length")
    if bound not in BOUNDS:
        raise ValueError(f"bound must be one of {BOUNDS}, got {bound!r}")
    if weight_bytes not in (1, 2):
        raise ValueError(f"weight_bytes must be 2 (bf16) or 1 (FP8), got {weight_bytes!r}")
    shapes = dataclasses.replace(ModelShapes.from_config(config), weight_bytes=weight_bytes)
    shares = [list(range(len(prompt_lens)))] if dp == 1 else _replica_shares(prompt_lens, output_lens, dp)
    slowest = max(workload_seconds(shapes, [prompt_lens[i] for i in share], [output_lens[i] for i in share],
                                   gpu, kv_bytes, bound)
                  for share in shares if share)
    return sum(output_lens) / (slowest / tp)


def _replica_shares(prompt_lens: list[int], output_lens: list[int], dp: int) -> list[list[int]]:
    # the engine's own split (no Ray needed)
    return assign_by_cost([request_cost(n, out) for n, out in zip(prompt_lens, output_lens)], dp)


def default_workload_lens(num_seqs: int = 256, max_input_len: int = 1024,
                          max_output_len: int = 1024) -> tuple[list[int], list[int]]:
    """bench.py's default workload's prompt and output lengths: the same draws from seed 0."""
    rng = random.Random(0)
    prompt_lens = [len([rng.randint(0, 10000) for _ in range(rng.randint(100, max_input_len))])
                   for _ in range(num_seqs)]
    return prompt_lens, [rng.randint(100, max_output_len) for _ in range(num_seqs)]


def main():
    import argparse
    import json
    import os
    p = argparse.ArgumentParser(description="This GPU's copy bandwidth and bf16 peak, and the limit of "
                                            "bench.py's default workload for each model folder given.")
    p.add_argument("model", nargs="*", help="model folders with a config.json")
    p.add_argument("--tp", type=int, nargs="+", default=[1], help="tensor-parallel sizes")
    p.add_argument("--kv-bytes", type=float, default=2, help="bytes per K/V value: 2 bf16, 1 fp8")
    args = p.parse_args()
    gpu = device_limits()
    print(f"copy {gpu.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 {gpu.bf16_flop_per_s / 1e12:.0f} TFLOP/s "
          f"({gpu.source})")
    prompt_lens, output_lens = default_workload_lens()
    for model in args.model:
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
        for tp in args.tp:
            for bound in BOUNDS:
                limit = workload_limit(config, prompt_lens, output_lens, gpu, tp, args.kv_bytes, bound=bound)
                documented = workload_limit(config, prompt_lens, output_lens, H200, tp, args.kv_bytes,
                                            bound=bound)
                print(f"{model} tp={tp} kv_bytes={args.kv_bytes:g} {bound}: limit {limit:,.0f} output tok/s "
                      f"({documented:,.0f} at the documented H200 figures)")

if __name__ == "__main__":
    main()
