"""Throughput on nano-vllm's workload: 256 sequences, prompts of 100-1024 random tokens, 100-1024
output tokens each (133,966 in all), temperature 0.6, ignore_eos. With no checkpoint at hand it runs
the Qwen3-0.6B architecture (configs/qwen3-0.6b) with dummy weights. The figure is also given as a
fraction of the workload's physical limit on this GPU's measured copy bandwidth and bf16 peak
(nanovllm/utils/roofline.py; docs/benchmarks.md): for separate prefill and decode steps, and the
overlap bound no engine can pass. The timed run is cold: its prompts are new to the prefix cache.
--structured-json also runs the workload with every request constrained by one JSON schema.
--workload long: 256 prompts of 4,000-8,000 random tokens, 64 output tokens each (prefill-bound);
--ttft-32k also times the first token of one 32,768-token prompt; --prefill-attention picks the
prefill attention kernel (auto, flash_attn_4, triton, torch_flash; --attention-backend is its
deprecated former name, whose "triton" meant torch_flash).
--workload streams: per-stream decode speed at batch 1, 4 and 16 (128-token prompts, 512 output tokens
each): (seconds of 512 tokens - seconds of 1 token) per 511 tokens, medians of 3, against the bound of
one step's weight and K/V reads at the copy bandwidth (roofline.decode_seconds).
--lora N then runs the workload again on an engine with LoRA on, N random rank-16 adapters on every
linear layer spread round-robin over the requests, against the base run (against vLLM with the same
adapters and requests: benchmarks/vs_vllm.py --lora N)."""
import argparse
import dataclasses
import glob
import json
import os
import tempfile
import time
from random import randint, seed

from nanovllm import LLM, SamplingParams
from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.utils import roofline

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "qwen3-0.6b")
# --structured-json's schema: a record whose text is a list of 16 lists of 16 lists of at least 16
# strings of 16 characters (4,096 strings before it may close), which keeps a dummy-weight model inside
# the grammar up to max_tokens, so the constrained run computes the same tokens as the free one. Nested
# short counts, not one long one: xgrammar's matcher pays for a counted repetition (minItems 4096, a
# minLength 8192) in proportion to the items so far, on every fill and accept (on the H200 host, 256
# rows' fill grew to 10 ms a step by token 600 with minItems 4096; about 1 ms with nested counts of 16).
def _list_of(items: dict, min_items: int) -> dict:
    return {"type": "array", "minItems": min_items, "items": items}


STRUCTURED_SCHEMA = {"type": "object", "required": ["id", "text"],
                     "properties": {"id": {"type": "integer"},
                                    "text": _list_of(_list_of(_list_of(
                                        {"type": "string", "minLength": 16, "maxLength": 16}, 16), 16), 16)}}
STRUCTURED_TIME_LIMIT_S = 150   # then the structured run stops and reports how far it got


def workload(num_seqs: int, max_input_len: int, max_output_len: int, temperature: float):
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, max_input_len))] for _ in range(num_seqs)]
    params = [SamplingParams(temperature=temperature, ignore_eos=True,
                             max_tokens=randint(100, max_output_len)) for _ in range(num_seqs)]
    return prompts, params


def long_workload(num_seqs: int, temperature: float):
    """Long prompts (documents, retrieval, chat history): 4,000-8,000 tokens, 64 output tokens each."""
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(4000, 8000))] for _ in range(num_seqs)]
    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=64)
              for _ in range(num_seqs)]
    return prompts, params


TTFT_PROMPT_LEN = 32768


