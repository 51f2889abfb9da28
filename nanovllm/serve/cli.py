"""`nanovllm serve MODEL [--host H] [--port P] [LLM options as flags]`, e.g.
`nanovllm serve ./Qwen3-0.6B --port 8000 --max-model-len 8192 --no-enable-prefix-caching`."""

import argparse
import dataclasses
import difflib
import json
import logging
import sys
from contextlib import contextmanager

import nanovllm.envs as envs
from nanovllm.engine.arg_utils import EngineArgs
from nanovllm.logger import DATE_FORMAT, FORMAT
from nanovllm.serve.tools import PARSERS

PROG = "nanovllm serve"
logger = logging.getLogger(__name__)


class OneLineParser(argparse.ArgumentParser):
    """argparse that takes no abbreviations of its flags (--max-num-seq is not --max-num-seqs) and
    says what is wrong in one line, naming the closest flag to an unknown one, not its usage (the
    engine's options make that screens long)."""

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self.unrecognized(extras))
        return parsed

    def unrecognized(self, extras: list[str]) -> str:
        flags = [s for action in self._actions for s in action.option_strings]
        unknown = next((e.partition("=")[0] for e in extras if e.startswith("-")), None)
        if unknown is None:
            return f"unrecognized argument(s) {' '.join(extras)}"
        close = difflib.get_close_matches(unknown, flags, n=1)
        return f"unrecognized option {unknown}" + (f": did you mean {close[0]}?" if close else "")

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="An OpenAI-compatible server over one engine.")
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
    p.add_argument("--log-level", default=None, choices=["critical", "error", "warning", "info", "debug"],
                   help="the server's and nanovllm's log level (default: $NANOVLLM_LOGGING_LEVEL, info)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $VLLM_API_KEY; "
                   "neither: no key)")
    for what in ("origins", "methods", "headers"):
        p.add_argument(f"--allowed-{what}", type=_json_list, default=["*"],
                       help=f"CORS: the allowed {what}, a JSON list (default [\"*\"])")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser')
    p.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                   help="how the model writes tool calls (hermes: <tool_call>{json}</tool_call>, Qwen's)")
    p.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                   help="LoRA adapters served beside the model (with --enable-lora): name=path, or a JSON "
                   '{"name": ..., "path": ...}; a request naming one as its model runs under it')
    EngineArgs.add_cli_args(p)  # every LLM option, as vLLM spells its flags (--max-model-len ...)
    return p


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings such as \'["*"]\', got {text!r}')
    return value


def _lora_module(text: str) -> tuple[str, str]:
    """vLLM's --lora-modules entry: name=path, or {"name": ..., "path": ...} as JSON."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
            return str(value["name"]), str(value["path"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(f'expected {{"name": ..., "path": ...}}, got {text!r}') from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return name, path


def lora_requests(modules: list[tuple[str, str]] | None, enable_lora: bool) -> list:
    """The LoRARequests of --lora-modules (ids 1, 2, ... in their order), each checked by the
    engine before the server starts."""
    from nanovllm.lora.request import LoRARequest
    if modules and not enable_lora:
        raise SystemExit(f"{PROG}: error: --lora-modules needs --enable-lora")
    names = [name for name, _ in modules or ()]
    if len(set(names)) != len(names):
        raise SystemExit(f"{PROG}: error: --lora-modules: each adapter needs its own name, got {names}")
    return [LoRARequest(name, i, path) for i, (name, path) in enumerate(modules or (), 1)]


@contextmanager
def one_line_errors():
    """A user's mistake (a missing model folder, a bad option value, a missing extra) as one line that
    says what to change, not a traceback; NANOVLLM_LOGGING_LEVEL=debug logs the traceback too."""
    try:
        yield
    except (ValueError, TypeError, OSError, ImportError) as e:
        logger.debug("the error's traceback:", exc_info=True)
        raise SystemExit(f"{PROG}: error: {' '.join(str(e).split())}") from None


def serve(argv: list[str] | None = None):
    try:
        import uvicorn

        from nanovllm.serve.app import create_app
    except ImportError as e:
        raise SystemExit(
            f"{PROG}: error: it needs FastAPI and uvicorn: pip install 'nanovllm[serve]' ({e})"
        ) from None
    from nanovllm.llm import LLM

    args = parser().parse_args(argv)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit(f"{PROG}: error: --enable-auto-tool-choice needs --tool-call-parser (one of: "
                         f"{', '.join(PARSERS)})")
    if args.model_tag:
        args.model = args.model_tag
    level = args.log_level or envs.LOGGING_LEVEL.get()
    logging.basicConfig(level=level.upper(), format=FORMAT, datefmt=DATE_FORMAT)
    logging.getLogger("nanovllm").setLevel(level.upper())
    loras = lora_requests(args.lora_modules, args.enable_lora)
    with one_line_errors():
        llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    try:
        with one_line_errors():
            llm.llm_engine.requests.lora_list(loras, len(loras))   # a bad adapter stops the server now
        uvicorn.run(
            create_app(
                llm,
                args.served_model_name or args.model,
                args.stream_interval,
                api_key=args.api_key or envs.API_KEY.get(),
                tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                lora_modules=loras,
                cors=dict(allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                          allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials),
            ),
            host=args.host,
            port=args.port,
            log_level=level,
        )
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None):
    """The `nanovllm` console script: `nanovllm serve ...`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        raise SystemExit(f"usage: {PROG} MODEL [options]   ({PROG} --help lists the options)")
    serve(argv[1:])
