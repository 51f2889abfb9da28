"""One engine, in this process, running each share of bench.py's workload that a replica of
`bench.py --data-parallel-size N` gets (the same split). Set beside the replicas' engine seconds in
that run's record, it tells what Ray costs inside a replica apart from what one engine costs on its
share (half the batch for the same number of decode steps).

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=. python benchmarks/dp_share.py [--replicas 2]
"""
import argparse
import glob
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.distributed.data_parallel import assign_by_cost, request_cost  # noqa: E402
from nanovllm.utils import roofline  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=bench.DEFAULT_MODEL)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    args = p.parse_args()
    prompts, params = bench.workload(args.num_seqs, args.max_input_len, args.max_output_len, 0.6)
    shares = assign_by_cost([request_cost(len(q), sp.max_tokens) for q, sp in zip(prompts, params)],
                            args.replicas)
    dummy = not glob.glob(os.path.join(args.model, "*.safetensors"))
    llm = LLM(args.model, max_model_len=4096, load_format="dummy" if dummy else "auto")   # as bench.py
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)
    config = bench.model_config(args)
    for r, share in enumerate(shares):
        prompt_lens, output_lens = [len(prompts[i]) for i in share], [params[i].max_tokens for i in share]
        seconds = bench.timed_generate(llm, [prompts[i] for i in share], [params[i] for i in share])
        limit_s = sum(output_lens) / roofline.workload_limit(config, prompt_lens, output_lens)   # H200
        print(f"replica {r}'s share on one engine: {len(share)} prompts, {sum(prompt_lens)} prompt + "
              f"{sum(output_lens)} output tok, {max(output_lens)} decode steps, {seconds:.2f}s "
              f"({sum(output_lens) / seconds:,.0f} tok/s, limit {limit_s:.2f}s: {limit_s / seconds:.1%})")
    llm.shutdown()


if __name__ == "__main__":
    t = time.perf_counter()
    main()
    print(f"dp_share.py: {time.perf_counter() - t:.1f}s in all")
