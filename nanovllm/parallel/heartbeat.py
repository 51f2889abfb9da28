"""Heartbeat counters shared between processes, to tell a live but stopped process from a busy one."""
import mmap
import os
import struct
import tempfile


class Heartbeats:
    """One counter per rank in memory shared through an unlinked temporary file (nothing to clean
    up, nothing left in /dev/shm): each worker's heartbeat thread increments its own."""

    def __init__(self, size: int, fd: int | None = None):
        self.file = None
        if fd is None:   # rank 0 creates it; workers attach to the inherited descriptor
            self.file = tempfile.TemporaryFile()
            fd = self.file.fileno()
            os.ftruncate(fd, 8 * size)
        self.fd = fd
        self.map = mmap.mmap(fd, 8 * size)

    def count(self, rank: int) -> int:
        return struct.unpack_from("<Q", self.map, 8 * rank)[0]

    def beat(self, rank: int):
        struct.pack_into("<Q", self.map, 8 * rank, self.count(rank) + 1)

    def close(self):
        self.map.close()
        if self.file is not None:
            self.file.close()
