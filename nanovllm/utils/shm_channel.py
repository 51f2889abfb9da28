"""A one-writer, many-reader command channel over shared memory.

Rank 0 writes one pickled command at a time into a shared-memory buffer; each worker copies it out.
The writer never overwrites a command a reader is still copying: `free` counts the acknowledgements,
and the writer takes one from every reader before it writes again (it starts at num_readers, so the
first write does not wait). Each reader has its own `posted` semaphore, released once per command.

Waits are loops of short timeouts that call a `check` function, so a dead peer turns into an error
(raised by `check`) instead of a hang."""
import itertools
import os
import pickle
import secrets
import struct
from multiprocessing import shared_memory

_HEADER = struct.Struct("<Q")   # payload length
_counter = itertools.count()
POLL_S = 0.2


def unique_name() -> str:
    """Unique per engine: pid, a per-process counter and a random suffix."""
    return f"nanovllm-{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"


class ShmChannel:
    def __init__(self, ctx, num_readers: int, size: int):
        """Create the segment and the semaphores (rank 0). Pass the instance to workers as a spawn
        argument; it pickles to its name and semaphores and reattaches on the other side."""
        self.name = unique_name()
        self.size = size
        self.shm = shared_memory.SharedMemory(self.name, create=True, size=_HEADER.size + size)
        self.free = ctx.Semaphore(num_readers)
        self.posted = [ctx.Semaphore(0) for _ in range(num_readers)]
        self.num_readers = num_readers
        self.owner = True

    def __getstate__(self):
        return dict(name=self.name, size=self.size, free=self.free, posted=self.posted, num_readers=self.num_readers)

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.shm = shared_memory.SharedMemory(self.name)
        self.owner = False

    # ---- writer (rank 0) ------------------------------------------------------------------

    def write(self, command, check):
        payload = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        # The buffer is sized from the engine's limits (tokens per step, sequences, blocks).
        assert len(payload) <= self.size, f"command of {len(payload)} bytes exceeds the {self.size}-byte channel"
        for _ in range(self.num_readers):
            _wait(self.free, check)   # every reader has copied the previous command out
        _HEADER.pack_into(self.shm.buf, 0, len(payload))
        self.shm.buf[_HEADER.size:_HEADER.size + len(payload)] = payload
        for sem in self.posted:
            sem.release()

    # ---- reader (worker `index`, 0-based) -------------------------------------------------

    def read(self, index: int, check):
        _wait(self.posted[index], check)
        (n,) = _HEADER.unpack_from(self.shm.buf, 0)
        payload = bytes(self.shm.buf[_HEADER.size:_HEADER.size + n])
        self.free.release()   # copied out: the writer may reuse the buffer
        return pickle.loads(payload)

    def close(self):
        """Detach; the owner also removes the segment from the system."""
        if self.shm is None:
            return
        self.shm.close()
        if self.owner:
            self.shm.unlink()
        self.shm = None


def _wait(sem, check):
    while not sem.acquire(timeout=POLL_S):
        check()
