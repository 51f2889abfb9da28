"""vLLM's generate example, on nanovllm: engine options from the command line (EngineArgs), the
model's default sampling parameters (from its generation_config.json), overridable by flags.

    python examples/generate.py --max-tokens 32 --temperature 0 --enforce-eager
"""
import argparse

from nanovllm import LLM, EngineArgs
from nanovllm.utils.default_model import default_model_path


def create_parser():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model=None)   # None: the built-in SmolLM2-135M-Instruct
    sampling_group = parser.add_argument_group("Sampling parameters")
    sampling_group.add_argument("--max-tokens", type=int)
    sampling_group.add_argument("--temperature", type=float)
    sampling_group.add_argument("--top-p", type=float)
    sampling_group.add_argument("--top-k", type=int)
    return parser


def main(args: dict):
    # The sampling flags are not engine options: take them out before LLM(**args).
    max_tokens, temperature = args.pop("max_tokens"), args.pop("temperature")
    top_p, top_k = args.pop("top_p"), args.pop("top_k")
    args["model"] = args["model"] or default_model_path()

    llm = LLM(**args)
    sampling_params = llm.get_default_sampling_params()
    if max_tokens is not None:
        sampling_params.max_tokens = max_tokens
    if temperature is not None:
        sampling_params.temperature = temperature
    if top_p is not None:
        sampling_params.top_p = top_p
    if top_k is not None:
        sampling_params.top_k = top_k

    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    outputs = llm.generate(prompts, sampling_params)
    print("-" * 50)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}\nGenerated text: {output.outputs[0].text!r}")
        print("-" * 50)


if __name__ == "__main__":
    main(vars(create_parser().parse_args()))
