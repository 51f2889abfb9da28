"""TP=2 against TP=1 on two GPUs: the greedy tokens of a tiny fp32 Qwen3 (8 heads, head_dim 8), and
how far each TP=2 token is from transformers' argmax, with each engine's start-up phases.

    PYTHONPATH=. python benchmarks/tp_equality.py            # eager
    PYTHONPATH=. python benchmarks/tp_equality.py --graphs   # with CUDA graphs

To see where a hang sits, add benchmarks/hang_dump to PYTHONPATH and set HANG_DUMP_AFTER=<seconds>:
every Python process, the spawned workers too, then prints its threads' tracebacks after that long."""
import argparse
import sys
import time

sys.path.insert(0, "tests")

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs (default: eager)")
    args = parser.parse_args()
    from conftest import HFOracle, make_model, random_prompts
    from nanovllm import LLM, SamplingParams
    t = time.time()
    path = make_model("/tmp/tp8h", "qwen3", num_attention_heads=8, num_key_value_heads=8, head_dim=8)
    prompts = random_prompts(8, [1, 5, 17, 33, 64, 150, 300, 40], seed=11)
    g = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    opts = dict(device="cuda", kvcache_block_size=16, num_kvcache_blocks=96, max_num_batched_tokens=256,
                dtype="float32", enforce_eager=not args.graphs)
    res = {}
    for tp in (1, 2):
        llm = LLM(path, tensor_parallel_size=tp, **opts)
        print(f"tp {tp} started at {time.time() - t:.1f}s: " + ", ".join(
            f"{k} {v:.1f}s" for k, v in llm.model_runner.startup_seconds.items()), flush=True)
        res[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, g, use_tqdm=False)]
        llm.shutdown()
        del llm
        print(f"tp {tp} done at {time.time() - t:.1f}s", flush=True)
    oracle = HFOracle(path)
    for i, (p, a, b) in enumerate(zip(prompts, res[1], res[2])):
        lg = oracle.logits(p + b)[len(p) - 1:-1]
        gap = [round(float(lg[j].max() - lg[j][b[j]]), 5) for j in range(len(b))]
        print(i, "same" if a == b else "DIFF", a[:8], b[:8], "tp2 gap to max:", max(gap), flush=True)
