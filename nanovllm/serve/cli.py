"""`nanovllm serve MODEL [--host H] [--port P] [LLM options as flags]`, e.g.
`nanovllm serve ./Qwen3-0.6B --port 8000 --max-model-len 8192 --no-enable-prefix-caching`."""

import argparse
import dataclasses
import logging
import sys

from nanovllm.engine.arg_utils import EngineArgs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nanovllm serve", description="An OpenAI-compatible server over one engine."
    )
    p.add_argument(
        "model_tag", metavar="MODEL", nargs="?", help="a local model folder or a hub id (or --model)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: MODEL)")
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="stream a completion's tokens once this many have gathered (1: each at once; more: "
        "fewer, larger events, less host work per token under many streams)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    EngineArgs.add_cli_args(p)  # every LLM option, as vLLM spells its flags (--max-model-len ...)
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

    args = parser().parse_args(argv)
    if args.model_tag:
        args.model = args.model_tag
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    try:
        uvicorn.run(
            create_app(llm, args.served_model_name or args.model, args.stream_interval),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
        )
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None):
    """The `nanovllm` console script: `nanovllm serve ...`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        raise SystemExit("usage: nanovllm serve MODEL [options]   (nanovllm serve --help for the options)")
    serve(argv[1:])
