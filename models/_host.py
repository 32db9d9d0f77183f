"""Host-side int64 tensors from Python ints, for the per-iteration index and input columns,
and their copy to the device without waiting.

``torch.tensor(list)`` converts element by element (~0.2 µs an int: ~30 µs for a batch of
32 rows of 5 columns); packing the ints into an ``array`` first and viewing its buffer is
~4x faster. The tensor holds a reference to the array, so the memory lives as long as it.
"""

from __future__ import annotations

import array
import ctypes
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


class StagingRing:
    """Small host-to-device copies without an allocation a call: a ring of ``slots`` pinned
    host buffers, each with a device buffer of its own and an event recorded once the work
    that reads that device buffer is queued (``done``). ``stage`` takes the next slot whose
    event has completed; while every slot is busy (the stream far behind the host), or
    while a CUDA graph is being captured, it returns None and the caller copies as
    ``to_device`` does.

    Why: ``PageTable.sync`` took 59-76 us a call on the H200's host (``pin_memory()``
    allocating from the caching host allocator, the copy to a new device tensor, advanced
    indexing's scatter), twice an iteration: 150-183 us an iteration at batch 64 under a
    server's load (twenty-first session's timers)."""

    def __init__(self, device: torch.device | str, *, slots: int = 8, capacity: int = 4096
                 ) -> None:
        self.device = torch.device(device)
        self.slots = slots
        self.capacity = 0
        self._host: list[torch.Tensor] = []
        self._dev: list[torch.Tensor] = []
        self._events: list[Any] = [None] * slots
        self._next = 0
        self._last: int | None = None
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        """Buffers of ``capacity`` bytes (the old ones are dropped: the caching allocators
        keep them until the copies queued from them are done)."""
        cuda = self.device.type == "cuda"
        with torch.inference_mode(False):
            self._host = [torch.empty(capacity, dtype=torch.uint8, pin_memory=cuda)
                          for _ in range(self.slots)]
            self._dev = [torch.empty(capacity, dtype=torch.uint8, device=self.device)
                         for _ in range(self.slots)]
        self._events = [None] * self.slots
        self.capacity = capacity

    def stage(self, *parts: array.array) -> torch.Tensor | None:
        """``parts``' bytes, one after the other, in a device buffer ([nbytes] uint8, a view
        of it; each part starts where the one before ends), the copy queued without
        waiting; None when no slot is free (see the class). Call ``done`` once what reads
        the buffer is queued."""
        nbytes = sum(len(p) * p.itemsize for p in parts)
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if nbytes > self.capacity:
            self._grow(max(nbytes, 2 * self.capacity))
        for _ in range(self.slots):
            slot = self._next
            self._next = (slot + 1) % self.slots
            event = self._events[slot]
            if event is None or event.query():
                break
        else:
            return None
        host = self._host[slot]
        at = host.data_ptr()
        for p in parts:
            size = len(p) * p.itemsize
            if size:
                ctypes.memmove(at, p.buffer_info()[0], size)
            at += size
        self._last = slot
        dev = self._dev[slot][:nbytes]
        if dev.data_ptr() == host.data_ptr():
            return dev
        return dev.copy_(host[:nbytes], non_blocking=True)

    def done(self) -> None:
        """The work reading the last staged buffer is queued: its slot is free again once
        the device has run it."""
        slot, self._last = self._last, None
        if slot is None or self.device.type != "cuda":
            return
        event = self._events[slot]
        if event is None:
            event = self._events[slot] = torch.cuda.Event()
        event.record()
