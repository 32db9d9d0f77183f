"""One request's run through the engine, as a handler sees it: admission (so a bad prompt
is a 400, not a broken stream), outputs, metrics, and the end, whichever way it comes."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, overload

import anyio

from specloop.engine import EngineClosedError, FinishReason, RequestError, RequestOutput

from ._protocol import ApiError, ParsedRequest

if TYPE_CHECKING:
    from starlette.requests import Request

    from ._app import ServerState
    from ._spec import RequestSpec

FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                  FinishReason.CANCELLED: "abort", FinishReason.ERROR: "error"}


@overload
def finish_reason(reason: FinishReason) -> str: ...
@overload
def finish_reason(reason: None) -> None: ...
def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else FINISH_REASONS[reason]


async def until_disconnect(request: Request, work: Callable[[], Awaitable[Any]]
                           ) -> tuple[bool, Any]:
    """``(True, await work())``, or ``(False, None)`` once the client has gone (then
    ``work`` is cancelled, which cancels its engine request)."""
    result: list[Any] = []
    errors: list[Exception] = []
    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        async def run() -> None:
            try:
                result.append(await work())
            except Exception as exc:  # noqa: BLE001 - re-raised below, not in a group
                errors.append(exc)
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        tg.start_soon(run)
    if errors:
        raise errors[0]
    return bool(result), (result[0] if result else None)


class RequestRun:
    def __init__(self, state: ServerState, parsed: ParsedRequest, prompt_ids: list[int]
                 ) -> None:
        self.state, self.parsed, self.prompt_ids = state, parsed, prompt_ids
        prefix = "chatcmpl" if parsed.kind == "chat" else "cmpl"
        self.response_id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text, self.token_ids = "", list[int]()
        self.reason: FinishReason | None = None
        self.error: str | None = None
        self._arrival = self._last = time.perf_counter()
        # Set by start(), which every other method follows.
        self._outputs: AsyncGenerator[RequestOutput, None] | None = None
        self._first: RequestOutput | None = None
        self._spec: RequestSpec | None = None
        self._closed = False

    # lifecycle --------------------------------------------------------------------------
    async def start(self, request: Request) -> bool:
        """Admit the request and wait for its first output; False if the client left."""
        self._spec = self.state.spec.track(self.response_id)
        self._outputs = self.state.built_engine.generate(self.prompt_ids, self.parsed.params,
                                                   request_id=self.response_id)
        try:
            present, first = await until_disconnect(request, self._outputs.__anext__)
        except RequestError as exc:
            await self._discard()
            field = "messages" if self.parsed.kind == "chat" else "prompt"
            raise ApiError(400, f"{field}: {exc}", field) from None
        except EngineClosedError as exc:
            await self._discard()
            raise ApiError(503, f"the engine is not serving: {exc}",
                           kind="server_error") from None
        self.state.metrics.request_started(len(self.prompt_ids))
        if not present:
            await self.close()
            return False
        self._first = first
        self._consume(first)
        return True

    async def stream(self) -> AsyncGenerator[RequestOutput, None]:
        """The outputs, the first one included; an engine failure ends it with ``error``."""
        assert self._first is not None and self._outputs is not None, "start() first"
        yield self._first
        if self._first.finished:
            return
        try:
            async for out in self._outputs:
                self._consume(out)
                yield out
        except EngineClosedError as exc:
            self.error = str(exc)

    async def collect(self, request: Request) -> bool:
        async def drain() -> None:
            async for _ in self.stream():
                pass
        try:
            present, _ = await until_disconnect(request, drain)
        finally:
            await self.close()
        if self.error is not None:
            raise ApiError(500, self.error, kind="server_error")
        return present

    async def close(self) -> None:
        """Once, however the request ended: the engine request is cancelled if it still
        runs, and the metrics see its end."""
        if self._closed:
            return
        self._closed = True
        assert self._outputs is not None, "start() first"
        with anyio.CancelScope(shield=True):
            await self._outputs.aclose()
        self.state.spec.forget(self.response_id)
        reason = finish_reason(self.reason) if self.reason is not None else "abort"
        self.state.metrics.request_finished(reason, time.perf_counter() - self._arrival)

    async def _discard(self) -> None:
        self._closed = True
        self.state.spec.forget(self.response_id)
        assert self._outputs is not None, "start() first"
        with anyio.CancelScope(shield=True):
            await self._outputs.aclose()

    # outputs ----------------------------------------------------------------------------
    def _consume(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        self.state.metrics.request_tokens(len(out.token_ids), now - self._last,
                                          first=not self.token_ids)
        if out.token_ids:
            self._last = now
        self.text += out.text
        self.token_ids.extend(out.token_ids)
        if out.finished:
            self.reason = out.finish_reason

    def usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": len(self.prompt_ids),
                                 "completion_tokens": len(self.token_ids),
                                 "total_tokens": len(self.prompt_ids) + len(self.token_ids)}
        if self._spec is not None and self._spec.num_drafts:
            usage["spec_decode"] = self._spec.usage()
        return usage
