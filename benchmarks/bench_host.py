"""Host (CPU) cost of one decode step's bookkeeping at batch 256, without a GPU: Scheduler.schedule,
StepInput.of, DecodeInputs.pack (CUDA-graph layout), SamplingPrep.prepare (temperature 0.6) and
Scheduler.postprocess, on a tiny model. These run on the host between two GPU steps, so they bound
how much of each decode step the GPU sits idle. Usage: PYTHONPATH=. python benchmarks/bench_host.py"""
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from conftest import make_model  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine.decode_graphs import DecodeInputs  # noqa: E402
from nanovllm.engine.step_input import StepInput  # noqa: E402


def main(batch=256, prompt_len=600, steps=200):
    path = make_model(tempfile.mkdtemp(), "qwen3", tokenizer=False)
    llm = LLM(path, device="cpu", kvcache_block_size=256, num_kvcache_blocks=batch * 8, max_model_len=1024)
    params = SamplingParams(temperature=0.6, max_tokens=steps + 10, ignore_eos=True)
    for i in range(batch):
        llm.add_request([3 + (i + j) % 500 for j in range(prompt_len)], params)
    sched, runner = llm.scheduler, llm.model_runner
    while sched.waiting:                                  # prefill everything (host bookkeeping only)
        b = sched.schedule()
        sched.postprocess(b, [7] * len(b.sampling_seqs))
    phases = ("schedule", "StepInput.of", "DecodeInputs.pack", "SamplingPrep.prepare", "postprocess")
    times = {k: [] for k in phases}

    def timed(name, fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        times[name].append(time.perf_counter() - t)
        return out

    for i in range(steps):
        batch_ = timed("schedule", sched.schedule)
        step = timed("StepInput.of", StepInput.of, batch_)
        timed("DecodeInputs.pack", DecodeInputs.pack, step, 256, 4, runner.block_size)
        timed("SamplingPrep.prepare", runner.sampling_prep.prepare, batch_.sampling_seqs)
        timed("postprocess", sched.postprocess, batch_, [11 + i % 300] * len(batch_.seqs))
    total = 0.0
    for name, ts in times.items():
        med = statistics.median(ts) * 1e3
        total += med
        print(f"{name:16s} {med:7.3f} ms (median of {steps})")
    print(f"{'total':16s} {total:7.3f} ms per decode step at batch {batch}")


if __name__ == "__main__":
    main()
