"""nanovllm against an installed vLLM on bench.py's workloads, one engine after the other in one process
tree (each in a child process of its own, so each starts with the whole GPU), and the ratio.

Both engines get the same prompts and output lengths (bench.py's `workload` / `long_workload`, seed 0),
dummy weights, no tokenizer, temperature 0.6 with ignore_eos, their default options otherwise, one
warm-up generate, then --runs timed generate calls of the same prompts. With --prefix-caching off (the
default here) every run is a cold run and the ratio is best run over best run. With it on (both engines'
own default), a run after the first finds the prompts' blocks in the prefix cache (vLLM caches blocks of
16 tokens; nanovllm shares blocks of 256 and copies the rows of a partly matching block, at least 16),
so the first runs are compared, and the best later runs.

--profile adds, for each engine, a profiled run in a further child (vLLM with its engine core in-process,
VLLM_ENABLE_V1_MULTIPROCESSING=0): every model step is labelled by its kind (prefill, mixed, decode by
batch size), and torch.profiler's GPU kernels are summed per kind and per category (GEMMs, attention,
communication, copies, other kernels), beside the GPU's idle time. The tables go to stdout and to
--out (a text file and a JSON file per engine).

    python benchmarks/vs_vllm.py --model configs/qwen3-8b [--workload long] [--kv-cache-dtype fp8]
                                 [--runs 3] [--profile] [--engines vllm nanovllm] [--out DIR]

vLLM may live outside the active environment: --vllm-path DIR is put in front of the vLLM child's
PYTHONPATH only.

Mixture-of-experts models: with dummy weights vLLM 0.24's routers send nearly every token of a decode
step to the same few experts (its expert GEMMs then read a fraction of the weights), while nanovllm's
dummy weights route uniformly, as trained routers roughly do at these batch sizes. So by default
(--vllm-moe-routing uniform) vLLM's child runs with its routing simulator,
VLLM_MOE_ROUTING_SIMULATION_STRATEGY=uniform_random (each token's top-k experts drawn uniformly, in
place of its gating kernel); --vllm-moe-routing model keeps its router. Dense models are unaffected."""
import argparse
import bisect
import contextlib
import gzip
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Kernel categories, by name (first match wins; "moe": the experts' grouped GEMMs); everything else is
# "other" (norms, rotary, activation, sampling, routing, torch.compile's fused elementwise kernels).
CATEGORIES = [
    ("moe", re.compile(r"fused_moe|moe_mm|grouped_gemm|^_gate_up_kernel|^_down_kernel", re.I)),
    ("attention", re.compile(r"flash|fmha|attn|attention|_decode_|_prefill_kernel|paged|_fwd_kernel"
                             r"|split_merge|reduce_segm", re.I)),
    ("gemm", re.compile(r"nvjet|gemm|cutlass|xmma|cublas|splitKreduce|sm90_|wgmma|_mm_|matmul", re.I)),
    ("comm", re.compile(r"nccl|all_reduce|allreduce|cross_device", re.I)),
    ("copy", re.compile(r"^Memcpy|^Memset|copy_kernel|CatArrayBatched|gather|index_", re.I)),
]


def category(name: str) -> str:
    return next((label for label, pattern in CATEGORIES if pattern.search(name)), "other")


def batch_bucket(n: int) -> str:
    for top in (8, 32, 64, 128, 192, 256):
        if n <= top:
            return f"<={top}"
    return ">256"


# ---- the workload ---------------------------------------------------------------------------------

STREAM_KINDS = ("batch1", "batch4", "batch16")


def workload(kind: str, num_seqs: int = 256):
    """bench.py's prompts and output lengths (seed 0); batchB: bench.py --workload streams' B prompts of
    128 tokens, 512 output tokens each (tok/s / B: per-stream speed, the first token included)."""
    from bench import STREAM_PROMPT_LEN, STREAM_TOKENS, long_workload, workload as default_workload
    if kind in STREAM_KINDS:
        rng = random.Random(3)
        batch = int(kind.removeprefix("batch"))
        return ([[rng.randint(0, 10000) for _ in range(STREAM_PROMPT_LEN)] for _ in range(batch)],
                [STREAM_TOKENS] * batch)
    prompts, params = (long_workload(num_seqs, 0.6) if kind == "long"
                       else default_workload(num_seqs, 1024, 1024, 0.6))
    return prompts, [sp.max_tokens for sp in params]


def max_model_len(kind: str) -> int:
    return 8192 if kind == "long" else 4096


def is_moe(model: str) -> bool:
    """Whether the model folder's config.json has routed experts (no config.json: False)."""
    path = os.path.join(model if os.path.isabs(model) else os.path.join(ROOT, model), "config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        config = json.load(f)
    config = config.get("text_config") or config   # a multimodal checkpoint's decoder (Qwen3.6-35B-A3B)
    return any(config.get(key) for key in ("num_experts", "n_routed_experts", "num_local_experts"))


ROUTING_VAR = "VLLM_MOE_ROUTING_SIMULATION_STRATEGY"


def vllm_env(args) -> dict:
    """Environment variables for vLLM's child beyond the defaults: uniform simulated routing for a
    mixture-of-experts model unless --vllm-moe-routing model (see the module's docstring)."""
    if args.vllm_moe_routing == "uniform" and is_moe(args.model):
        return {ROUTING_VAR: "uniform_random"}
    return {}


# ---- one engine, in a child process ---------------------------------------------------------------

class Engine:
    """One engine's generate on token-id prompts, and the hooks that label its steps."""
    name = ""

    def generate(self, prompts, max_tokens): ...

    def label_steps(self, labels: list): ...


def lora_options(adapters: list[str]) -> dict:
    """LoRA on, one GPU slot per adapter, when there are adapters."""
    from bench import LORA_RANK
    return dict(enable_lora=True, max_loras=len(adapters), max_lora_rank=LORA_RANK) if adapters else {}


def per_request(loras: list, num_prompts: int) -> dict:
    """generate's lora_request argument: request i under adapter i % N (none without adapters)."""
    return dict(lora_request=[loras[i % len(loras)] for i in range(num_prompts)]) if loras else {}


class NanoEngine(Engine):
    name = "nanovllm"

    def __init__(self, args, adapters: list[str]):
        from nanovllm import LLM, LoRARequest
        options = dict(kv_cache_dtype=args.kv_cache_dtype, max_model_len=max_model_len(args.workload),
                       enable_prefix_caching=args.prefix_caching == "on", **lora_options(adapters))
        options.update(parse_options(args.nano_option))
        self.llm = LLM(os.path.join(ROOT, args.model) if not os.path.isabs(args.model) else args.model,
                       load_format="dummy", skip_tokenizer_init=True, **options)
        self.loras = [LoRARequest(f"lora{i}", i + 1, path) for i, path in enumerate(adapters)]

    def generate(self, prompts, max_tokens):
        from nanovllm import SamplingParams
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m, detokenize=False)
                  for m in max_tokens]
        outs = self.llm.generate(prompts, params, use_tqdm=False, **per_request(self.loras, len(prompts)))
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def label_steps(self, labels: list):
        """Each launched step in a profiler range named by its kind; `labels` gets (time, kind,
        tokens, seqs) per step."""
        import torch
        runner = self.llm.model_runner
        launch = runner.launch

        def labelled(batch, *a, **kw):
            if batch.is_prefill:
                kind = "prefill"
            else:
                kind = f"decode {batch_bucket(len(batch.seqs))}"
            labels.append((time.perf_counter(), kind, batch.num_tokens, len(batch.seqs)))
            with torch.profiler.record_function(f"step|{kind}"):
                return launch(batch, *a, **kw)
        runner.launch = labelled


