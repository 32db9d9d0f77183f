"""Counting collectives by op, label and group, so tests can assert how many ran."""
from __future__ import annotations

import collections
import contextlib
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

from ._forwarding import ForwardingCommunicator
from ._protocol import Communicator

T = TypeVar("T")


class _Tally:
    """Shared by a counter and the sub-counters of its subgroups."""

    def __init__(self) -> None:
        self.label: str | None = None
        self.counts: collections.Counter[tuple[str | None, str, str]] = collections.Counter()


class CollectiveCounter(ForwardingCommunicator):
    """A Communicator that forwards to `inner` and counts each collective it enters.

    Counts are keyed by (label, op, group). Set `label` (or use `labelled(...)`) to
    attribute collectives to, e.g., the iteration state that issued them; subgroups
    taken from a counter share its label and counts.
    """

    def __init__(self, inner: Communicator, *, _tally: _Tally | None = None) -> None:
        super().__init__(inner)
        self._tally = _tally or _Tally()

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

    def _wrap(self, inner: Communicator) -> CollectiveCounter:
        return CollectiveCounter(inner, _tally=self._tally)     # the same counts

    def reset(self) -> None:
        self._tally.counts.clear()

    async def _around(self, op: str, call: Awaitable[T],
                      shape: tuple[int, ...] | None = None) -> T:
        self._tally.counts[(self._tally.label, op, self.inner.name)] += 1
        return await call


def collective_label(comm: object, label: str | None) -> contextlib.AbstractContextManager[None]:
    """`with collective_label(comm, "SYNC"):` labels collectives when `comm` counts them
    (a CollectiveCounter) and does nothing otherwise; cheap per state."""
    return comm.labelled(label) if isinstance(comm, CollectiveCounter) else contextlib.nullcontext()
