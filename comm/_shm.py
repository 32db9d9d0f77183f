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

Rows are bytes (``post``, ``result``): no torch op runs on the way. Each torch op
releases the GIL and takes it back, and under ADP the rank's compute thread (queueing the
step run ahead) then holds it, so every op of the exchange waited for it — a small
``copy_`` ~5x its idle time on an H200 host (docs/performance-history.md, "The exchange
on one shared H200, and on two"). ``tensor_bytes`` / ``tensor_from`` carry tensors
(through numpy, whose small copies keep the GIL, where numpy has the dtype).
"""
from __future__ import annotations

import mmap
import os
import platform
import tempfile

import numpy as np
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
    """One rank's side of the all-gather of ``nbytes``-byte rows."""

    def __init__(self, path: str, rank: int, world: int, nbytes: int) -> None:
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _size(world, nbytes))
        self._bytes = memoryview(self._map)
        self._seq = self._bytes[:8 * world].cast("q")   # [world] int64
        self.rank, self.world, self.nbytes = rank, world, nbytes
        self._n = 0

    def _buffer(self, n: int) -> int:
        """Byte offset of call ``n``'s buffer (rows of ``nbytes``, rank order)."""
        return 8 * self.world + (n % 2) * self.world * self.nbytes

    def post(self, row: bytes) -> None:
        """Write this rank's row of the next call (``nbytes`` of them), then announce it."""
        if len(row) != self.nbytes:
            raise ValueError(f"a row of {len(row)} bytes is not {self.nbytes} bytes")
        self._n += 1
        start = self._buffer(self._n) + self.rank * self.nbytes
        self._bytes[start:start + self.nbytes] = row
        self._seq[self.rank] = self._n

    def ready(self) -> bool:
        """Whether every rank has posted the current call."""
        return min(self._seq) >= self._n

    def result(self) -> bytes:
        """Every rank's row of the current call, in rank order, as one copy
        (``world * nbytes`` bytes)."""
        start = self._buffer(self._n)
        return self._bytes[start:start + self.world * self.nbytes].tobytes()

    def close(self) -> None:
        self._seq.release()
        self._bytes.release()
        try:
            self._map.close()
        except BufferError:     # a view still alive: the map goes with it
            pass


_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    d: np.dtype(n) for d, n in ((torch.int64, "int64"), (torch.int32, "int32"),
                                (torch.uint8, "uint8"), (torch.int8, "int8"),
                                (torch.float32, "float32"), (torch.float64, "float64"),
                                (torch.float16, "float16"), (torch.bool, "bool"))}


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A host tensor's elements in row-major order (strided or not), through numpy where
    numpy has the dtype (``Tensor.numpy`` keeps the GIL)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.dtype not in _NUMPY_DTYPES:
        tensor = tensor.contiguous().reshape(-1).view(torch.uint8)
    data: bytes = tensor.numpy().tobytes()
    return data


def tensor_from(rows: bytes, world: int, like: torch.Tensor) -> torch.Tensor:
    """[world, *like.shape] of ``like``'s dtype over a copy of ``rows``
    (``SharedGather.result``); over a numpy array where numpy has the dtype."""
    shape = (world, *like.shape)
    dtype = _NUMPY_DTYPES.get(like.dtype)
    if dtype is not None:
        return torch.from_numpy(np.frombuffer(bytearray(rows), dtype=dtype).reshape(shape))
    if not rows:        # frombuffer refuses an empty buffer
        return torch.empty(shape, dtype=like.dtype)
    return torch.frombuffer(bytearray(rows), dtype=torch.uint8).view(like.dtype).view(shape)