class VllmEngine(Engine):
    name = "vllm"

    def __init__(self, args, adapters: list[str]):
        import importlib.util
        if importlib.util.find_spec("flashinfer") is None:   # vLLM's LoRA runner imports it for sampling
            os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        from vllm import LLM
        from vllm.lora.request import LoRARequest
        options = dict(lora_options(adapters), **parse_options(args.vllm_option))
        self.llm = LLM(os.path.join(ROOT, args.model) if not os.path.isabs(args.model) else args.model,
                       load_format="dummy", skip_tokenizer_init=True, seed=0,
                       kv_cache_dtype=args.kv_cache_dtype, max_model_len=max_model_len(args.workload),
                       enable_prefix_caching=args.prefix_caching == "on", **options)
        self.loras = [LoRARequest(f"lora{i}", i + 1, path) for i, path in enumerate(adapters)]

    def generate(self, prompts, max_tokens):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m, detokenize=False)
                  for m in max_tokens]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                                 **per_request(self.loras, len(prompts)))
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def label_steps(self, labels: list):
        """vLLM's model runner (in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0): execute_model and
        sample_tokens in profiler ranges named by the step's kind. vLLM 0.24 runs the runner of
        vllm/v1/worker/gpu/ by default and the older gpu_model_runner on request: both are patched."""
        import importlib
        for module in ("vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner"):
            try:
                cls = importlib.import_module(module).GPUModelRunner
            except (ImportError, AttributeError) as e:
                print(f"vllm: {module} not labelled ({e})", flush=True)
                continue
            _label_runner(cls, labels)


