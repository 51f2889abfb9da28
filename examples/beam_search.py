"""vLLM's beam search, on nanovllm: the best `--beam-width` continuations of each prompt, best first,
each with the score that ranked it (its cumulative logprob over its length, prompt included)."""
import argparse

from nanovllm import LLM, EngineArgs
from nanovllm.beam_search import get_beam_search_score
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
    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt": "The capital of France is"}, {"prompt": "Hello, my name is"}]
    outputs = llm.beam_search(prompts, params)
    for prompt, output in zip(prompts, outputs):
        print(f"Prompt: {prompt['prompt']!r}")
        for i, beam in enumerate(output.sequences):   # sorted by score, best first
            score = get_beam_search_score(beam.tokens, beam.cum_logprob, tokenizer.eos_token_id,
                                          params.length_penalty)
            # beam.text is the whole sequence, as in vLLM: the prompt, and an EOS token's text.
            # beam.logprobs has one entry per generated token: these are the beam's own tokens.
            generated = beam.tokens[len(beam.tokens) - len(beam.logprobs):]
            text = tokenizer.decode(generated, skip_special_tokens=True)
            print(f"  beam {i}: score {score:.3f} (cum_logprob {beam.cum_logprob:.2f}, "
                  f"finish_reason {beam.finish_reason!r})  {text!r}")
        print("-" * 60)


if __name__ == "__main__":
    main()
