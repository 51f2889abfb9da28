"""`nanovllm serve MODEL [--host H] [--port P] [LLM options as flags]`, e.g.
`nanovllm serve ./Qwen3-0.6B --port 8000 --max-model-len 8192 --no-enable-prefix-caching`."""

import argparse
import dataclasses
import logging
import types
import typing

from nanovllm.config import Config


def _flag_type(f: dataclasses.Field):
    """The argparse type of a Config field: from its annotation (int | None -> int)."""
    kind = f.type
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    return kind if kind in (int, float, str) else str


def engine_flags(parser: argparse.ArgumentParser):
    """One flag per LLM option (Config field), named as vLLM names them (--max-model-len)."""
    group = parser.add_argument_group("engine options (as LLM(...) takes them)")
    for f in dataclasses.fields(Config):
        if not f.init or f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            group.add_argument(flag, type=_flag_type(f), default=f.default)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nanovllm serve", description="An OpenAI-compatible server over one engine."
    )
    p.add_argument("model", help="a local model folder or a hub id")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: MODEL)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    engine_flags(p)
    return p


def serve(argv: list[str] | None = None):
    try:
        import uvicorn

        from nanovllm.serve.app import create_app
    except ImportError as e:
        raise SystemExit(
            f"nanovllm serve needs FastAPI and uvicorn: pip install 'nanovllm[serve]' ({e})"
        ) from None
    from nanovllm.llm import LLM

    args = vars(parser().parse_args(argv))
    host, port, name, level = (args.pop(k) for k in ("host", "port", "served_model_name", "log_level"))
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = args.pop("model")
    llm = LLM(model, **args)
    try:
        uvicorn.run(create_app(llm, name or model), host=host, port=port, log_level=level)
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None):
    """The `nanovllm` console script: `nanovllm serve ...`."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        raise SystemExit("usage: nanovllm serve MODEL [options]   (nanovllm serve --help for the options)")
    serve(argv[1:])