def _label_runner(cls, labels: list):
    import torch
    execute, sample = cls.execute_model, getattr(cls, "sample_tokens", None)
    last = {"kind": "none"}

    def execute_model(runner, scheduler_output, *a, **kw):
        if kw.get("dummy_run"):
            return execute(runner, scheduler_output, *a, **kw)
        counts = list(scheduler_output.num_scheduled_tokens.values())
        decodes = sum(c == 1 for c in counts)
        if not counts:
            kind = "empty"
        elif decodes == len(counts):
            kind = f"decode {batch_bucket(decodes)}"
        elif decodes == 0:
            kind = "prefill"
        else:
            kind = "mixed"
        last["kind"] = kind
        labels.append((time.perf_counter(), kind, sum(counts), len(counts)))
        with torch.profiler.record_function(f"step|{kind}"):
            return execute(runner, scheduler_output, *a, **kw)

    def sample_tokens(runner, *a, **kw):
        with torch.profiler.record_function(f"step|{last['kind']}"):
            return sample(runner, *a, **kw)
    cls.execute_model = execute_model
    if sample is not None:
        cls.sample_tokens = sample_tokens


def parse_options(pairs: list[str]) -> dict:
    """["max_num_seqs=256", ...] -> {"max_num_seqs": 256, ...} (values read as JSON where they parse)."""
    out = {}
    for pair in pairs or []:
        key, _, value = pair.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def child(args) -> dict:
    """Start the engine, warm up, time args.runs generate calls (or one profiled call)."""
    prompts, max_tokens = workload(args.workload, args.num_seqs)
    adapters = []
    if args.lora:   # the same random adapters in each engine's child (bench.py's, seeded by index)
        from bench import random_adapters
        adapters = random_adapters(args.model, args.lora, tempfile.mkdtemp(prefix="vs_vllm_lora_"))
    t = time.perf_counter()
    engine = (VllmEngine if args.child == "vllm" else NanoEngine)(args, adapters)
    record = dict(engine=args.child, model=args.model, workload=args.workload, lora=args.lora,
                  kv_cache_dtype=args.kv_cache_dtype, startup_s=round(time.perf_counter() - t, 2), runs=[])
    if args.child == "vllm":
        import vllm
        record["version"] = vllm.__version__
    warm = max(1, args.lora)
    engine.generate([[1, 2, 3]] * warm, [8] * warm)   # warm-up (every adapter loaded)
    if args.profile_child:
        record["profile"] = profile_run(engine, prompts, max_tokens, args)
        return record
    for _ in range(args.runs):
        t = time.perf_counter()
        tokens = engine.generate(prompts, max_tokens)
        seconds = time.perf_counter() - t
        record["runs"].append(dict(seconds=round(seconds, 3), output_tokens=tokens,
                                   tok_s=round(tokens / seconds, 1)))
        print(f"{args.child} {args.workload} kv={args.kv_cache_dtype}: {tokens} tok in {seconds:.2f}s "
              f"= {tokens / seconds:,.0f} tok/s", flush=True)
    return record


