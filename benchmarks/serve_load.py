"""Load on a running `nanovllm serve`: N concurrent streaming clients send bench.py's workload
(token-id prompts, ignore_eos, fixed output lengths) to /v1/completions and report requests/s,
output tokens/s, time to first token and inter-token latency (p50/p99).

    nanovllm serve configs/qwen3-0.6b --load-format dummy --port 8000 &
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --concurrency 256 --offline configs/qwen3-0.6b

--offline MODEL also runs the same prompts through LLM.generate in this process first (the server
must then be on another GPU, or started after), for the offline figure to compare with."""

import argparse
import asyncio
import json
import os
import sys
import time

import openai

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench import workload  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def one_stream(client, model: str, prompt: list[int], max_tokens: int, temperature: float) -> dict:
    start = time.perf_counter()
    stamps, usage = [], None
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage
    return {"start": start, "stamps": stamps, "tokens": usage.completion_tokens if usage else len(stamps)}


async def run_load(url: str, model: str, prompts, params, concurrency: int) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    gate = asyncio.Semaphore(concurrency)

    async def limited(prompt, p):
        async with gate:
            return await one_stream(client, model, prompt, p.max_tokens, p.temperature)

    t = time.perf_counter()
    results = await asyncio.gather(*(limited(pr, p) for pr, p in zip(prompts, params)))
    wall = time.perf_counter() - t
    await client.close()
    ttft = [r["stamps"][0] - r["start"] for r in results if r["stamps"]]
    itl = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])]
    tokens = sum(r["tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "output_tokens_per_s": tokens / wall,
        "output_tokens": tokens,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "itl_p50_ms": 1e3 * percentile(itl, 0.5),
        "itl_p99_ms": 1e3 * percentile(itl, 0.99),
    }


def offline(model: str, prompts, params) -> dict:
    from nanovllm import LLM

    llm = LLM(
        model,
        load_format="dummy" if not any(f.endswith(".safetensors") for f in os.listdir(model)) else "auto",
    )
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"offline_output_tokens_per_s": tokens / wall, "offline_wall_s": wall}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="the served model name (default: the server's first model)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--offline", metavar="MODEL", help="also time LLM.generate on the same prompts")
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args()
    prompts, params = workload(args.num_requests, args.max_input_len, args.max_output_len, args.temperature)
    figures = {}
    if args.offline:
        figures.update(offline(args.offline, prompts, params))
        print(f"offline: {figures['offline_output_tokens_per_s']:,.0f} output tok/s", flush=True)
    model = args.model or openai.OpenAI(base_url=args.url + "/v1", api_key="none").models.list().data[0].id
    asyncio.run(run_load(args.url, model, prompts[:8], params[:8], 8))  # warm-up
    runs = []
    for c in args.concurrency:
        r = asyncio.run(run_load(args.url, model, prompts, params, c))
        runs.append(r)
        print(
            f"concurrency {c}: {r['requests_per_s']:.2f} req/s, "
            f"{r['output_tokens_per_s']:,.0f} output tok/s, "
            f"TTFT p50/p99 {r['ttft_p50_s']:.2f}/{r['ttft_p99_s']:.2f} s, "
            f"ITL p50/p99 {r['itl_p50_ms']:.1f}/{r['itl_p99_ms']:.1f} ms",
            flush=True,
        )
    figures["runs"] = runs
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
