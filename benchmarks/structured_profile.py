"""Where a decode step's time goes with structured outputs: the same batch generated free and with
every request constrained by one JSON schema, each step split into the host's grammar work
(GrammarState.accept of the sampled tokens, the bitmask fill in SamplingPrep.prepare), the wait for the
device's tokens, and the rest (scheduling, inputs, launch). Short: about a minute on an H200.

  GPU:  PYTHONPATH=.:/tmp/site python benchmarks/structured_profile.py --tokenizer .whl-xgr/smollm2-tokenizer
  CPU:  python benchmarks/structured_profile.py --tiny --num-seqs 64 --output-len 64

--tiny: a tiny random Qwen3 with Qwen3-0.6B's 151,936-wide logits (a CPU repro); --schema picks
bench.py's schema or `minlength` (a string of minLength 8192: xgrammar's matcher then costs time in
proportion to the string so far, so the steps slow down as the outputs grow)."""
import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from random import randint, seed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench import STRUCTURED_SCHEMA  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine.executor import Executor  # noqa: E402
from nanovllm.engine.sampling_prep import SamplingPrep  # noqa: E402
from nanovllm.sampling_params import StructuredOutputsParams  # noqa: E402
from nanovllm.structured import grammars  # noqa: E402

MINLENGTH = {"type": "object", "required": ["id", "text"],
             "properties": {"id": {"type": "integer"}, "text": {"type": "string", "minLength": 8192}}}
SCHEMAS = {"bench": STRUCTURED_SCHEMA, "minlength": MINLENGTH}
PHASES = {"accept": (grammars.GrammarState, "accept"), "fill": (grammars, "fill_bitmask"),
          "prepare": (SamplingPrep, "prepare"), "wait": (Executor, "result")}


class PhaseTimer:
    """Adds up the wall time spent in each of PHASES (wrapped in place while active)."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self._saved = []

    def __enter__(self):
        for name, (owner, attr) in PHASES.items():
            fn = getattr(owner, attr)
            self._saved.append((owner, attr, fn))
            setattr(owner, attr, self._timed(name, fn))
        return self

    def __exit__(self, *exc):
        for owner, attr, fn in self._saved:
            setattr(owner, attr, fn)

    def _timed(self, name, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t
        return timed


def tiny_model(vocab_size: int) -> str:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import make_model
    return make_model(tempfile.mkdtemp(), "qwen3", tokenizer=False, vocab_size=vocab_size)


def run(llm, prompts, params) -> dict:
    """Generate step by step (so steps can be counted and timed) and split the time."""
    for p, sp in zip(prompts, params):
        llm.add_request(p, sp)
    engine = getattr(llm, "llm_engine", llm)
    with PhaseTimer() as timer:
        steps, decode_steps, tokens, t0 = 0, 0, 0, time.perf_counter()
        step_times = []
        while not engine.is_finished():
            t = time.perf_counter()
            _, batch = engine.step()
            step_times.append(time.perf_counter() - t)
            steps += 1
            if not batch.is_prefill:
                decode_steps += 1
                tokens += len(batch.seqs)
        total = time.perf_counter() - t0
    split = {k: round(v, 3) for k, v in timer.seconds.items()}
    first, last = step_times[len(step_times) // 10:][:50], step_times[-60:-10]
    return dict(seconds=round(total, 2), steps=steps, decode_tokens=tokens, **split,
                early_step_ms=round(1e3 * statistics.median(first), 2) if first else None,
                late_step_ms=round(1e3 * statistics.median(last), 2) if last else None)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(ROOT, "configs", "qwen3-0.6b"))
    p.add_argument("--tiny", action="store_true", help="a tiny random model with 151,936 logits (CPU)")
    p.add_argument("--tokenizer", help="default: the demo model's (SmolLM2's 49,152 tokens)")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--schema", default="bench", choices=sorted(SCHEMAS))
    p.add_argument("--device", default=None)
    args = p.parse_args()
    tokenizer = args.tokenizer
    if tokenizer is None:
        from nanovllm.utils.default_model import default_model_path
        tokenizer = default_model_path()
    model = tiny_model(151936) if args.tiny else args.model
    llm = LLM(model, load_format="dummy" if not args.tiny else "auto", tokenizer=tokenizer,
              max_model_len=args.prompt_len + args.output_len + 16, enable_prefix_caching=False,
              **({"device": args.device} if args.device else {}))
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(args.prompt_len)] for _ in range(args.num_seqs)]
    free = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.output_len)
    constrained = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.output_len,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMAS[args.schema]))
    for sp in (free, constrained):   # warm-up: the sampling kernels (with and without a bitmask), the grammar
        llm.generate([[1, 2, 3]], [dataclasses.replace(sp, max_tokens=4)], use_tqdm=False)
    print(f"{args.num_seqs} sequences, {args.prompt_len} prompt + {args.output_len} output tokens, "
          f"schema {args.schema}; seconds summed over the run (host work in each phase)")
    results = {}
    for name, sp in (("free", free), ("constrained", constrained)):
        results[name] = r = run(llm, prompts, [sp] * args.num_seqs)
        print(f"{name:>12}: {r}")
    f, c = results["free"], results["constrained"]
    per_step = lambda r, k: 1e3 * r.get(k, 0) / max(1, r["steps"])   # noqa: E731
    print(f"per step (ms): free {per_step(f, 'seconds'):.2f}, constrained {per_step(c, 'seconds'):.2f} = "
          f"accept {per_step(c, 'accept'):.2f} + bitmask fill {per_step(c, 'fill'):.2f} "
          f"(in prepare {per_step(c, 'prepare'):.2f}) + waiting for tokens {per_step(c, 'wait'):.2f} "
          f"(free: {per_step(f, 'wait'):.2f}) + the rest; constrained/free time "
          f"{c['seconds'] / f['seconds']:.3f}")


if __name__ == "__main__":
    main()
