"""Process helpers the engine and the Ray code share: which process owns what an object holds
(Lifetime), the PYTHONPATH a child interpreter needs to import this nanovllm, and whether a
process is stopped."""
import os

import nanovllm.envs as envs


class Lifetime:
    """Whether what an object holds (worker processes, device memory) was shut down, and whether
    the caller may shut it down: a child forked from the process that made it inherits the object,
    with its atexit hooks and destructors, but what it holds is still the parent's."""

    def __init__(self):
        self.pid = os.getpid()
        self.closed = False

    @property
    def forked(self) -> bool:
        """Is this a child forked from the process that made it?"""
        return os.getpid() != self.pid


def child_pythonpath() -> str:
    """PYTHONPATH for a child interpreter (a tensor-parallel worker, a local Ray worker) that must
    import the same nanovllm as this process, not another install: the folder holding the package
    first, then this process's PYTHONPATH. Found from this file's path: importing nanovllm to ask
    would import the engine (nanovllm/__init__ -> llm -> engine), a circle for the engine's modules."""
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.pathsep.join(p for p in (package_parent, envs.PYTHONPATH.get()) if p)


def is_stopped(pid: int) -> bool:
    """Is the process stopped (SIGSTOP, Ctrl-Z alone, a debugger)? Linux's /proc; elsewhere False."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False
