"""What FP8 weights cost in accuracy on a real model (on a GPU): the model quantized at load
(quantization='fp8': per-channel weight scales, activations quantized per token at run time) against
the same model in bf16. Both generate greedily from the same chat prompts; each FP8 token is then
scored under transformers' bf16 model on the FP8 run's own sequence (teacher-forced): it "differs"
when it is not bf16's argmax there, and then its gap (bf16 max logit minus its logit) says whether
the two were near ties. The bar: at most 2% of tokens differ, or every differing token's gap is
under 0.5. "same as bf16 run" compares the two free runs position by position (one early flip makes
the rest of a sequence differ, so it says little alone).

    PYTHONPATH=. python benchmarks/fp8_weights_accuracy.py [--model FOLDER | --gguf FILE] [--json PATH]

The default model is the demo's SmolLM2-135M-Instruct (see benchmarks/fp8_accuracy.py for how it is
made); --num-prompts 64 --max-tokens 128 are the defaults. Without a GPU it runs on the CPU (SmolLM2:
about 2 minutes for 16 prompts x 64 tokens on 2 cores), the FP8 layers rounding their activations per
token as the GPU kernels do; --unit-scales (CPU) also rounds each per-channel GEMM's unscaled product
to bf16 before the scales, as fp8_gemm's unit-scale path does (up to UNIT_SCALE_MAX_M rows on the GPU;
here at every size).
"""
import argparse
import json

import torch
from fp8_accuracy import DEVICE, chat_prompts, greedy_outputs, model_folder
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanovllm import SamplingParams
from nanovllm.quantization import fp8_methods

CONFIGS = {"bf16": dict(dtype="bfloat16"), "fp8 weights": dict(dtype="bfloat16", quantization="fp8")}


def emulate_activation_rounding(unit_scales: bool = False):
    """On the CPU, FP8 layers dequantize the weights and leave activations unrounded (the tests' oracle).
    Here they also round the activations through e4m3 per token (per group with a block format) as the
    GPU kernels do, so a CPU run measures what the GPU path computes, up to the GEMM's sum order.
    unit_scales: per channel, the FP8 product unscaled rounded to the dtype, then scaled and rounded
    again (fp8_gemm's unit-scale GEMM and scale_out)."""
    from nanovllm.kernels.fp8_reference import dequantize_weight, quantize_activations, round_trip_activations

    def apply(self, layer, x, bias, into=None):
        x2 = x.reshape(-1, x.shape[-1]).float()
        if unit_scales and self.block is None:
            q, xs = quantize_activations(x2, x2.shape[-1])
            y = (q.float() @ layer.weight.float().t()).to(x.dtype).float()
            y = (y * xs * layer.weight_scale.view(1, -1)).to(x.dtype)
        else:
            xr = round_trip_activations(x2, x2.shape[-1] if self.block is None else self.block[1])
            w = dequantize_weight(layer.weight, layer.weight_scale, self.block, torch.float32)
            y = torch.nn.functional.linear(xr, w).to(x.dtype)
        y = (y if bias is None else y + bias).view(*x.shape[:-1], -1)
        return y if into is None else into.add_(y)
    fp8_methods.Fp8LinearMethod.apply = apply


@torch.no_grad()
def gaps_and_flips(hf, prompt: list[int], output: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 max logit - logit of each output token, whether the token is not the bf16 argmax)."""
    ids = torch.tensor([prompt + output], device=DEVICE)
    logits = hf(ids).logits[0, len(prompt) - 1:-1].float()
    out = torch.tensor(output, device=DEVICE)
    gap = logits.max(-1).values - logits.gather(1, out[:, None])[:, 0]
    return gap, logits.argmax(-1) != out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face model folder in bf16/fp32 (default: the demo's SmolLM2)")
    p.add_argument("--gguf", help="a GGUF file to convert and use instead of --model")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--unit-scales", action="store_true",
                   help="CPU: emulate the unit-scale GEMM's rounding of the unscaled product too")
    args = p.parse_args()
    if DEVICE == "cpu":
        emulate_activation_rounding(args.unit_scales)
    args.model = model_folder(args)
    prompts = chat_prompts(AutoTokenizer.from_pretrained(args.model))[:args.num_prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    outputs = greedy_outputs(args.model, prompts, params, CONFIGS)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(DEVICE).eval()
    print(f"{args.model}: {len(prompts)} chat prompts, greedy, {args.max_tokens} tokens each")
    print(f"{'weights':12s} {'tokens':>7s} {'differ':>7s} {'differ, gap >= 0.5':>19s} {'max gap':>8s} "
          f"{'same as bf16 run':>17s}")
    rows = []
    for name, outs in outputs.items():
        scored = [gaps_and_flips(hf, prompt, out) for prompt, out in zip(prompts, outs) if out]
        gaps = torch.cat([g for g, _ in scored])
        flips = torch.cat([f for _, f in scored])
        same = sum(a == b for x, y in zip(outs, outputs["bf16"]) for a, b in zip(x, y))
        row = dict(weights=name, tokens=gaps.numel(), differ=float(flips.float().mean()),
                   differ_far=float((flips & (gaps >= 0.5)).float().mean()),
                   max_gap=float(gaps.max()), same_as_bf16_run=same / sum(map(len, outs)))
        row["passes"] = row["differ"] <= 0.02 or row["differ_far"] == 0.0
        rows.append(row)
        print(f"{name:12s} {row['tokens']:7d} {row['differ']:7.2%} {row['differ_far']:19.2%} "
              f"{row['max_gap']:8.2f} {row['same_as_bf16_run']:17.1%}" + ("" if row["passes"] else "  FAILS"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
