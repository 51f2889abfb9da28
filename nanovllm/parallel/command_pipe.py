"""Length-prefixed pickled messages over a pipe: how rank 0 sends commands to a worker.

A pipe rather than named shared memory and semaphores: the kernel buffers and orders the bytes
(a writer never overwrites an unread command), and there is no name in /dev/shm that a killed or
interrupted process could leave behind; the pipe goes away with the last process that holds it.

Every wait is a loop of short `select` timeouts that calls a `check` function, so a dead or stuck
peer becomes an error raised by `check`, and Ctrl-C is seen within a fraction of a second."""
import fcntl
import os
import pickle
import select
import struct

_HEADER = struct.Struct("<Q")   # payload length
POLL_S = 0.1
_F_SETPIPE_SZ = 1031            # Linux: a 1 MiB pipe holds a large prefill step in one write


def new_pipe() -> tuple[int, int]:
    """(read_fd, write_fd); the writer's end does not block (send waits in select instead)."""
    r, w = os.pipe()
    try:
        fcntl.fcntl(w, _F_SETPIPE_SZ, 1 << 20)
    except OSError:
        pass   # not Linux, or above the system's limit: the default size works, in more waits
    os.set_blocking(w, False)
    return r, w


def encode(message) -> bytes:
    """One message as sent: encoded once, sent to every worker."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def send(fd: int, data: bytes, check):
    """Write one encoded message; while the pipe is full, wait in short slices calling check()."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            select.select([], [fd], [], POLL_S)
            check()


def receive(fd: int, check):
    """Read one message (blocking fd). Raises EOFError when the writer has closed the pipe."""
    (n,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size, check))
    return pickle.loads(_read_exactly(fd, n, check))


def _read_exactly(fd: int, n: int, check) -> bytes:
    chunks = []
    while n:
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if not ready:
            check()
            continue
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError("the command pipe was closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)