# ---- the profile ----------------------------------------------------------------------------------

def profile_run(engine: Engine, prompts, max_tokens, args) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    labels = []
    engine.label_steps(labels)
    engine.generate(prompts[:8], [4] * len(prompts[:8]))   # the hooks in place before the timed part
    labels.clear()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        tokens = engine.generate(prompts, max_tokens)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    summary = summarize_trace(trace["traceEvents"])
    summary.update(seconds=round(seconds, 3), output_tokens=tokens, steps=step_table(labels, seconds))
    if args.out:
        kernels = [e for e in trace["traceEvents"] if e.get("cat") == "kernel"]
        with gzip.open(os.path.join(args.out, f"kernels_{args.child}_{tag(args)}.json.gz"), "wt") as f:
            json.dump([[e["name"][:80], e["ts"], e["dur"]] for e in kernels], f)
    return summary


def summarize_trace(events: list[dict]) -> dict:
    """GPU kernel time by step kind and category (a kernel belongs to the step whose host range
    launched it), the busiest kernels, and the GPU's busy and idle time over the profiled span."""
    ranges = sorted((e["ts"], e["ts"] + e["dur"], e["name"].split("|", 1)[1]) for e in events
                    if e.get("cat") == "user_annotation" and e.get("name", "").startswith("step|"))
    starts = [r[0] for r in ranges]
    launches = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e["ts"]
    by_kind = defaultdict(lambda: defaultdict(float))
    by_name = defaultdict(float)
    spans = []
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        ms = e["dur"] / 1e3
        spans.append((e["ts"], e["ts"] + e["dur"]))
        kind = "unlabelled"
        launched = launches.get(e.get("args", {}).get("correlation"))
        if launched is not None:
            i = bisect.bisect_right(starts, launched) - 1
            if i >= 0 and launched <= ranges[i][1]:
                kind = ranges[i][2]
        name = e["name"] if e.get("cat") == "kernel" else ("Memcpy" if e["cat"] == "gpu_memcpy" else "Memset")
        by_kind[kind][category(name)] += ms
        by_name[name] += ms
    spans.sort()
    busy, end = 0.0, None
    first = spans[0][0] if spans else 0
    for s, e in spans:
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    span_ms = ((end or first) - first) / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:25]
    return dict(gpu_busy_ms=round(busy / 1e3, 1), gpu_span_ms=round(span_ms, 1),
                gpu_idle_ms=round(span_ms - busy / 1e3, 1),
                by_kind={k: {c: round(v, 2) for c, v in cats.items()} for k, cats in by_kind.items()},
                top_kernels=[(n[:90], round(v, 2)) for n, v in top])


def step_table(labels: list, seconds: float) -> dict:
    """Per step kind: steps, host seconds from one step's launch to the next (the last to the end), tokens."""
    table = defaultdict(lambda: dict(steps=0, host_s=0.0, tokens=0))
    for i, (t, kind, tokens, _) in enumerate(labels):
        following = labels[i + 1][0] if i + 1 < len(labels) else labels[0][0] + seconds
        row = table[kind]
        row["steps"] += 1
        row["host_s"] += following - t
        row["tokens"] += tokens
    return {k: dict(v, host_s=round(v["host_s"], 3)) for k, v in sorted(table.items())}


