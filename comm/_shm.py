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
        rows = torch.frombuffer(self._map, dtype=torch.uint8)[8 * world:]
        self._rows = rows.view(2, world, nbytes)
        self.rank, self.world, self.nbytes = rank, world, nbytes
        self._n = 0

    def post(self, tensor: torch.Tensor) -> None:
        """Write this rank's row of the next call, then announce it."""
        self._n += 1
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self._rows[self._n % 2, self.rank].copy_(data)
        self._seq[self.rank] = self._n

    def ready(self) -> bool:
        """Whether every rank has posted the current call."""
        n, seq = self._n, self._seq
        return all(seq[r] >= n for r in range(self.world))

    def result(self, like: torch.Tensor) -> torch.Tensor:
        """[world, *like.shape]: every rank's row of the current call (a copy)."""
        return self._rows[self._n % 2].clone().view(like.dtype).view(self.world, *like.shape)

    def close(self) -> None:
        self._seq.release()
        del self._rows
        try:
            self._map.close()
        except BufferError:     # a view still alive: the map goes with it
            pass
