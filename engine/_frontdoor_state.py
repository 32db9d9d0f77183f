"""Rank 0's side of the front door: the inbox, pending cancels and the output streams.

A request is *live* from `submit` until the engine delivers its final output (or the front
door ends it itself); its id stays reserved that long, even after its consumer left, so a
reused id can never receive an earlier request's outputs or cancel (issue 10, defect 2).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Callable, Iterable, Sequence

import anyio
import anyio.lowlevel

from ._frontdoor import NO_MESSAGE, FrontDoorMessage
from ._request import FinishReason, NewRequest, RequestOutput
from ._stop import TextStream
from ._wire import decode_outputs


# Successive channels' first ``_wakes``: 0, 1, .. 15, 0, ...
_PHASES = itertools.count()


class OutputChannel:
    """One request's outputs, engine to consumer, unbounded (the engine never waits on a
    slow consumer). ``put`` wakes the consumer only when it waits; ``take`` returns all
    outputs sent since the last one. An anyio memory stream costs a checkpoint and an
    event per item on both sides, per request per iteration (issue 12)."""

    __slots__ = ("_items", "_waiter", "_closed", "_open", "_wakes", "_loop")

    def __init__(self, requests: int = 1) -> None:
        self._items: list[RequestOutput] = []
        self._waiter: asyncio.Future[None] | anyio.Event | None = None
        self._closed = False
        # Requests that still put here: one channel may carry a batch's requests
        # (``AsyncEngine.generate_batch``); it closes when the last of them closes it.
        self._open = requests
        # Takes that waited (see ``take``), from a phase of its own: the channels of
        # requests that start together would otherwise all run their cancellation check
        # at the same iteration (128 consumers: ~0.3 ms in one iteration of 16 on this
        # repository's CPU, where adaptive K's clock and a per-move bench saw a spike).
        self._wakes = next(_PHASES) & 15
        # The consumer's asyncio loop, from its first wait (None: not yet, or not asyncio).
        self._loop: asyncio.AbstractEventLoop | None = None

    def put(self, output: RequestOutput) -> None:
        self._items.append(output)
        if self._waiter is not None:    # _wake's test inline: called per request per iteration
            self._wake()

    def close(self) -> None:
        """One request puts no more (its last close ends the channel); what was put is
        still taken."""
        self._open -= 1
        if self._open <= 0:
            self._closed = True
            self._wake()

    async def take(self) -> list[RequestOutput]:
        """The outputs not yet taken, waiting for one; ``[]`` once closed and drained."""
        if self._items:
            await anyio.lowlevel.checkpoint_if_cancelled()  # a cancelled consumer stops
        else:
            loop = self._loop
            if loop is None:
                loop = self._loop = _running_loop()
            while not self._items:
                if self._closed:
                    return []
                if loop is not None:
                    # On asyncio a bare future: ``anyio.Event()`` looks the backend up each
                    # time (~5 us of the ~6 us a consumer's wake-up cost; a consumer per
                    # request waits once per iteration). Built directly: the loop's
                    # ``create_future`` is one Python call more, per request per iteration.
                    future: asyncio.Future[None] = _Future(loop=loop)
                    self._waiter = future
                    await future
                else:
                    event = self._waiter = anyio.Event()
                    await event.wait()
            # A cancelled consumer stops also when woken by an output, at its 16th wake
            # at the latest: anyio does not cancel a task whose future is done, and an
            # engine putting an output every iteration can find it done at every one of
            # anyio's attempts (64 consumers cancelled at once went on for ~27k
            # iterations). Not at every wake: the check costs ~1 us, per request per
            # iteration.
            self._wakes += 1
            if not self._wakes & 15:
                await anyio.lowlevel.checkpoint_if_cancelled()
        items, self._items = self._items, []     # handed over whole, not copied
        return items

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not isinstance(waiter, _Future):
                waiter.set()
            elif not waiter.done():     # done: its consumer was cancelled
                waiter.set_result(None)


_Future = asyncio.Future


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The running asyncio loop; None elsewhere (trio: anyio's events)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class FrontDoor:
    # Outputs reach it as RequestOutput objects only (FrontDoorPort.deliver_rows).
    deliver_rows = None

    def __init__(self) -> None:
        self._inbox: dict[str, NewRequest] = {}      # submitted, not yet handed to a rank
        self._cancels: list[str] = []                # live ids to cancel at their rank
        self._live: dict[str, int] = {}              # request id -> handle, until final
        self._ids: dict[int, str] = {}               # handle -> request id, until final
        # While its consumer is on: the request's channel and the text stream its outputs
        # go through (None: as the engine produced them). One entry, one look-up a delivery.
        self._streams: dict[str, tuple[OutputChannel, TextStream | None]] = {}
        self._wake = anyio.Event()
        self.closing = False
        # The running batch's cap the next SCHEDULE takes to every rank (None: no change).
        self._max_running: int | None = None

    @property
    def open_request_ids(self) -> set[str]:
        """Ids in use: requests the engine has not finished with, consumer or not."""
        return set(self._live)

    @property
    def has_news(self) -> bool:
        """Requests, cancels or a new cap the next SCHEDULE takes."""
        return bool(self._inbox or self._cancels) or self._max_running is not None

    @property
    def num_live(self) -> int:
        return len(self._live)

    def submit(self, new: NewRequest, channel: OutputChannel | None = None,
               text: TextStream | None = None) -> OutputChannel:
        """``channel``: a shared one (made for all its requests), else a new one.
        ``text``: the request's outputs reach the channel through it (text deltas, stop
        strings) as they are delivered; without it, as the engine produced them."""
        if new.request_id in self._live:
            raise ValueError(f"request_id {new.request_id!r} is live")  # the engine checks
        channel = channel or OutputChannel()
        self._streams[new.request_id] = (channel, text)
        self._live[new.request_id] = new.handle
        self._ids[new.handle] = new.request_id
        self._inbox[new.request_id] = new
        self._wake.set()
        return channel

    def cancel(self, request_id: str) -> None:
        """End a queued request now; ask its rank to end a running one. Unknown or
        finished ids are ignored."""
        if self._inbox.pop(request_id, None) is not None:
            self._end(request_id, FinishReason.CANCELLED)
        elif request_id in self._live and request_id not in self._cancels:
            self._cancels.append(request_id)
            self._wake.set()

    def limit_running(self, max_running: int) -> None:
        """Cap every rank's running batch at ``max_running`` requests from the next
        SCHEDULE on (checked by the caller, ``FrontEnd.set_max_running``); a later call
        before that SCHEDULE replaces it."""
        self._max_running = max_running
        self._wake.set()

    def abandon(self, request_id: str, handle: int | None = None) -> None:
        """The consumer left before the final output: drop its stream and cancel the
        request; the id stays reserved until the engine is done with it. Never raises.
        ``handle``: the request the consumer served (``NewRequest.handle``); if the id is
        no longer that request's (its final output was delivered, still untaken, when the
        consumer left, and a new request took the id since), nothing is done: the new
        request is not the consumer's to end."""
        if handle is not None and self._live.get(request_id) != handle:
            return
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream[0].close()
        self.cancel(request_id)

    def close(self) -> None:
        self.closing = True
        self._wake.set()

    async def wait_for_work(self, timeout: float | None) -> None:
        if self.has_news or self.closing:
            return
        with anyio.move_on_after(timeout):
            await self._wake.wait()
        self._wake = anyio.Event()

    def take_message(self, assign: Callable[[list[NewRequest]], tuple[tuple[int, NewRequest], ...]]
                     ) -> FrontDoorMessage:
        if not (self._inbox or self._cancels or self.closing or self._max_running is not None):
            return NO_MESSAGE    # most iterations: no news, one shared empty message
        new, self._inbox = list(self._inbox.values()), {}
        cancels, self._cancels = tuple(self._cancels), []
        cap, self._max_running = self._max_running, None
        if self.closing:
            for request in new:
                self._end(request.request_id, FinishReason.CANCELLED)
            new = []
        return FrontDoorMessage(assign(new), cancels, self.closing, cap)

    def deliver(self, outputs: Iterable[RequestOutput]) -> None:
        """Each output to its request's channel, through its ``TextStream`` when it has
        one: detokenizing here, as outputs arrive, costs one output object and one
        consumer step less per request per iteration than in the consumer (issue 12:
        rank 0 does this for every rank's requests). The outputs are the front door's
        from here on (``TextStream.fill`` sets their text in place). A stop string that
        ends the text ends the request here too (its consumer sees a finished output)."""
        streams, live = self._streams, self._live
        for output in outputs:
            request_id = output.request_id
            stream = streams.get(request_id)    # a stream's request is live
            if stream is not None:
                channel, text = stream
                shown = output if text is None else text.fill(output)
                channel.put(shown)
                if output.finished:
                    self._release(request_id)
                elif shown.finished:
                    self.abandon(request_id)    # a stop string: end it in the engine
            elif output.finished and request_id in live:
                self._release(request_id)       # else not ours (already ended here)

    def deliver_blocks(self, blocks: Sequence[bytes], k: int) -> None:
        """Other ranks' output blocks: decoded by handle, outputs whose consumer left
        dropped."""
        for flat in blocks:
            self.deliver(decode_outputs(memoryview(flat).cast("q").tolist(), k,
                                        self._ids.get))

    def close_all(self, reason: FinishReason, error: str | None = None) -> None:
        self._inbox.clear()
        for request_id in list(self._live):
            self._end(request_id, reason, error)

    def _end(self, request_id: str, reason: FinishReason, error: str | None = None) -> None:
        """The final, empty output of a request the engine will not serve further."""
        self.deliver((RequestOutput(request_id, (), "", True, reason, error),))

    def _release(self, request_id: str) -> None:
        handle = self._live.pop(request_id)
        self._ids.pop(handle, None)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream[0].close()
        # A cancel not yet sent must not reach a later request that reuses the id.
        if request_id in self._cancels:
            self._cancels.remove(request_id)
