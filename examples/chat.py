"""vLLM's chat example, on nanovllm: one conversation, then a batch of them, rendered by the
model's chat template (or --chat-template-path), with the model's default sampling parameters."""
import argparse

from nanovllm import LLM, EngineArgs
from nanovllm.utils.default_model import default_model_path


def create_parser():
    parser = argparse.ArgumentParser(description=__doc__)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model=None)   # None: the built-in SmolLM2-135M-Instruct
    sampling_group = parser.add_argument_group("Sampling parameters")
    sampling_group.add_argument("--max-tokens", type=int)
    sampling_group.add_argument("--temperature", type=float)
    sampling_group.add_argument("--chat-template-path", type=str)
    return parser


def print_outputs(outputs):
    print("\nGenerated Outputs:\n" + "-" * 80)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}\n")
        print(f"Generated text: {output.outputs[0].text!r}")
        print("-" * 80)


def main(args: dict):
    max_tokens, temperature = args.pop("max_tokens"), args.pop("temperature")
    chat_template_path = args.pop("chat_template_path")
    args["model"] = args["model"] or default_model_path()

    llm = LLM(**args)
    sampling_params = llm.get_default_sampling_params()
    if max_tokens is not None:
        sampling_params.max_tokens = max_tokens
    if temperature is not None:
        sampling_params.temperature = temperature

    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    print_outputs(outputs)

    # A batch of conversations in one call.
    conversations = [conversation for _ in range(4)]
    outputs = llm.chat(conversations, sampling_params, use_tqdm=True)
    print_outputs(outputs)

    # A chat template of your own (a Jinja file).
    if chat_template_path is not None:
        with open(chat_template_path) as f:
            chat_template = f.read()
        outputs = llm.chat(conversations, sampling_params, use_tqdm=False, chat_template=chat_template)
        print_outputs(outputs)


if __name__ == "__main__":
    main(vars(create_parser().parse_args()))
