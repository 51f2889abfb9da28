"""vLLM's beam search, on nanovllm: the best `--beam-width` continuations of each prompt."""
import argparse

from nanovllm import LLM, EngineArgs
from nanovllm.sampling_params import BeamSearchParams
from nanovllm.utils.default_model import default_model_path


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model=None)   # None: the built-in SmolLM2-135M-Instruct
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = vars(parser.parse_args())
    params = BeamSearchParams(beam_width=args.pop("beam_width"), max_tokens=args.pop("max_tokens"))
    args["model"] = args["model"] or default_model_path()

    llm = LLM(**args)
    prompts = [{"prompt": "The capital of France is"}, {"prompt": "Hello, my name is"}]
    outputs = llm.beam_search(prompts, params)
    for output in outputs:
        for i, beam in enumerate(output.sequences):
            print(f"beam {i}: score {beam.cum_logprob:.3f}  {beam.text!r}")
        print("-" * 60)


if __name__ == "__main__":
    main()
