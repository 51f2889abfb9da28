"""A batch of texts to JSON records: `python examples/structured_json.py` extracts one record per text
with the built-in SmolLM2-135M-Instruct, every output constrained to a JSON schema (needs
`pip install 'nanovllm[structured]'`); `--model` takes a local folder or a hub id."""
import argparse
import json

from nanovllm import LLM, SamplingParams
from nanovllm.sampling_params import StructuredOutputsParams

TEXTS = [
    "Maria Lopez is a 34-year-old teacher from Madrid, Spain.",
    "Kenji Sato, 51, works as an engineer in Osaka, Japan.",
    "Amara Okafor is a doctor in Lagos, Nigeria; she is 42.",
    "Lukas Weber, a 28-year-old artist, lives in Berlin, Germany.",
]
SCHEMA = {   # a pydantic model's .model_json_schema(), or the class itself, works as well
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "address": {"type": "object", "required": ["city", "country"],
                    "properties": {"city": {"type": "string", "maxLength": 40},
                                   "country": {"type": "string", "maxLength": 40}}},
        "job": {"enum": ["teacher", "engineer", "doctor", "artist", "other"]},
    },
    "required": ["name", "age", "address", "job"],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="local model folder or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    args = parser.parse_args()
    if args.model is None:
        from nanovllm.utils.default_model import default_model_path
        args.model = default_model_path()

    llm = LLM(args.model)
    conversations = [[{"role": "user", "content": "Extract the person as JSON with name, age, address "
                                                  f"(city, country) and job: {text}"}] for text in TEXTS]
    params = SamplingParams(temperature=args.temperature, max_tokens=256,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    for text, output in zip(TEXTS, llm.chat(conversations, params, use_tqdm=False)):
        completion = output.outputs[0]
        # finish_reason "length" would mean max_tokens cut the record short (then it may not parse).
        record = json.loads(completion.text) if completion.finish_reason == "stop" else completion.text
        print(f"{text}\n  -> {record}")


if __name__ == "__main__":
    main()