def format_profile(engine: str, p: dict) -> str:
    lines = [f"{engine}: profiled run {p['seconds']:.2f}s, {p['output_tokens']} output tokens; GPU busy "
             f"{p['gpu_busy_ms'] / 1e3:.2f}s, idle {p['gpu_idle_ms'] / 1e3:.2f}s "
             f"of {p['gpu_span_ms'] / 1e3:.2f}s"]
    cats = ["gemm", "moe", "attention", "other", "copy", "comm"]
    lines.append(f"  {'step kind':<16}{'steps':>7}{'host s':>9}{'tokens':>9}" +
                 "".join(f"{c + ' s':>12}" for c in cats) + f"{'GPU s':>9}")
    kinds = sorted(set(p["steps"]) | set(p["by_kind"]))
    for kind in kinds:
        row, gpu = p["steps"].get(kind, dict(steps=0, host_s=0.0, tokens=0)), p["by_kind"].get(kind, {})
        lines.append(f"  {kind:<16}{row['steps']:>7}{row['host_s']:>9.3f}{row['tokens']:>9}" +
                     "".join(f"{gpu.get(c, 0) / 1e3:>12.3f}" for c in cats)
                     + f"{sum(gpu.values()) / 1e3:>9.3f}")
    lines.append("  busiest kernels (s):")
    lines += [f"    {ms / 1e3:8.3f}  [{category(name)}] {name}" for name, ms in p["top_kernels"]]
    return "\n".join(lines)


# ---- the parent -----------------------------------------------------------------------------------

def tag(args) -> str:
    name = os.path.basename(os.path.normpath(args.model))
    lora = f"_lora{args.lora}" if args.lora else ""
    # each distinct --nano-option / --vllm-option, e.g. _quantization-fp8
    options = "".join(f"_{o.replace('=', '-')}" for o in dict.fromkeys(args.nano_option + args.vllm_option))
    for knob in args.nano_set:   # e.g. _FAST_ACCUM-False
        target, _, value = knob.partition("=")
        options += "_" + re.sub(r"[^\w.-]", "", f"{target.rpartition('.')[2]}-{value}")
    routing = f"_vllm-routing-{args.vllm_moe_routing}" if is_moe(args.model) else ""
    return f"{name}_{args.workload}_{args.kv_cache_dtype}{lora}{options}{routing}_cache-{args.prefix_caching}"


