"""Host-side int64 tensors from Python ints, for the per-iteration index and input columns,
and their copy to the device without waiting.

``torch.tensor(list)`` converts element by element (~0.2 µs an int: ~30 µs for a batch of
32 rows of 5 columns); packing the ints into an ``array`` first and viewing its buffer is
~4x faster. The tensor holds a reference to the array, so the memory lives as long as it.
"""

from __future__ import annotations

import array
from typing import Any, Iterable

import torch


def int64_tensor(values: Iterable[int]) -> torch.Tensor:
    """[N] int64 on the host (an empty input gives an empty tensor)."""
    packed = array.array("q", values)
    if not packed:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(packed, dtype=torch.int64)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host``'s copy on ``device``, queued without waiting: on a GPU from pinned memory
    (a copy from pageable memory first waits for the work already queued — a step queued
    ahead, a chained DRAFT + VERIFY — and the host stalls behind it; torch's caching host
    allocator keeps the pinned buffer until the copy is done). On the CPU ``host`` itself."""
    return _pinned(host, torch.device(device)).to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """``host``'s values into ``dst`` (a buffer on its device, e.g. a graph's), queued
    without waiting, as ``to_device``; -> ``dst``."""
    return dst.copy_(_pinned(host, dst.device), non_blocking=True)


def _pinned(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host.pin_memory() if device.type == "cuda" else host


# (stream id, device index, device type) -> its Stream object, made once (``current_stream``).
_STREAMS: dict[tuple[int, int, int], Any] = {}


def current_stream(index: int) -> Any:
    """``torch.cuda.current_stream(index)`` for the hot path: the Stream object made once
    per stream (the stream looked up each call, so a side stream in use is the one
    returned). torch's builds a new one each call: ~4 us of the H200's host, ~5.5 for an
    ``event.record()`` that looks it up (bench/bench_host_ops_gpu.py), a few a step."""
    data = torch._C._cuda_getCurrentStream(index)
    stream = _STREAMS.get(data)
    if stream is None:
        stream = _STREAMS[data] = torch.cuda.Stream(stream_id=data[0], device_index=data[1],
                                                    device_type=data[2])
    return stream


class StagingRing:
    """Pinned host buffers taken in turn, and one device buffer, for a small
    host-to-device copy that one caller makes every iteration (``PageTable.sync``):
    nothing allocated or pinned a call, where ``to_device`` pins a fresh buffer from torch's
    caching host allocator each time. A host buffer is written again only once the copy
    that last read it is done (its event: with DEPTH buffers the host waits only when the
    GPU lags DEPTH copies behind). The device buffer is reused in stream order: the caller
    queues what reads one copy before it takes the next. A larger request than the buffers
    hold makes new ones (the old ones' pending copies keep them: torch's host allocator
    records each copy's use). On the CPU the same without pinning or events (a table that
    stands in for a device's copy, in tests)."""

    DEPTH = 8
    MIN_CAPACITY = 1024     # elements a buffer, made at the first ``take``

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self._capacity, self._next = 0, 0
        self._host: list[torch.Tensor] = []
        self._numpy: list[Any] = []
        self._events: list[Any] = []
        self._on_device = torch.empty(0, dtype=dtype, device=device)

    def _grow(self, capacity: int) -> None:
        self._capacity = capacity
        cuda = self.device.type == "cuda"
        # Plain tensors even when the first ``take`` runs under inference mode (a step's
        # forward): an inference tensor cannot be written outside it.
        with torch.inference_mode(False):
            self._host = [torch.empty(capacity, dtype=self.dtype, pin_memory=cuda)
                          for _ in range(self.DEPTH)]
            self._on_device = torch.empty(capacity, dtype=self.dtype, device=self.device)
        self._numpy = [h.numpy() for h in self._host]
        # One event a buffer (on a GPU): the copy that last read it.
        self._events = [torch.cuda.Event() for _ in range(self.DEPTH)] if cuda else []

    def take(self, n: int) -> tuple[Any, int]:
        """A host buffer of at least ``n`` elements to write (a numpy view) and its number
        for ``copy``."""
        if n > self._capacity:
            self._grow(max(n, 2 * self._capacity, self.MIN_CAPACITY))
        i = self._next
        self._next = (i + 1) % self.DEPTH
        if self._events:    # (an event never recorded is done)
            self._events[i].synchronize()   # the copy that last read it: done, nearly always
        return self._numpy[i], i

    def copy_into(self, i: int, dsts: list[torch.Tensor]) -> None:
        """Queue the copy of host buffer ``i``'s leading elements into ``dsts``
        (contiguous device tensors of this ring's dtype), one after another in the buffer:
        straight into where they are read (a graph's static inputs), no device buffer of
        the ring's between."""
        host, start = self._host[i], 0
        for dst in dsts:
            n = dst.numel()
            dst.view(-1).copy_(host[start:start + n], non_blocking=True)
            start += n
        if self._events and dsts:
            self._events[i].record(current_stream(dsts[0].device.index))

    def copy(self, i: int, n: int) -> torch.Tensor:
        """Queue the copy of host buffer ``i``'s first ``n`` elements; -> their device
        copy (valid until the next ``copy`` is queued behind what reads it)."""
        out = self._on_device[:n]
        out.copy_(self._host[i][:n], non_blocking=True)
        if self._events:
            self._events[i].record(current_stream(out.device.index))
        return out
