"""Counting collectives by op, label and group, so tests can assert how many ran."""
from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ._protocol import Communicator, ReduceOp


class _Tally:
    """Shared by a counter and the sub-counters of its subgroups."""

    def __init__(self) -> None:
        self.label: str | None = None
        self.counts: collections.Counter[tuple[str | None, str, str]] = collections.Counter()


class CollectiveCounter(Communicator):
    """A Communicator that forwards to `inner` and counts each collective it enters.

    Counts are keyed by (label, op, group). Set `label` (or use `labelled(...)`) to
    attribute collectives to, e.g., the iteration state that issued them; subgroups
    taken from a counter share its label and counts.
    """

    def __init__(self, inner: Communicator, *, _tally: _Tally | None = None) -> None:
        self.inner = inner
        self._tally = _tally or _Tally()

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
    def label(self) -> str | None:
        return self._tally.label

    @label.setter
    def label(self, value: str | None) -> None:
        self._tally.label = value

    @contextlib.contextmanager
    def labelled(self, label: str | None) -> Iterator[None]:
        """Set `label` for the duration of the block, then restore the previous one."""
        previous, self._tally.label = self._tally.label, label
        try:
            yield
        finally:
            self._tally.label = previous

    def count(self, op: str | None = None, *, label: Any = ..., group: str | None = None) -> int:
        """Collectives entered so far matching every given filter (label=None matches
        unlabelled ones; leave it out to match any label)."""
        return sum(
            n for (lab, o, grp), n in self._tally.counts.items()
            if (op is None or o == op) and (label is ... or lab == label) and (group is None or grp == group)
        )

    def by_op(self) -> dict[str, int]:
        out: collections.Counter[str] = collections.Counter()
        for (_, op, _), n in self._tally.counts.items():
            out[op] += n
        return dict(out)

    def by_label(self) -> dict[str | None, int]:
        out: collections.Counter[str | None] = collections.Counter()
        for (label, _, _), n in self._tally.counts.items():
            out[label] += n
        return dict(out)

    @property
    def timeout_s(self) -> float | None:
        return self.inner.timeout_s

    @property
    def host_tensors(self) -> bool:
        return self.inner.host_tensors

    def bounded(self, seconds: float) -> CollectiveCounter:
        """The inner communicator's bounded view, still counted here."""
        return CollectiveCounter(self.inner.bounded(seconds), _tally=self._tally)

    def close(self) -> None:
        self.inner.close()

    def reset(self) -> None:
        self._tally.counts.clear()

    def _record(self, op: str) -> None:
        self._tally.counts[(self._tally.label, op, self.inner.name)] += 1

    async def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self._record("all_gather")
        return await self.inner.all_gather(tensor)

    async def all_gather_object(self, obj: Any) -> list[Any]:
        self._record("all_gather_object")
        return await self.inner.all_gather_object(obj)

    async def all_gather_bytes(self, data: bytes) -> list[bytes]:
        self._record("all_gather_bytes")
        return await self.inner.all_gather_bytes(data)

    async def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        self._record("all_reduce")
        return await self.inner.all_reduce(tensor, op)

    async def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        self._record("broadcast_object")
        return await self.inner.broadcast_object(obj, src)

    async def barrier(self) -> None:
        self._record("barrier")
        await self.inner.barrier()

    async def subgroup(self, ranks: Sequence[int], name: str) -> CollectiveCounter:
        return CollectiveCounter(await self.inner.subgroup(ranks, name), _tally=self._tally)


def collective_label(comm: object, label: str | None) -> contextlib.AbstractContextManager[None]:
    """`with collective_label(comm, "SYNC"):` labels collectives when `comm` counts them
    (a CollectiveCounter) and does nothing otherwise; cheap per state."""
    return comm.labelled(label) if isinstance(comm, CollectiveCounter) else contextlib.nullcontext()