def time_to_first_token(llm, repeats: int = 3) -> float:
    """Median seconds to the first token of one TTFT_PROMPT_LEN-token prompt (after a warm-up of the
    same shape, which compiles whatever compiles); every run's prompt differs, so no prefix is cached."""
    seed(2)
    base = [randint(0, 10000) for _ in range(TTFT_PROMPT_LEN)]
    one = SamplingParams(temperature=0, max_tokens=1)
    times = [timed_generate(llm, [[(t + i) % 10000 for t in base]], one) for i in range(repeats + 1)]
    return sorted(times[1:])[repeats // 2]


def model_config(args) -> dict | None:
    """The model folder's config.json, or None without one."""
    path = os.path.join(args.model, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def kv_bytes(args) -> int:
    """Bytes of one cached K or V value: FP8 or the model's bf16."""
    return 1 if args.kv_cache_dtype != "auto" else 2


def weight_bytes(args) -> int:
    """Bytes of one weight: FP8 with --quantization fp8 or an FP8 checkpoint, else bf16."""
    fp8 = getattr(args, "quantization", None) == "fp8" or "quantization_config" in (model_config(args) or {})
    return 1 if fp8 else 2


def workload_limits(args, prompts, params, gpu: roofline.DeviceLimits):
    """(limit at `gpu`'s figures, limit at the documented H200 figures) in output tokens/s for the model
    folder's config.json and bench's parallelism and KV dtype; (None, None) without a config.json."""
    prompt_lens, output_lens = [len(p) for p in prompts], [sp.max_tokens for sp in params]
    config = model_config(args)
    if config is None:
        return None, None
    shape = dict(tp=args.tensor_parallel_size, dp=args.data_parallel_size, kv_bytes=kv_bytes(args),
                 weight_bytes=weight_bytes(args))
    return (roofline.workload_limit(config, prompt_lens, output_lens, gpu, **shape),
            roofline.workload_limit(config, prompt_lens, output_lens, roofline.H200, **shape))


def overlap_limit(args, prompts, params, gpu: roofline.DeviceLimits) -> float | None:
    """The overlap bound at `gpu`'s figures (roofline.workload_limit's bound="overlap"), or None
    without a config.json."""
    config = model_config(args)
    if config is None:
        return None
    return roofline.workload_limit(config, [len(p) for p in prompts], [sp.max_tokens for sp in params], gpu,
                                   tp=args.tensor_parallel_size, dp=args.data_parallel_size,
                                   kv_bytes=kv_bytes(args), bound="overlap", weight_bytes=weight_bytes(args))


def data_parallel_replicas(job, prompts, params, args, gpu: roofline.DeviceLimits) -> dict:
    """Where a data-parallel run's time went (job: the DataParallelEngine's last_job): each replica's
    share, the seconds inside its engine and, when the model folder has a config.json, its limit (its
    own prompts and outputs alone; the job's limit is the slowest replica's, as workload_limit's dp)."""
    config = model_config(args)
    shape = dict(tp=args.tensor_parallel_size, kv_bytes=kv_bytes(args), weight_bytes=weight_bytes(args))
    rows = []
    for r, share in sorted(job.shares.items()):
        prompt_lens, output_lens = [len(prompts[i]) for i in share], [params[i].max_tokens for i in share]
        row = dict(replica=r, prompts=len(share), prompt_tokens=sum(prompt_lens),
                   output_tokens=sum(output_lens), engine_s=round(job.engine_s[r], 3),
                   done_s=round(job.done_s[r], 3))
        if config and share:
            row["limit_s"] = round(sum(output_lens) / roofline.workload_limit(
                config, prompt_lens, output_lens, gpu, **shape), 3)
        rows.append(row)
    return dict(replicas=rows, wall_s=round(job.wall_s, 3), split_s=round(job.split_s, 4),
                driver_overhead_s=round(job.overhead_s, 3))


def print_data_parallel(replicas: dict, seconds: float):
    for row in replicas["replicas"]:
        of_limit = f", limit {row['limit_s']:.2f}s" if "limit_s" in row else ""
        print(f"  replica {row['replica']}: {row['prompts']} prompts, {row['prompt_tokens']} prompt + "
              f"{row['output_tokens']} output tok, engine {row['engine_s']:.2f}s{of_limit}, "
              f"outputs at {row['done_s']:.2f}s")
    print(f"  driver: {seconds:.2f}s in all, {replicas['driver_overhead_s']:.3f}s beyond the slowest "
          f"engine (splitting {replicas['split_s']:.3f}s)")


def prefix_cache_workload(num_seqs: int, prefix_len: int, seed_: int):
    """num_seqs prompts sharing a prefix_len-token system prompt, each with 32 tokens of its own."""
    seed(seed_)
    prefix = [randint(0, 10000) for _ in range(prefix_len)]
    return [prefix + [randint(0, 10000) for _ in range(32)] for _ in range(num_seqs)]


def timed_generate(llm, prompts, params, lora_request=None) -> float:
    t = time.perf_counter()
    if lora_request is None:
        llm.generate(prompts, params, use_tqdm=False)
    else:
        llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    return time.perf_counter() - t


LORA_RANK = 16
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_adapters(model: str, n: int, folder: str) -> list[str]:
    """n PEFT folders of random rank-16 LoRA on every linear layer of the model's decoder (bf16)."""
    import torch
    from safetensors.torch import save_file

    from nanovllm.lora.adapter import TARGETS, module_shapes
    from nanovllm.utils.hf_files import load_hf_config
    hf_config = load_hf_config(model)
    shapes, paths = module_shapes(hf_config), []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(hf_config.num_hidden_layers):
            for module in LORA_MODULES:
                fan_in, fan_out = shapes[module]
                key = f"base_model.model.model.layers.{layer}.{TARGETS[module][0]}.{module}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(LORA_RANK, fan_in, generator=g)
                                                   / fan_in ** 0.5).bfloat16()
                tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, LORA_RANK, generator=g)
                                                   * 0.01).bfloat16()
        path = os.path.join(folder, f"lora{i}")
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK,
                       "lora_alpha": 2 * LORA_RANK, "target_modules": LORA_MODULES, "lora_dropout": 0.0,
                       "bias": "none",
                       "base_model_name_or_path": model, "fan_in_fan_out": False, "use_rslora": False,
                       "use_dora": False, "modules_to_save": None}, f)
        paths.append(path)
    return paths


