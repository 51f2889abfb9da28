"""The server against offline generate, in one run on one GPU: bench.py's workload (its 256 random
token-id prompts of 100-1024 tokens, 100-1024 output tokens, ignore_eos) through LLM.generate, then
through `nanovllm serve` under benchmarks/serve_load.py's clients at each concurrency; prints each
figure and the server's share of the offline tokens/s (the goal: >= 85% at 256 streams).

    PYTHONPATH=. python benchmarks/serve_vs_offline.py configs/qwen3-0.6b --concurrency 64 256

A model folder without *.safetensors gets dummy weights (as bench.py). --stream-interval 1 4 serves
once per value (a server start each)."""

import argparse
import glob
import json
import multiprocessing
import os
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from bench import workload  # noqa: E402
from serve_load import describe, run_load  # noqa: E402

MAX_MODEL_LEN = 4096  # as bench.py


def offline_tokens_per_s(model: str, load_format: str, args) -> float:
    """LLM.generate on the workload, as bench.py times it (after a short warm-up)."""
    from nanovllm import LLM, SamplingParams

    prompts, params = workload(args.num_requests, args.max_input_len, args.max_output_len, args.temperature)
    llm = LLM(model, max_model_len=MAX_MODEL_LEN, load_format=load_format)
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
    finally:
        llm.shutdown()


def start_server(model: str, load_format: str, port: int, stream_interval: int, log) -> subprocess.Popen:
    command = [sys.executable, "-m", "nanovllm.serve", model, "--port", str(port),
               "--load-format", load_format, "--max-model-len", str(MAX_MODEL_LEN),
               "--stream-interval", str(stream_interval), "--log-level", "warning"]  # fmt: skip
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return server
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(
                    f"the server did not start (exit code {server.returncode}); see {log.name}"
                ) from None
            time.sleep(1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="configs/qwen3-0.6b")
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--stream-interval", type=int, nargs="+", default=[1])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--client-processes", type=int, default=0, help="default: one per 32 streams")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args()
    load_format = "auto" if glob.glob(os.path.join(args.model, "*.safetensors")) else "dummy"

    with multiprocessing.get_context("spawn").Pool(1) as pool:  # its own process: the GPU is free after
        offline = pool.apply(offline_tokens_per_s, (args.model, load_format, args))
    print(f"offline LLM.generate: {offline:,.0f} output tok/s", flush=True)
    figures = {
        "model": args.model,
        "load_format": load_format,
        "offline_output_tokens_per_s": offline,
        "runs": [],
    }
    prompts, params = workload(args.num_requests, args.max_input_len, args.max_output_len, args.temperature)
    url = f"http://127.0.0.1:{args.port}"
    for interval in args.stream_interval:
        with open(f"serve_vs_offline.server{interval}.log", "w") as log:
            server = start_server(args.model, load_format, args.port, interval, log)
            try:
                run_load(url, args.model, prompts[:8], params[:8], 8, 1)  # warm-up
                for c in args.concurrency:
                    r = run_load(url, args.model, prompts, params, c, args.client_processes)
                    r |= {
                        "stream_interval": interval,
                        "fraction_of_offline": r["output_tokens_per_s"] / offline,
                    }
                    figures["runs"].append(r)
                    print(f"stream-interval {interval}, {describe(r)}", flush=True)
                    print(
                        f"  the server at {c} streams: {r['fraction_of_offline']:.0%} of offline", flush=True
                    )
            finally:
                server.terminate()
                server.wait(60)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
