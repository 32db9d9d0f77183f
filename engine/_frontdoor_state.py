"""Rank 0's side of the front door: the inbox, pending cancels and the output streams."""

from __future__ import annotations

import math
from typing import Callable, Iterable

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ._frontdoor import FrontDoorMessage
from ._request import FinishReason, NewRequest, RequestOutput


class FrontDoor:
    def __init__(self) -> None:
        self._inbox: list[NewRequest] = []
        self._cancels: list[str] = []
        self._streams: dict[str, MemoryObjectSendStream[RequestOutput]] = {}
        self._handles: dict[int, str] = {}      # handle -> request id, while it streams
        self._wake = anyio.Event()
        self.closing = False

    @property
    def open_request_ids(self) -> set[str]:
        return set(self._streams)

    def submit(self, new: NewRequest) -> MemoryObjectReceiveStream[RequestOutput]:
        # Unbounded: the engine loop never waits on a slow consumer.
        send, receive = anyio.create_memory_object_stream[RequestOutput](math.inf)
        self._streams[new.request_id] = send
        self._handles[new.handle] = new.request_id
        self._inbox.append(new)
        self._wake.set()
        return receive

    def cancel(self, request_id: str) -> None:
        queued = next((n for n in self._inbox if n.request_id == request_id), None)
        if queued is not None:
            self._inbox.remove(queued)
            self._end(request_id, FinishReason.CANCELLED)
        elif request_id in self._streams:
            self._cancels.append(request_id)
            self._wake.set()

    def close(self) -> None:
        self.closing = True
        self._wake.set()

    async def wait_for_work(self, timeout: float | None) -> None:
        if self._inbox or self._cancels or self.closing:
            return
        with anyio.move_on_after(timeout):
            await self._wake.wait()
        self._wake = anyio.Event()

    def take_message(self, assign: Callable[[list[NewRequest]], tuple]) -> FrontDoorMessage:
        new, self._inbox = self._inbox, []
        cancels, self._cancels = tuple(self._cancels), []
        if self.closing:
            for request in new:
                self._end(request.request_id, FinishReason.CANCELLED)
            new = []
        return FrontDoorMessage(assign(new), cancels, self.closing)

    def deliver(self, outputs: Iterable[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue        # its consumer already left
            stream.send_nowait(output)
            if output.finished:
                self.forget(output.request_id)

    def request_id(self, handle: int) -> str | None:
        return self._handles.get(handle)

    def forget(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.close()
            self._handles = {h: r for h, r in self._handles.items() if r != request_id}

    def close_all(self, reason: FinishReason, error: str | None = None) -> None:
        for request_id in list(self._streams):
            self._end(request_id, reason, error)

    def _end(self, request_id: str, reason: FinishReason, error: str | None = None) -> None:
        """The final, empty output of a request the engine will not serve further."""
        self.deliver((RequestOutput(request_id, (), "", True, reason, error),))
