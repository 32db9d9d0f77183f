"""All-gather of small host tensors between the processes of one host, through a file in
shared memory (``TorchDistributedCommunicator.shared_memory``): a gloo all-gather costs
~0.5 ms per call on an idle host (TCP and gloo's threads), this costs two memory copies
and a poll.

Layout: ``world`` int64 sequence numbers, then two buffers of ``world`` rows of
``nbytes``. Call n writes this rank's row into buffer n % 2, then stores n in its
sequence slot; it is complete when every slot holds at least n. Two buffers suffice: a
rank can start call n + 2 (which overwrites buffer n % 2) only once call n + 1 completed,
that is once every rank stored n + 1, which each does after it finished reading call n.
The row is stored before the sequence number and read after it: program order, which
x86-64 keeps for stores and for loads (``supported`` says where this runs).
"""
from __future__ import annotations

import mmap
import os
import platform
import tempfile

import torch


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def _size(world: int, nbytes: int) -> int:
    return 8 * world + 2 * world * nbytes


def create_file(world: int, nbytes: int) -> str:
    """A zeroed file of the right size (rank 0 makes it; every rank then ``attach``es)."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="specloop-gather-", dir=folder)
    with os.fdopen(fd, "wb") as f:
        f.truncate(_size(world, nbytes))
    return path


class SharedGather:
    """One rank's side of the all-gather of ``nbytes``-byte tensors."""

    def __init__(self, path: str, rank: int, world: int, nbytes: int) -> None:
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _size(world, nbytes))
        self._seq = memoryview(self._map)[:8 * world].cast("q")   # [world] int64
        self.rank, self.world, self.nbytes = rank, world, nbytes
        self._n = 0

    def _buffer(self, n: int) -> int:
        """Byte offset of call ``n``'s buffer (rows of ``nbytes``, rank order)."""
        return 8 * self.world + (n % 2) * self.world * self.nbytes

    def post(self, tensor: torch.Tensor) -> None:
        """Write this rank's row of the next call, then announce it. Plain memory copies
        through the map: torch ops on a small tensor cost microseconds each (issue 12)."""
        self._n += 1
        start = self._buffer(self._n) + self.rank * self.nbytes
        flat = tensor.detach().contiguous()
        try:
            data = memoryview(flat.numpy()).cast("B")
        except TypeError:   # a dtype numpy lacks (bfloat16): its bytes
            data = memoryview(flat.reshape(-1).view(torch.uint8).numpy())
        self._map[start:start + self.nbytes] = data
        self._seq[self.rank] = self._n

    def ready(self) -> bool:
        """Whether every rank has posted the current call."""
        return min(self._seq) >= self._n

    def result(self, like: torch.Tensor) -> torch.Tensor:
        """[world, *like.shape]: every rank's row of the current call (a copy)."""
        start = self._buffer(self._n)
        rows = bytearray(self._map[start:start + self.world * self.nbytes])
        return torch.frombuffer(rows, dtype=like.dtype).view(self.world, *like.shape)

    def close(self) -> None:
        self._seq.release()
        try:
            self._map.close()
        except BufferError:     # a view still alive: the map goes with it
            pass