def wait_gpu_free(timeout: float = 60):
    """Until nvidia-smi shows (almost) no memory in use: vLLM's engine-core process may outlive its parent."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=20).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            return
        if not used or max(map(int, used)) < 2000:
            return
        time.sleep(1)


def run_child(args, engine: str, profile: bool) -> dict | None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.vllm_path if engine == "vllm" else None, ROOT,
                                                      env.get("PYTHONPATH")]))
    if engine == "vllm":
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        # The child imports bench.py (and so torch and nanovllm) before vLLM starts its engine core:
        # a forked engine core could not use CUDA then.
        env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if profile:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.pop(ROUTING_VAR, None)   # vLLM's own router unless vllm_env sets it
        env.update(vllm_env(args))
    else:   # in the child's environment from its start, so its nanovllm reads them as it is imported
        from bench_with import checked_knobs
        env.update(checked_knobs(args.nano_set))
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--child", engine, "--result", result,
           "--model", args.model, "--workload", args.workload, "--kv-cache-dtype", args.kv_cache_dtype,
           "--runs", str(args.runs), "--num-seqs", str(args.num_seqs),
           "--prefix-caching", args.prefix_caching, "--lora", str(args.lora),
           "--vllm-moe-routing", args.vllm_moe_routing]
    cmd += ["--profile-child"] if profile else []
    cmd += [x for o in args.nano_option for x in ("--nano-option", o)]
    cmd += [x for o in args.vllm_option for x in ("--vllm-option", o)]
    if args.out:
        cmd += ["--out", args.out]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"{engine}: no result within {args.timeout}s", flush=True)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)   # and any process it left (vLLM's engine core)
        proc.wait()
        wait_gpu_free()
    try:
        with open(result) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        print(f"{engine}: the child exited with {proc.returncode} and wrote no result", flush=True)
        return None
    finally:
        os.unlink(result)


def best(record: dict | None, runs: slice) -> float | None:
    """Best tok/s of a record's runs in that slice."""
    if not record or not record["runs"][runs]:
        return None
    return max(r["tok_s"] for r in record["runs"][runs])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="configs/qwen3-0.6b")
    p.add_argument("--workload", default="default", choices=["default", "long", *STREAM_KINDS])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--num-seqs", type=int, default=256,
                   help="the workload's first N prompts (256: bench.py's)")
    p.add_argument("--prefix-caching", default="off", choices=["off", "on"],
                   help="off (default): every run is a cold run; on (both engines' default): from the second "
                        "run on, the repeated prompts hit the prefix cache")
    p.add_argument("--lora", type=int, default=0, metavar="N",
                   help="N random rank-16 adapters (bench.py's) on every linear layer, request i under "
                        "adapter i %% N, one GPU slot each, in both engines")
    p.add_argument("--engines", nargs="+", default=["vllm", "nanovllm"], choices=["vllm", "nanovllm"])
    p.add_argument("--profile", action="store_true", help="also one profiled run per engine")
    p.add_argument("--no-timing", action="store_true", help="only the profiled runs")
    p.add_argument("--vllm-path", help="a folder to put first on the vLLM child's PYTHONPATH")
    p.add_argument("--nano-option", action="append", default=[], help="KEY=VALUE for nanovllm's LLM()")
    p.add_argument("--vllm-option", action="append", default=[], help="KEY=VALUE for vLLM's LLM()")
    p.add_argument("--nano-set", action="append", default=[], metavar="NAME=VALUE",
                   help="a nanovllm knob (an environment variable of nanovllm/envs.py, as bench_with.py "
                        "takes them) in the nanovllm child's environment")
    p.add_argument("--vllm-moe-routing", default="uniform", choices=["uniform", "model"],
                   help="mixture-of-experts models: vLLM's routing simulator draws each token's experts "
                        "uniformly (default), or its router runs on the dummy weights (model)")
    p.add_argument("--timeout", type=float, default=480, help="seconds per child")
    p.add_argument("--out", help="folder for the JSON records and profiles")
    p.add_argument("--child", choices=["vllm", "nanovllm"], help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--profile-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    if args.child:
        record = child(args)
        with open(args.result, "w") as f:
            json.dump(record, f)
        sys.stdout.flush()
        os._exit(0)   # vLLM's shutdown can take long; the parent ends what is left
    records = {}
    for engine in args.engines:
        if not args.no_timing:
            records[engine] = run_child(args, engine, profile=False)
        if args.profile:
            prof = run_child(args, engine, profile=True)
            if prof:
                text = format_profile(engine, prof["profile"])
                print(text, flush=True)
                if args.out:
                    with open(os.path.join(args.out, f"profile_{engine}_{tag(args)}.txt"), "w") as f:
                        f.write(text + "\n")
                records[f"{engine}_profile"] = prof
    if args.out:
        records["options"] = {"nanovllm": args.nano_option, "vllm": args.vllm_option,
                              "nanovllm_set": args.nano_set}
        if "vllm" in args.engines:
            records["options"]["vllm_env"] = vllm_env(args)
        with open(os.path.join(args.out, f"vs_vllm_{tag(args)}.json"), "w") as f:
            json.dump(records, f, indent=1)
    for engine in args.engines:
        rec = records.get(engine)
        if rec:
            runs = ", ".join(f"{r['tok_s']:,.0f}" for r in rec["runs"])
            print(f"{engine}: start-up {rec['startup_s']:.1f}s, runs {runs} tok/s", flush=True)
    comparisons = ([("cold, best run", slice(None))] if args.prefix_caching == "off" else
                   [("first run (cold)", slice(0, 1)),
                    ("best later run (prefix cache hits)", slice(1, None))])
    for label, runs in comparisons:
        ours, theirs = best(records.get("nanovllm"), runs), best(records.get("vllm"), runs)
        if ours and theirs:
            print(f"{tag(args)}, {label}: nanovllm {ours:,.0f} tok/s / vLLM {theirs:,.0f} = "
                  f"{ours / theirs:.3f}x", flush=True)


if __name__ == "__main__":
    main()
