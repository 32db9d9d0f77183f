"""A communicator that wraps another: the base of the counting and tracing wrappers."""
from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

import torch

from ._protocol import Communicator, ReduceOp

T = TypeVar("T")


class ForwardingCommunicator(Communicator):
    """Forwards everything to ``inner``; each collective goes through ``_around(op, call,
    shape)`` (the inner collective's awaitable, not yet awaited, and its payload's shape
    where it has one), which a wrapper overrides to count, time or trace it. ``bounded``
    and ``subgroup`` wrap the inner communicator's views with ``_wrap``, which a wrapper
    overrides to share its own state with them (counts, a trace recorder)."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner

    def _wrap(self, inner: Communicator) -> ForwardingCommunicator:
        return ForwardingCommunicator(inner)

    async def _around(self, op: str, call: Awaitable[T],
                      shape: tuple[int, ...] | None = None) -> T:
        return await call

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def timeout_s(self) -> float | None:
        return self.inner.timeout_s

    @property
    def host_tensors(self) -> bool:
        return self.inner.host_tensors

    def bounded(self, seconds: float) -> ForwardingCommunicator:
        return self._wrap(self.inner.bounded(seconds))

    def close(self) -> None:
        self.inner.close()

    async def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return await self._around("all_gather", self.inner.all_gather(tensor),
                                  tuple(tensor.shape))

    async def all_gather_object(self, obj: Any) -> list[Any]:
        return await self._around("all_gather_object", self.inner.all_gather_object(obj))

    async def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return await self._around("all_gather_bytes", self.inner.all_gather_bytes(data),
                                  (len(data),))

    async def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        return await self._around("all_reduce", self.inner.all_reduce(tensor, op),
                                  tuple(tensor.shape))

    async def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return await self._around("broadcast_object", self.inner.broadcast_object(obj, src))

    async def barrier(self) -> None:
        await self._around("barrier", self.inner.barrier())

    async def subgroup(self, ranks: Sequence[int], name: str) -> ForwardingCommunicator:
        return self._wrap(await self.inner.subgroup(ranks, name))