def lora_runs(args, options: dict, prompts, params, base_seconds: float, max_model_len: int) -> dict:
    """--lora N: the workload on a LoRA engine, request i under adapter i % N, against the base
    run (against vLLM with the same adapters: benchmarks/vs_vllm.py --lora N)."""
    from nanovllm import LoRARequest
    n, tokens = args.lora, sum(sp.max_tokens for sp in params)
    folder = tempfile.mkdtemp(prefix="bench_lora_")
    paths = random_adapters(args.model, n, folder)
    loras = [LoRARequest(f"lora{i}", i + 1, path) for i, path in enumerate(paths)]
    per_request = [loras[i % n] for i in range(len(prompts))]
    llm = LLM(args.model, enable_lora=True, max_loras=n, max_lora_rank=LORA_RANK, **options)
    llm.generate([[1, 2, 3]] * n, SamplingParams(max_tokens=8), use_tqdm=False, lora_request=loras)
    seconds = timed_generate(llm, prompts, params, per_request)
    llm.shutdown()
    record = dict(lora_adapters=n, lora_rank=LORA_RANK, lora_seconds=round(seconds, 3),
                  lora_tokens_per_s=round(tokens / seconds, 1), lora_vs_base=round(base_seconds / seconds, 3))
    print(f"LoRA: {n} adapters of rank {LORA_RANK} over {len(prompts)} requests: {tokens / seconds:.2f} "
          f"tok/s, {base_seconds / seconds:.3f} of the base model's {tokens / base_seconds:.2f}")
    return record


def structured_json(llm, prompts, params, free_seconds: float) -> dict:
    """The workload again, every request constrained by STRUCTURED_SCHEMA, against the free run."""
    schema = StructuredOutputsParams(json=STRUCTURED_SCHEMA)
    constrained = [SamplingParams(temperature=sp.temperature, ignore_eos=True, max_tokens=sp.max_tokens,
                                  structured_outputs=schema) for sp in params]
    t = time.perf_counter()
    llm.generate([[1, 2, 3]], constrained[0], use_tqdm=False)   # compiles the grammar (then cached)
    compile_seconds = time.perf_counter() - t
    t = time.perf_counter()
    try:
        outs = llm.generate(prompts, constrained, use_tqdm=LogProgress)
    except TimeoutError as e:
        print(f"Structured JSON: {e}")
        return dict(structured_timed_out=str(e))
    seconds = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    free = sum(sp.max_tokens for sp in params) / free_seconds
    early = sum(o.outputs[0].finish_reason != "length" for o in outs)   # ended by the grammar
    print(f"Structured JSON: {tokens} tok, Time: {seconds:.2f}s, Throughput: {tokens / seconds:.2f} tok/s, "
          f"{tokens / seconds / free - 1:+.1%} against free generation ({early} requests ended by the "
          f"grammar; first compile {compile_seconds:.1f}s)")
    return dict(structured_output_tokens=tokens, structured_seconds=round(seconds, 3),
                structured_tokens_per_s=round(tokens / seconds, 1),
                structured_vs_free=round(tokens / seconds / free, 3), structured_ended_early=early)


