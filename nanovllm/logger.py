"""nanovllm's log lines: INFO and above on stderr by default, as vLLM prints its own, set up once when
nanovllm is imported (nanovllm/__init__.py). NANOVLLM_LOGGING_LEVEL picks the level;
NANOVLLM_CONFIGURE_LOGGING=0 adds no handler, so the records reach the application's logging as any
library's do (its root handlers, pytest's caplog)."""
import logging

import nanovllm.envs as envs

FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


class _NanovllmHandler(logging.StreamHandler):
    """The handler configure_logger adds (a class of its own, so a second call finds it)."""


def configure_logger(name: str = "nanovllm", environ=None) -> logging.Logger:
    """Give the `name` logger one stderr handler at $NANOVLLM_LOGGING_LEVEL (default INFO), and stop
    its records there (no second copy through the root logger's handlers); nothing when
    $NANOVLLM_CONFIGURE_LOGGING is 0. environ: this process's environment by default."""
    logger = logging.getLogger(name)
    if not envs.CONFIGURE_LOGGING.get(environ):
        return logger
    level = envs.LOGGING_LEVEL.get(environ).upper()
    if not any(isinstance(h, _NanovllmHandler) for h in logger.handlers):
        handler = _NanovllmHandler()   # stderr
        handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return logger


def quiet_worker_logger(name: str = "nanovllm", environ=None):
    """In a tensor-parallel worker (ranks 1..N-1): at the default level, warnings and errors only, so
    each INFO line (the start-up's, the KV cache's) is printed once, by rank 0, not once a rank."""
    if envs.CONFIGURE_LOGGING.get(environ) and envs.LOGGING_LEVEL.get(environ) == "info":
        logging.getLogger(name).setLevel(logging.WARNING)
