"""Batch inference over a JSONL file of prompts with Ray Data, streaming: rows are read, generated
from by engine replicas (Ray actors, each holding tensor_parallel_size GPUs) and written to Parquet
block by block, so a dataset larger than memory passes through.

    python examples/ray_batch_inference.py prompts.jsonl out_dir --model Qwen/Qwen3-0.6B --concurrency 8

Each line of the input is a JSON object with a "prompt" (text) or "messages" (a chat conversation)
field; other fields are kept. The output adds generated_text, num_input_tokens, num_generated_tokens
and finish_reason. Runs on the Ray cluster at RAY_ADDRESS, else on a local one.
"""
import argparse

from nanovllm.distributed.ray_data import NanoVLLMPredictor
from nanovllm.distributed.ray_utils import import_ray, init_ray


def run(input_path: str, output_dir: str, model: str, max_tokens: int = 256, temperature: float = 0.0,
        concurrency: int = 1, batch_size: int = 256, engine_options: dict | None = None):
    ray = import_ray()
    engine_options = engine_options or {}
    tp = engine_options.get("tensor_parallel_size", 1)
    on_cpu = engine_options.get("device") == "cpu"
    ds = ray.data.read_json(input_path)
    ds = ds.map_batches(
        NanoVLLMPredictor,
        fn_constructor_kwargs=dict(model=model, **engine_options,
                                   sampling_params=dict(max_tokens=max_tokens, temperature=temperature)),
        concurrency=concurrency, batch_size=batch_size,
        num_gpus=0 if on_cpu else tp, num_cpus=tp if on_cpu else 1)
    ds.write_parquet(output_dir)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="JSONL file (or folder of them) with a 'prompt' or 'messages' field")
    p.add_argument("output", help="folder for the Parquet files")
    p.add_argument("--model", required=True, help="model folder (on every node) or hub id")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--concurrency", type=int, default=1, help="engine replicas")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per replica, on one node")
    p.add_argument("--batch-size", type=int, default=256, help="rows per generate call")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    args = p.parse_args()
    init_ray()
    run(args.input, args.output, args.model, args.max_tokens, args.temperature, args.concurrency,
        args.batch_size, dict(tensor_parallel_size=args.tensor_parallel_size, device=args.device))


if __name__ == "__main__":
    main()
