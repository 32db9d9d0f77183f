"""SCHEDULE's exchange with the front door: new requests and cancels in, outputs out.

One rank: the front door is local; outputs go straight to it. Several ranks: rank 0 holds
the front door; the other ranks' outputs travel to it in SCHEDULE's one all-gather.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._frontdoor import (NO_MESSAGE, FrontDoorMessage, RankReport, assign_least_loaded,
                         assign_to_rank0)
from ._request import RequestOutput
from ._wire import encode_rows

if TYPE_CHECKING:
    from specloop.comm import Communicator

    from ._config import EngineConfig
    from ._frontdoor import FrontDoorPort
    from ._scheduler import Scheduler


class ExchangeTimes:
    """Per exchange of a group: how long this rank waited for the last one to arrive
    (skew: load imbalance, host jitter) and how long the collective took after that (its
    own cost). Arrival stamps ride the exchange; ranks of one host share the clock."""

    def __init__(self, keep: int = 4096) -> None:
        self.count = 0
        self.skew_us_total = 0
        self.collective_us_total = 0
        self.recent: deque[tuple[int, int]] = deque(maxlen=keep)   # (skew, collective)

    def record(self, skew_us: int, collective_us: int) -> None:
        self.count += 1
        self.skew_us_total += skew_us
        self.collective_us_total += collective_us
        self.recent.append((skew_us, collective_us))


class OutputExchange:
    """``await exchange(facts)`` -> the front door's message for this iteration;
    ``deliver(handle, output)`` hands one output towards the front door. In a group,
    ``facts`` (this rank's SYNC row) ride the same all-gather; ``gathered_rows`` then
    holds every rank's row, world lists of len(facts) ints."""

    def __init__(self, *, config: EngineConfig, comm: Communicator, front: FrontDoorPort | None,
                 scheduler: Scheduler) -> None:
        self.config = config
        self.comm = comm
        self.front = front          # FrontDoor on rank 0, None elsewhere
        self.scheduler = scheduler
        # The exchange stays on the host when the communicator keeps host collectives
        # there (``host_tensors``; torch.distributed: shared memory or gloo): then it
        # neither syncs the device nor waits behind a step queued there (RunAhead.always
        # in a group).
        self.on_host = comm.host_tensors
        self.k = config.speculative.k
        self.pending: list[tuple[int, RequestOutput]] = []
        # Requests per rank, as of the last SYNC: where rank 0 assigns new requests.
        self.loads = [0] * comm.world_size
        self._exchange = self._group if comm.world_size > 1 else self._local
        # Every rank's SYNC facts, as Python ints (SYNC's agreement reads them without
        # tensor ops).
        self.gathered_rows: list[list[int]] = []
        self.times = ExchangeTimes()
        # Rank 0: the other ranks' output blocks of the last exchange (int64 bytes), not
        # yet decoded and delivered (``hand_over``); the empty block it sends itself,
        # built once.
        self._held: list[bytes] | None = None
        self._empty: array[int] | None = None
        # Rank 0, once an exchange was deferred: its own outputs wait for ``hand_over``
        # too, so no consumer is woken between RESCAN and the next exchange (they would
        # run while rank 0 polls for the other ranks' rows, or before it posts its own).
        self._deferring = False
        self._own: list[RequestOutput] = []

    async def __call__(self, facts: Sequence[int] = (), *, defer: bool = False
                       ) -> FrontDoorMessage:
        """``defer``: rank 0 keeps the other ranks' outputs until ``hand_over`` (the
        worker calls it once this iteration's step is queued), so decoding them and the
        consumers they wake do not delay the step; the next exchange hands them over
        first if nothing else did."""
        return await self._exchange(facts, defer)

    def hand_over(self) -> None:
        """Rank 0: decode and deliver the outputs held from the last exchange, and its
        own held since (in the order each was produced: a request's outputs are all
        from one rank)."""
        self._hand_over_blocks()
        if self._own and self.front is not None:
            own, self._own = self._own, []
            self.front.deliver(own)

    def _hand_over_blocks(self) -> None:
        held, self._held = self._held, None
        front = self.front
        if held is None or front is None:
            return
        front.deliver_blocks(held, self.k)

    def deliver(self, handle: int, output: RequestOutput) -> None:
        self.deliver_many([handle], [output])

    def deliver_many(self, handles: list[int], outputs: list[RequestOutput]) -> None:
        """``deliver`` of each (handle, output), row for row, in order: RESCAN's outputs
        of one iteration, handed over in one call."""
        if self.front is None:
            self.pending.extend(zip(handles, outputs))
        elif self._deferring:
            self._own.extend(outputs)
        else:
            self.front.deliver(outputs)

    async def _local(self, facts: Sequence[int], defer: bool) -> FrontDoorMessage:
        front = self.front
        assert front is not None, "a single rank is rank 0, which holds the front door"
        if self.scheduler.num_requests == 0:
            await front.wait_for_work(timeout=None)
        return front.take_message(assign_to_rank0)

    async def _group(self, facts: Sequence[int], defer: bool) -> FrontDoorMessage:
        """One ``all_gather_bytes``: each serving rank's outputs as a fixed-size block, its
        SYNC facts, its arrival time and a flag (int64); only when some rank raised the
        flag (rank 0 has requests, cancels or shutdown to send; an output block
        overflowed) does a pickled object exchange follow. The flags are gathered first,
        so every rank agrees on whether it happens. Without ``on_host`` the communicator
        may go through the device: then it runs while the device is idle (the last VERIFY
        was read back; no step is queued ahead).
        Rank 0 delivers the other ranks' block outputs here, or at ``hand_over`` with
        ``defer`` (a flagged exchange delivers at once)."""
        message, pending = NO_MESSAGE, self.pending
        self.pending = []
        # A request's outputs reach its consumer in order: what the last exchange held
        # goes first (when no VERIFY handed it over); rank 0's own wait on with ``defer``.
        if defer:
            self._hand_over_blocks()
        else:
            self.hand_over()
        self._deferring = defer
        if self.front is not None:
            if self.scheduler.num_requests == 0 and sum(self.loads) == 0:
                await self.front.wait_for_work(timeout=self.config.scheduler.idle_wait_s)
            message = self.front.take_message(
                lambda new: assign_least_loaded(new, self.loads))
        block = encode_rows(pending, self.scheduler.slots.num_slots, self.k) \
            if pending else self._empty_block()
        flag = message != NO_MESSAGE or block is None
        if block is None:
            block = self._empty_block()
        width = 2 + len(facts)
        # One int64 array as bytes, no torch op from the arrival stamp to the read: each
        # releases the GIL and waits to take it back from the compute thread, which under
        # ADP is queueing the step run ahead (comm/_shm.py). The stamp goes in last.
        row = array("q", (int(flag), *facts, 0)) + block
        row[width - 1] = arrived = time.time_ns() // 1000
        rows = await self.comm.all_gather_bytes(row.tobytes())
        # The flags, facts and stamps as Python ints.
        head = [memoryview(r)[:8 * width].cast("q").tolist() for r in rows]
        last = max(r[width - 1] for r in head)
        self.times.record(last - arrived, time.time_ns() // 1000 - last)
        self.gathered_rows = [r[1:width - 1] for r in head]
        if self.front is not None:
            self._held = [r[8 * width:] for r in rows[1:]]
        flagged = any(row[0] for row in head)
        if not defer or flagged:
            self.hand_over()
        if flagged:
            overflow = () if not pending or not head[self.comm.rank][0] else pending
            reports = await self.comm.all_gather_object(
                message if self.front is not None else
                RankReport(tuple(out for _, out in overflow)))
            if self.front is not None:
                for report in reports[1:]:
                    self.front.deliver(report.outputs)
            message = reports[0]
        return message

    def _empty_block(self) -> array[int]:
        """A block with no outputs (rank 0's every iteration; ~30 us to build)."""
        if self._empty is None:
            self._empty = encode_rows((), self.scheduler.slots.num_slots, self.k)
        assert self._empty is not None, "no outputs always fit"
        return self._empty
