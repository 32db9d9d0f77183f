"""Where the in-process ranks of one group meet, one slot per sequence number."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import attrs
import structlog

from ._call import CollectiveCall
from ._errors import CollectiveMismatchError, CollectiveTimeoutError

log = structlog.get_logger(__name__)


@attrs.define
class _Failure:
    mismatch: bool
    missing: tuple[int, ...]
    reason: str = ""


@attrs.define
class _Slot:
    """One collective of one group: who arrived with what, and how it ended."""

    done: anyio.Event = attrs.field(factory=anyio.Event)
    calls: dict[int, CollectiveCall] = attrs.field(factory=dict)
    payloads: dict[int, Any] = attrs.field(factory=dict)
    combine: Callable[[list[Any]], Any] | None = None
    result: Any = None
    failure: _Failure | None = None
    collected: int = 0


class Rendezvous:
    """The meeting point of one group (world or subgroup) of a LocalGroup.

    Each member numbers its own collectives; the n-th collective of every member meets
    in slot n. `gone` maps ranks that will never arrive again to the reason.
    """

    def __init__(self, name: str, members: tuple[int, ...], timeout: float, gone: Mapping[int, str]):
        self.name = name
        self.members = members
        self._timeout = timeout
        self._gone = gone
        self._next_seq = dict.fromkeys(members, 0)
        self._slots: dict[int, _Slot] = {}

    def next_seq(self, rank: int) -> int:
        seq = self._next_seq[rank]
        self._next_seq[rank] = seq + 1
        return seq

    async def enter(self, rank: int, call: CollectiveCall, payload: Any, combine: Callable[[list[Any]], Any],
                    timeout: float | None = None) -> Any:
        """Arrive with `call`; return the combined result once every member has arrived
        (waiting at most `timeout` seconds, default the group's)."""
        timeout = self._timeout if timeout is None else timeout
        slot = self._slots.setdefault(call.seq, _Slot())
        if not slot.done.is_set():
            slot.calls[rank] = call
            slot.payloads[rank] = payload
            slot.combine = combine
            self._settle(slot)
        if not slot.done.is_set():
            with anyio.move_on_after(timeout):
                await slot.done.wait()
        if not slot.done.is_set():
            self._fail(slot, mismatch=False, reason=f"no arrival within {timeout}s")
        return self._outcome(call, slot, rank)

    async def stall(self, rank: int, call: CollectiveCall) -> Any:
        """Never arrive at `call`'s slot; raise once the others gave up on it."""
        slot = self._slots.setdefault(call.seq, _Slot())
        await slot.done.wait()
        try:
            return self._outcome(call, slot, rank)
        except CollectiveTimeoutError as exc:
            reason = f"this rank was stalled on purpose; the others gave up ({exc.reason})"
            raise CollectiveTimeoutError(call, exc.missing, reason) from None

    def rank_gone(self) -> None:
        """Fail at once every open slot that waits on a rank that is gone."""
        for slot in list(self._slots.values()):
            if not slot.done.is_set() and slot.calls:
                self._settle(slot)

    def _settle(self, slot: _Slot) -> None:
        first = next(iter(slot.calls.values()))
        if any(c != first for c in slot.calls.values()):
            self._fail(slot, mismatch=True)
        elif gone := tuple(r for r in self._missing(slot) if r in self._gone):
            reason = "; ".join(f"rank {r} {self._gone[r]}" for r in gone)
            self._fail(slot, mismatch=False, reason=reason, missing=gone)  # the others may just be late
        elif not self._missing(slot):
            assert slot.combine is not None    # set by the first arrival
            slot.result = slot.combine([slot.payloads[r] for r in self.members])
            slot.payloads.clear()
            slot.done.set()

    def _fail(self, slot: _Slot, *, mismatch: bool, reason: str = "", missing: tuple[int, ...] | None = None) -> None:
        slot.failure = _Failure(mismatch, self._missing(slot) if missing is None else missing, reason)
        slot.payloads.clear()
        slot.done.set()
        calls = {r: c.describe() for r, c in slot.calls.items()}
        log.warning("collective_failed", group=self.name, mismatch=mismatch, calls=calls,
                    missing=slot.failure.missing, reason=reason)

    def _missing(self, slot: _Slot) -> tuple[int, ...]:
        return tuple(r for r in self.members if r not in slot.calls)

    def _outcome(self, call: CollectiveCall, slot: _Slot, rank: int) -> Any:
        failure = slot.failure
        if failure is None:
            slot.collected += 1
            if slot.collected == len(self.members):
                del self._slots[call.seq]  # everyone has it; failed slots stay for late ranks
            return slot.result
        if failure.mismatch:
            # Late ranks see the calls known so far, their own included.
            calls = {**slot.calls, rank: call}
            raise CollectiveMismatchError(calls, [r for r in failure.missing if r not in calls])
        raise CollectiveTimeoutError(call, _others(failure.missing, rank), failure.reason)


def _others(missing: Sequence[int], rank: int) -> tuple[int, ...]:
    # A stalled rank is itself "missing"; it is told about the others only.
    return tuple(r for r in missing if r != rank)
