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

A row goes in and the rows come out through numpy and the map's buffer, not torch ops:
each torch op releases the GIL and takes it back, and under ADP the rank's compute thread
(queueing the step run ahead) then holds it, so every op of the exchange waited for it —
a small ``copy_`` ~4x its idle time, the exchange ~60-90 us instead of ~15 on an H200
host (docs/performance-history.md, "The exchange on one shared H200"). numpy's small
copies keep the GIL. A dtype numpy lacks (bfloat16) takes tensor views of the map.
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
    """One rank's side of the all-gather of ``nbytes``-byte tensors."""

    def __init__(self, path: str, rank: int, world: int, nbytes: int) -> None:
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _size(world, nbytes))
        self._bytes = memoryview(self._map)
        self._seq = self._bytes[:8 * world].cast("q")   # [world] int64
        self.rank, self.world, self.nbytes = rank, world, nbytes
        self._n = 0
        # A dtype numpy lacks: (dtype, shape) -> for each buffer, tensors over the map:
        # its rows [world, *shape] and this rank's row [*shape].
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
        """Write this rank's row of the next call (a host tensor of ``nbytes``), then
        announce it."""
        self._n += 1
        row = _numpy(tensor)
        if row is not None and row.nbytes == self.nbytes:
            start = self._buffer(self._n) + self.rank * self.nbytes
            self._bytes[start:start + self.nbytes] = row.tobytes()
        else:
            self._views_for(tensor)[self._n % 2][1].copy_(tensor.detach())
        self._seq[self.rank] = self._n

    def ready(self) -> bool:
        """Whether every rank has posted the current call."""
        return min(self._seq) >= self._n

    def result(self, like: torch.Tensor) -> torch.Tensor:
        """[world, *like.shape]: every rank's row of the current call (a copy; over a numpy
        array where numpy has the dtype, so ``.numpy()`` reads it without a torch op)."""
        dtype = _NUMPY_DTYPES.get(like.dtype)
        if dtype is None:
            return self._views_for(like)[self._n % 2][0].clone()
        start = self._buffer(self._n)
        rows = np.frombuffer(bytearray(self._bytes[start:start + self.world * self.nbytes]),
                             dtype=dtype)
        return torch.from_numpy(rows.reshape(self.world, *like.shape))

    def close(self) -> None:
        self._views.clear()     # the tensors over the map, so that it can close
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


def _numpy(tensor: torch.Tensor) -> np.ndarray | None:
    """The host tensor's elements as a C-contiguous numpy array sharing its memory
    (``Tensor.numpy`` keeps the GIL), or None where numpy cannot hold them."""
    if tensor.dtype not in _NUMPY_DTYPES or tensor.requires_grad:
        return None
    row = tensor.numpy()
    return row if row.flags.c_contiguous else None
