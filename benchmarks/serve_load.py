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
import multiprocessing
import os
import sys
import time
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench import workload  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def one_stream(host: str, port: int, body: bytes) -> dict:
    """POST one streaming request over a raw HTTP/1.1 connection (the openai client parses every
    chunk into pydantic objects: at 256 streams that, not the server, was the bound) and time its
    server-sent events. Returns its start, one stamp per event and its output tokens (usage)."""
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body)
    )
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"the server answered {status!r}: {await reader.read(2000)!r}")
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        chunked |= line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower()
    stamps, pending, usage = [], b"", None
    while True:
        if chunked:
            size = int((await reader.readline()).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            data = data[:-2]
            if size == 0:
                break
        else:
            data = await reader.read(65536)
            if not data:
                break
        now = time.perf_counter()
        *events, pending = (pending + data).split(b"\n\n")
        for event in events:
            if not event.startswith(b"data: {"):
                continue
            if b'"usage"' in event and (chunk := json.loads(event[6:])).get("usage"):
                usage = chunk["usage"]  # the last chunk: no choices, the request's token counts
            else:
                stamps.append(now)
    writer.close()
    return {"start": start, "stamps": stamps, "tokens": usage["completion_tokens"] if usage else len(stamps)}


def _client_process(url: str, model: str, jobs: list[tuple], concurrency: int) -> list[dict]:
    """One client process: its share of the requests, `concurrency` at a time, on its own loop."""
    parts = urllib.parse.urlsplit(url)

    async def main():
        gate = asyncio.Semaphore(concurrency)

        async def limited(prompt, max_tokens, temperature):
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with gate:
                return await one_stream(parts.hostname, parts.port or 80, json.dumps(body).encode())

        return await asyncio.gather(*(limited(*job) for job in jobs))

    return asyncio.run(main())


def run_load(url: str, model: str, prompts, params, concurrency: int, processes: int = 0) -> dict:
    """The requests, `concurrency` in flight at a time, from several client processes (default: one
    per 32 streams, at most the CPU count) so the client is never the bottleneck."""
    processes = processes or max(1, min(os.cpu_count() or 1, -(-concurrency // 32), concurrency))
    jobs = [(prompt, p.max_tokens, p.temperature) for prompt, p in zip(prompts, params)]
    shares = [jobs[i::processes] for i in range(processes)]
    per_process = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        parts = pool.starmap(
            _client_process, [(url, model, share, c) for share, c in zip(shares, per_process) if share]
        )
    results = [r for part in parts for r in part]
    start = min(r["start"] for r in results)
    wall = max(r["stamps"][-1] for r in results if r["stamps"]) - start  # without the pool's start-up
    ttft = [r["stamps"][0] - r["start"] for r in results if r["stamps"]]
    itl = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])]
    tokens = sum(r["tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "client_processes": processes,
        "requests": len(results),
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "output_tokens_per_s": tokens / wall,
        "output_tokens": tokens,
        "events": sum(len(r["stamps"]) for r in results),
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "itl_p50_ms": 1e3 * percentile(itl, 0.5),
        "itl_p99_ms": 1e3 * percentile(itl, 0.99),
    }


def served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def describe(r: dict) -> str:
    return (
        f"concurrency {r['concurrency']}: {r['requests_per_s']:.2f} req/s, "
        f"{r['output_tokens_per_s']:,.0f} output tok/s, "
        f"{r['output_tokens'] / max(1, r['events']):.2f} tokens/event, "
        f"TTFT p50/p99 {r['ttft_p50_s']:.2f}/{r['ttft_p99_s']:.2f} s, "
        f"ITL (between events) p50/p99 {r['itl_p50_ms']:.1f}/{r['itl_p99_ms']:.1f} ms"
    )


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
    p.add_argument("--client-processes", type=int, default=0, help="default: one per 32 streams")
    p.add_argument("--offline", metavar="MODEL", help="also time LLM.generate on the same prompts")
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args()
    prompts, params = workload(args.num_requests, args.max_input_len, args.max_output_len, args.temperature)
    figures = {}
    if args.offline:
        figures.update(offline(args.offline, prompts, params))
        print(f"offline: {figures['offline_output_tokens_per_s']:,.0f} output tok/s", flush=True)
    model = args.model or served_model(args.url)
    run_load(args.url, model, prompts[:8], params[:8], 8, 1)  # warm-up
    runs = []
    for c in args.concurrency:
        r = run_load(args.url, model, prompts, params, c, args.client_processes)
        runs.append(r)
        print(describe(r), flush=True)
    figures["runs"] = runs
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
