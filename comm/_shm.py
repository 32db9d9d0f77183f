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
        # (dtype, shape) -> for each buffer, tensors over the map: its rows
        # [world, *shape] and this rank's row [*shape]. A post is then one copy_ and a
        # result one clone (~1.5 us together, against ~3.3 us through numpy, bytes and
        # frombuffer each call; issue 12).
        self._views: dict[tuple[torch.dtype, torch.Size],
                          tuple[tuple[torch.Tensor, torch.Tensor], ...]] = {}

    def _buffer(self, n: int) -> int:
        """Byte offset of call ``n``'s buffer (rows of ``nbytes``, rank order)."""
        return 8 * self.world + (n % 2) * self.world * self.nbytes

    def _views_for(self, like: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        views = self._views.get((like.dtype, like.shape))
        if views is None:
            views = self._views[(like.dtype, like.shape)] = self._make_views(like)
        return views

    def _make_views(self, like: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        if like.numel() * like.element_size() != self.nbytes:
            raise ValueError(f"a {tuple(like.shape)} {like.dtype} tensor is not {self.nbytes} bytes")
        shape = (self.world, *like.shape)
        views = []
        # Plain tensors even when the first call runs under inference_mode: an
        # inference tensor could not be written in place outside it.
        with torch.inference_mode(False):
            for n in (0, 1):
                if self.nbytes == 0:     # frombuffer refuses an empty range
                    rows = torch.empty(shape, dtype=like.dtype)
                else:
                    rows = torch.frombuffer(self._map, dtype=like.dtype, offset=self._buffer(n),
                                            count=self.world * like.numel()).view(shape)
                views.append((rows, rows[self.rank]))
        return tuple(views)

    def post(self, tensor: torch.Tensor) -> None:
        """Write this rank's row of the next call, then announce it. One copy_ into a
        view of the map (torch ops on a small tensor cost microseconds each: one op)."""
        self._n += 1
        self._views_for(tensor)[self._n % 2][1].copy_(tensor.detach())
        self._seq[self.rank] = self._n

    def ready(self) -> bool:
        """Whether every rank has posted the current call."""
        return min(self._seq) >= self._n

    def result(self, like: torch.Tensor) -> torch.Tensor:
        """[world, *like.shape]: every rank's row of the current call (a copy)."""
        return self._views_for(like)[self._n % 2][0].clone()

    def close(self) -> None:
        self._views.clear()     # the tensors over the map, so that it can close
        self._seq.release()
        try:
            self._map.close()
        except BufferError:     # a view still alive: the map goes with it
            pass
