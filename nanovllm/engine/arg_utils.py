"""EngineArgs: the engine's options (Config's fields) as a plain dataclass with vLLM's argparse
helpers, so scripts written for vllm.EngineArgs run unchanged:

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    llm = LLM(**vars(parser.parse_args()))        # or LLM(**dataclasses.asdict(EngineArgs(...)))
"""
import argparse
import dataclasses
import json
import typing

from nanovllm.config import Config

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"   # vLLM's default; a script usually sets its own


class _CliArgs:
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One --kebab-case flag per option, with the engine's defaults (booleans: --x / --no-x)."""
        group = parser.add_argument_group("Engine options (nanovllm.LLM)")
        for f in dataclasses.fields(EngineArgs):
            flag = "--" + f.name.replace("_", "-")
            help_text = f"default: {f.default!r}"
            if _base_type(f.type) is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                   help=help_text)
            else:
                group.add_argument(flag, type=_parser_of(f), default=f.default, help=help_text)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _base_type(annotation):
    """int for `int | None`, str for `str | torch.dtype`: the first member that is not None."""
    members = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = members[0] if members else annotation
    return typing.get_origin(base) or base


def _parser_of(f: dataclasses.Field):
    base = _base_type(f.type)
    if base is dict:
        return json.loads   # --hf-overrides '{"max_position_embeddings": 2048}'
    return base if base in (int, float, str) else str


def _engine_args_fields():
    fields = [("model", str, dataclasses.field(default=DEFAULT_MODEL))]
    for f in dataclasses.fields(Config):
        if f.init and f.name != "model":
            fields.append((f.name, f.type, dataclasses.field(default=f.default)))
    return fields


EngineArgs = dataclasses.make_dataclass("EngineArgs", _engine_args_fields(), bases=(_CliArgs,))
EngineArgs.__module__ = __name__
EngineArgs.__doc__ = "The options of LLM(...) / Config.create, with vLLM's add_cli_args and from_cli_args."
