"""How much FP8 e4m3 weights alone cost a model's greedy tokens, by weight-scale granularity (CPU, no
engine): each linear layer's weights but the LM head are rounded through e4m3 (per tensor, per output
channel, per 1 x G group along the input, or per 128 x 128 block) and the model, in fp32 with unrounded
activations, generates greedily from fp8_accuracy.py's chat prompts; each token is then scored under the
unquantized fp32 model on its own sequence (as fp8_weights_accuracy.py scores): the share that is not
the argmax there, and of those the share 0.5 or more logits below it.

    PYTHONPATH=. python benchmarks/fp8_scheme_accuracy.py --prompts 32 --tokens 64 channel group64 group32
"""
import argparse
import time

import torch
from fp8_accuracy import chat_prompts
from transformers import AutoModelForCausalLM, AutoTokenizer

E4M3_MAX = 448.0


def fp8_rounded(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """w rounded through e4m3 with one scale per tensor, output channel, 1 x G group or 128 x 128 block."""
    w = w.float()
    rows, cols = w.shape
    if scheme == "tensor":
        groups = w.view(1, 1, -1)
    elif scheme == "channel":
        groups = w.view(rows, 1, cols)
    elif scheme.startswith("group"):
        g = int(scheme[len("group"):])
        groups = w.view(rows, cols // g, g)
    elif scheme == "block128":
        blocks = w.view(rows // 128, 128, cols // 128, 128).transpose(1, 2)
        groups = blocks.reshape(rows // 128, cols // 128, -1)
    else:
        raise ValueError(f"unknown scheme {scheme!r}")
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    out = (groups / scale).to(torch.float8_e4m3fn).float() * scale
    if scheme == "block128":
        return out.view(rows // 128, cols // 128, 128, 128).transpose(1, 2).reshape(rows, cols)
    return out.view(rows, cols)


@torch.no_grad()
def measure(path: str, scheme: str, prompts: list[list[int]], tokens: int, ref, eos: int) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
            module.weight.copy_(fp8_rounded(module.weight, scheme))
    differ = far = total = 0
    worst = 0.0
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                             pad_token_id=eos)[0, len(prompt):]
        if not len(out):
            continue
        logits = ref(torch.cat([ids[0], out])[None]).logits[0, len(prompt) - 1:-1]
        gap = logits.max(-1).values - logits.gather(1, out[:, None])[:, 0]
        differ += int((logits.argmax(-1) != out).sum())
        far += int((gap >= 0.5).sum())
        total += len(out)
        worst = max(worst, float(gap.max()))
    return {"differ": differ / total, "far": far / total, "max_gap": worst, "tokens": total}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("schemes", nargs="+",
                   help="tensor, channel, groupG (G divides every input width), block128")
    p.add_argument("--model", help="a Hugging Face model folder (default: the demo's SmolLM2)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    from nanovllm.utils.default_model import default_model_path
    path = args.model or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = chat_prompts(tokenizer)[:args.prompts]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for scheme in args.schemes:
        start = time.time()
        r = measure(path, scheme, prompts, args.tokens, ref, tokenizer.eos_token_id)
        print(f"{scheme:>9s}: {r['differ']:.2%} not the fp32 argmax, {r['far']:.2%} 0.5 or more below it "
              f"(max {r['max_gap']:.2f}); {r['tokens']} tokens, {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