class LogProgress:
    """generate's progress as log lines, one every 10 s (tqdm-like: generate calls it so); past
    STRUCTURED_TIME_LIMIT_S it raises TimeoutError, which stops the run, saying how far it got."""

    def __init__(self, total: int, **_):
        self.total, self.done = total, 0
        self.start = self.last = time.perf_counter()

    def update(self, n: int):
        self.done += n

    def set_postfix_str(self, speeds: str, refresh: bool = True):
        if not refresh:
            return   # the run's summary, drawn at close
        now = time.perf_counter()
        progress = f"{now - self.start:.0f}s, {self.done} of {self.total} prompts done, {speeds}"
        if now - self.start > STRUCTURED_TIME_LIMIT_S:
            raise TimeoutError(f"stopped after {progress}")
        if now - self.last >= 10:
            self.last = now
            print(f"  structured: {progress}", flush=True)

    def close(self):
        pass


STREAM_BATCHES, STREAM_PROMPT_LEN, STREAM_TOKENS = (1, 4, 16), 128, 512


def stream_runs(llm, args, gpu: roofline.DeviceLimits) -> dict:
    """--workload streams: each batch size's per-stream decode tokens/s (the first token's time taken
    out: (N - 1) / (t(N tokens) - t(1 token)), medians of 3) and its bound at `gpu`'s figures."""
    seed(3)
    config, rows = model_config(args), []
    for batch in STREAM_BATCHES:
        prompts = [[randint(0, 10000) for _ in range(STREAM_PROMPT_LEN)] for _ in range(batch)]

        first, whole = (sorted(timed_generate(llm, prompts, SamplingParams(
            temperature=args.temperature, ignore_eos=True, max_tokens=n)) for _ in range(3))[1]
            for n in (1, STREAM_TOKENS))
        per_stream = (STREAM_TOKENS - 1) / (whole - first)
        row = dict(batch=batch, first_token_s=round(first, 4), seconds=round(whole, 3),
                   per_stream_tokens_per_s=round(per_stream, 1))
        if config is not None:
            shapes = dataclasses.replace(roofline.ModelShapes.from_config(config),
                                         weight_bytes=weight_bytes(args))
            steps = roofline.decode_seconds(shapes, [STREAM_PROMPT_LEN] * batch, [STREAM_TOKENS] * batch, gpu,
                                            kv_bytes(args)) / args.tensor_parallel_size
            row.update(bound_per_stream_tokens_per_s=round(STREAM_TOKENS / steps, 1),
                       fraction_of_bound=round(per_stream * steps / STREAM_TOKENS, 3))
        rows.append(row)
        bound = (f", {row['fraction_of_bound']:.1%} of the bound {row['bound_per_stream_tokens_per_s']:,.0f}"
                 if "fraction_of_bound" in row else "")
        print(f"Batch {batch}: {per_stream:,.1f} tok/s per stream{bound} (first token {first * 1000:.1f} ms)")
    return dict(streams=rows)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model folder (default: Qwen3-0.6B shapes)")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="apply each step before the next is launched")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="TP: every all-reduce through NCCL (default: decode-sized ones over peer memory)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="fp8: an e4m3 KV cache with per-layer scales (1.0 unless --calculate-kv-scales)")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: FP8 weights (a bf16 or dummy checkpoint is quantized at load, per channel; an "
                        "FP8 checkpoint runs in its own format); the limit counts FP8 weights then")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="fp8 scales from the first prefill's amax")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas on Ray (the ray extra), each with tensor-parallel-size GPUs")
    p.add_argument("--prefix-cache", action="store_true",
                   help="also measure prefill of 256 prompts sharing a 2,000-token prefix, cached vs not")
    p.add_argument("--structured-json", action="store_true",
                   help="also run the workload with every request constrained by one JSON schema (needs "
                        "xgrammar and --tokenizer; no prefix caching: no run reuses another's prompts)")
    p.add_argument("--tokenizer", help="tokenizer folder, for a model folder without one (--structured-json "
                                       "needs one no wider than the model's vocabulary: Qwen3-0.6B's, "
                                       "SmolLM2's)")
    p.add_argument("--workload", default="default", choices=["default", "long", "streams"],
                   help="long: 256 prompts of 4,000-8,000 tokens, 64 output tokens each; streams: per-stream "
                        "decode at batch 1, 4, 16")
    p.add_argument("--ttft-32k", action="store_true",
                   help=f"also time the first token of one {TTFT_PROMPT_LEN:,}-token prompt (median of 3)")
    p.add_argument("--prefill-attention", default="auto",
                   choices=["auto", "flash_attn_4", "triton", "torch_flash"],
                   help="FlashAttention-4 or our Triton kernel over the paged cache, or torch's "
                   "FlashAttention-2")
    p.add_argument("--attention-backend", choices=["auto", "flash_attn_4", "triton"],
                   help="deprecated: --prefill-attention (its 'triton' was torch_flash)")
    p.add_argument("--lora", type=int, default=0, metavar="N",
                   help="also run with N random rank-16 LoRA adapters spread over the requests (see above)")
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args()
    if args.attention_backend:
        if args.prefill_attention != "auto":
            p.error("give --prefill-attention only (--attention-backend is its deprecated name)")
        args.prefill_attention = {"triton": "torch_flash"}.get(args.attention_backend, args.attention_backend)
    max_model_len = 4096
    if args.workload == "long":
        max_model_len = 8192
    if args.ttft_32k:
        max_model_len = TTFT_PROMPT_LEN + 64

    dummy = not glob.glob(os.path.join(args.model, "*.safetensors"))
    t = time.perf_counter()
    options = dict(enforce_eager=args.enforce_eager, max_model_len=max_model_len,
                   tensor_parallel_size=args.tensor_parallel_size, load_format="dummy" if dummy else "auto",
                   async_scheduling=not args.no_async_scheduling, kv_cache_dtype=args.kv_cache_dtype,
                   calculate_kv_scales=args.calculate_kv_scales, tokenizer=args.tokenizer,
                   enable_prefix_caching=not args.structured_json, prefill_attention=args.prefill_attention,
                   disable_custom_all_reduce=args.disable_custom_all_reduce, quantization=args.quantization)
    llm = LLM(args.model, data_parallel_size=args.data_parallel_size, **options)
    startup = time.perf_counter() - t

    if args.workload == "long":
        prompts, params = long_workload(args.num_seqs, args.temperature)
    else:
        prompts, params = workload(args.num_seqs, args.max_input_len, args.max_output_len, args.temperature)
    # Warm-up: one prompt per replica (equal prompts are spread one to each).
    llm.generate([[1, 2, 3]] * args.data_parallel_size, SamplingParams(max_tokens=8), use_tqdm=False)
    if args.workload == "streams":
        record = dict(model=args.model, workload="streams", temperature=args.temperature,
                      startup_s=round(startup, 2), **stream_runs(llm, args, roofline.device_limits()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
        return
    seconds = timed_generate(llm, prompts, params)
    tokens = sum(sp.max_tokens for sp in params)
    # This GPU's figures, measured after the run, in the memory the engine leaves free.
    gpu = roofline.device_limits()
    limit, documented = workload_limits(args, prompts, params, gpu)
    overlap = overlap_limit(args, prompts, params, gpu)
    runner = getattr(llm, "model_runner", None)   # a data-parallel LLM's runners live in its replicas
    prefill = runner.prefill_attention.name if runner else args.prefill_attention
    prompt_tokens = sum(map(len, prompts))
    record = dict(model=args.model, dummy_weights=dummy, temperature=args.temperature,
                  workload=args.workload, prefill_attention=prefill, prompt_tokens=prompt_tokens,
                  total_tokens_per_s=round((prompt_tokens + tokens) / seconds, 1),
                  enforce_eager=args.enforce_eager, async_scheduling=not args.no_async_scheduling,
                  tp=args.tensor_parallel_size, custom_all_reduce=not args.disable_custom_all_reduce,
                  dp=args.data_parallel_size,
                  kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
                  quantization=args.quantization,
                  kv_cache_tokens=runner.num_kvcache_blocks * runner.block_size if runner else None,
                  startup_s=round(startup, 2),
                  output_tokens=tokens, seconds=round(seconds, 3), tokens_per_s=round(tokens / seconds, 1),
                  h200_limit_tokens_per_s=round(limit) if limit else None,
                  fraction_of_h200_limit=round(tokens / seconds / limit, 3) if limit else None,
                  overlap_limit_tokens_per_s=round(overlap) if overlap else None,
                  fraction_of_overlap_limit=round(tokens / seconds / overlap, 3) if overlap else None,
                  copy_bytes_per_s=gpu.copy_bytes_per_s, bf16_flop_per_s=gpu.bf16_flop_per_s,
                  limit_figures=gpu.source,
                  documented_h200_limit_tokens_per_s=round(documented) if limit else None)
    startup_phases = runner.startup_seconds if runner else llm.startup_seconds   # DP: the driver's view
    record["startup_phases_s"] = {k: round(v, 2) for k, v in startup_phases.items()}
    fraction = record["fraction_of_h200_limit"]
    of_limit = f" ({fraction:.1%} of the limit, {limit:,.0f})" if limit else ""
    if record["kv_cache_tokens"] is not None:   # (a data-parallel LLM's caches are in its replicas)
        of_limit += f", KV cache {args.kv_cache_dtype} {record['kv_cache_tokens']:,} tokens"
    of_limit += f", {args.data_parallel_size} data-parallel replicas" if args.data_parallel_size > 1 else ""
    phases = ", ".join(f"{k} {v}s" for k, v in record["startup_phases_s"].items())
    print(f"Total: {tokens} tok, Time: {seconds:.2f}s, Throughput: {tokens / seconds:.2f} tok/s{of_limit}, "
          f"start-up {startup:.1f}s" + (f" ({phases})" if phases else ""))
    if limit:
        gpus = args.data_parallel_size * args.tensor_parallel_size
        print(f"Limit, separate phases: {limit:,.0f} output tok/s on {gpus} "
              f"GPU(s) at copy {gpu.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 {gpu.bf16_flop_per_s / 1e12:.0f} "
              f"TFLOP/s ({gpu.source})" + ("" if documented == limit else
                                           f"; at the documented H200 figures {documented:,.0f} "
                                           f"({tokens / seconds / documented:.1%} of it)"))
        print(f"Limit, prefill overlapped with decode: {overlap:,.0f} output tok/s "
              f"({tokens / seconds / overlap:.1%} of it)")
    print(f"Workload {args.workload}, prefill attention {prefill}: {prompt_tokens} prompt + {tokens} output "
          f"tok, {(prompt_tokens + tokens) / seconds:.0f} tok/s prompt and output together")
    if args.data_parallel_size > 1:
        record["data_parallel"] = data_parallel_replicas(llm.last_job, prompts, params, args, gpu)
        print_data_parallel(record["data_parallel"], seconds)
    if args.ttft_32k:
        ttft = time_to_first_token(llm)
        record["ttft_32k_s"] = round(ttft, 4)
        print(f"Time to first token, one {TTFT_PROMPT_LEN:,}-token prompt: {ttft * 1000:.1f} ms "
              f"(median of 3, prefill attention {prefill})")

    if args.prefix_cache:
        one = SamplingParams(temperature=0, max_tokens=1)
        cold = prefix_cache_workload(256, 2000, seed_=1)
        fresh = [[(t + 1 + i) % 10000 for t in p] for i, p in enumerate(cold)]   # no shared prefix
        no_cache = timed_generate(llm, fresh, one)
        timed_generate(llm, cold, one)             # fills the prefix cache
        cached = timed_generate(llm, cold, one)    # every prompt now reuses the 2,000-token prefix
        n = sum(len(p) for p in cold)
        record.update(prefix_prompt_tokens=n, prefill_tokens_per_s_no_cache=round(n / no_cache, 1),
                      prefill_tokens_per_s_cached=round(n / cached, 1))
        print(f"Prefix cache: {n} prompt tok, no cache {n / no_cache:.0f} tok/s, "
              f"shared 2,000-token prefix cached {n / cached:.0f} tok/s ({no_cache / cached:.1f}x)")
    if args.structured_json:
        record.update(structured_json(llm, prompts, params, seconds))
    if args.lora:
        llm.shutdown()   # its memory goes to the LoRA engine
        record.update(lora_runs(args, options, prompts, params, seconds, max_model_len))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
