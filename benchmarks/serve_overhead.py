"""The server's own cost, on CPU, without a model: a fake engine whose step holds the GIL for
--host-ms (Python work, as the real engine's scheduling) and then sleeps --device-ms without it (as
the real engine waits for the GPU), giving every running sequence one token per step. The same
requests run through the fake engine alone (the "offline" figure) and through the server under
benchmarks/serve_load.py's clients; it prints both, their ratio and the server process's CPU time
per output token.

    python benchmarks/serve_overhead.py --concurrency 64 --num-requests 64 --max-output-len 256
"""

import argparse
import os
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import workload  # noqa: E402
from serve_load import describe, run_load  # noqa: E402

from nanovllm.engine.sequence import Sequence, SequenceStatus  # noqa: E402
from nanovllm.outputs import CompletionOutput  # noqa: E402


class FakeEngine:
    """What the server needs of an LLM, with a step that costs host_ms of GIL and device_ms of
    waiting. No tokenizer (as a dummy-weight model folder): streams carry token counts, no text."""

    tokenizer = None
    default_sampling_overrides = {}

    class config:
        model, max_model_len = "fake", 1 << 20

    def __init__(self, host_ms: float, device_ms: float, max_num_seqs: int = 256):
        self.host_s, self.device_s, self.max_num_seqs = host_ms / 1e3, device_ms / 1e3, max_num_seqs
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_steps = 0

    @property
    def scheduler(self):  # /metrics reads these
        class Blocks:
            num_free_blocks, num_blocks = 1, 1

        class Scheduler:
            running, waiting, block_manager = self.running, self.waiting, Blocks

        return Scheduler

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add_request(self, prompt, params) -> list[Sequence]:
        if not prompt or isinstance(prompt, str):
            raise ValueError("the fake engine takes token-id prompts")
        seqs = [Sequence(prompt, params, index=i) for i in range(params.n)]
        self.waiting += seqs
        return seqs

    def abort(self, seqs):
        for seq in seqs:
            seq.abort()
        self.running = [s for s in self.running if not s.is_finished]
        self.waiting = [s for s in self.waiting if not s.is_finished]

    def step(self):
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        end = time.perf_counter() + self.host_s
        while time.perf_counter() < end:  # Python work: the GIL is held
            pass
        time.sleep(self.device_s)  # the device works; the GIL is free
        for seq in self.running:
            seq.append_token(seq.num_tokens % 1000)
            if seq.num_completion_tokens >= seq.sampling_params.max_tokens:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
        self.running = [s for s in self.running if not s.is_finished]
        self.num_steps += 1

    def completion_output(self, seq: Sequence) -> CompletionOutput:
        return CompletionOutput(seq.index, "", seq.completion_token_ids, finish_reason=seq.finish_reason)

    def generate(self, prompts, params) -> int:
        """Offline: every request at once, stepped to the end; returns the output tokens."""
        seqs = [s for prompt, p in zip(prompts, params) for s in self.add_request(prompt, p)]
        while not self.is_finished():
            self.step()
        return sum(s.num_completion_tokens for s in seqs)


def serve(port: int, host_ms: float, device_ms: float, stream_interval: int):
    import uvicorn

    from nanovllm.serve.app import create_app

    options = {"stream_interval": stream_interval} if stream_interval > 1 else {}
    app = create_app(FakeEngine(host_ms, device_ms), "fake", **options)
    run = lambda: uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")  # noqa: E731
    if os.environ.get("SERVE_PROFILE"):  # cProfile of the event loop's thread, to this file
        import cProfile
        import signal

        # uvicorn re-raises the SIGTERM it handled once it has shut down: end with SystemExit then
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        cProfile.runctx("run()", globals(), {"run": run}, os.environ["SERVE_PROFILE"])
    else:
        run()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host-ms", type=float, default=2.0)
    p.add_argument("--device-ms", type=float, default=8.0)
    p.add_argument("--concurrency", type=int, nargs="+", default=[64])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-input-len", type=int, default=128)
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--client-processes", type=int, default=0)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server process
    args = p.parse_args()
    if args.serve:
        return serve(args.port, args.host_ms, args.device_ms, args.stream_interval)
    prompts, params = workload(args.num_requests, args.max_input_len, args.max_output_len, 1.0)
    offline = {}
    for c in args.concurrency:
        engine = FakeEngine(args.host_ms, args.device_ms, max_num_seqs=c)
        t = time.perf_counter()
        tokens = engine.generate(prompts, params)
        offline[c] = tokens / (time.perf_counter() - t)
        print(f"offline (fake engine, {c} at a time): {offline[c]:,.0f} output tok/s", flush=True)
    flags = [
        f"--{k}={getattr(args, k.replace('-', '_'))}"
        for k in ("host-ms", "device-ms", "port", "stream-interval")
    ]
    server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", *flags])
    url = f"http://127.0.0.1:{args.port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "the server did not start"
                time.sleep(0.2)
        for c in args.concurrency:
            before = cpu_seconds(server.pid)
            r = run_load(url, "fake", prompts, params, c, args.client_processes)
            cpu = cpu_seconds(server.pid) - before
            print(describe(r), flush=True)
            print(
                f"  server: {r['output_tokens_per_s'] / offline[c]:.0%} of offline; its process used "
                f"{cpu:.2f} CPU s = {1e6 * cpu / r['output_tokens']:.0f} us per output token "
                f"(the fake engine's own share: {1e6 * args.host_ms / 1e3 / c:.0f} us)",
                flush=True,
            )
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
