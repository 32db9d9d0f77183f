"""The ASGI app: OpenAI-compatible completions and chat completions on an AsyncEngine,
plus /v1/models, /health and /metrics."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import attrs
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specloop.engine import EngineClosedError

from ._metrics import ServeMetrics
from ._protocol import ApiError, ParsedRequest, parse
from ._run import RequestRun, finish_reason
from ._spec import SpecTracker

if TYPE_CHECKING:
    from specloop.engine import AsyncEngine, EngineStats, ProcessEngine


class _Tokenizer(Protocol):
    """What the handlers use of the engine's tokenizer (serve does not import models)."""

    chat_template: str | None

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]: ...


@attrs.define
class ServerState:
    """What the handlers share: the engine (rank 0's), options and the observers."""

    engine: AsyncEngine | ProcessEngine | None   # set once built; HTTP is served after that
    model_name: str
    metrics: ServeMetrics
    spec: SpecTracker
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    failure: str | None = None       # set once the engine has died
    created: int = attrs.Factory(lambda: int(time.time()))

    @property
    def built_engine(self) -> AsyncEngine | ProcessEngine:
        assert self.engine is not None, "serve() builds the engine before serving HTTP"
        return self.engine


def build_app(state: ServerState, *, cors_origins: tuple[str, ...] = ()) -> Starlette:
    routes = [
        Route("/health", partial(_health, state), methods=["GET"]),
        Route("/metrics", partial(_metrics, state), methods=["GET"]),
        Route("/v1/models", partial(_guard, state, _models, None), methods=["GET"]),
        Route("/v1/completions", partial(_guard, state, _completion, "completion"),
              methods=["POST"]),
        Route("/v1/chat/completions", partial(_guard, state, _completion, "chat"),
              methods=["POST"]),
    ]
    middleware = [Middleware(CORSMiddleware, allow_origins=list(cors_origins),
                             allow_methods=["*"], allow_headers=["*"])] if cors_origins else []
    return Starlette(routes=routes, middleware=middleware)


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _health(state: ServerState, request: Request) -> Response:
    if state.failure is not None:
        return JSONResponse({"status": "failed", "error": state.failure}, status_code=503)
    return JSONResponse({"status": "ok"})


async def _metrics(state: ServerState, request: Request) -> Response:
    stats = await _engine_stats(state.engine)
    if stats is not None:
        state.metrics.from_stats(stats)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


async def _engine_stats(engine: AsyncEngine | ProcessEngine | None) -> EngineStats | None:
    """The engine's counters (a ``ProcessEngine``'s fetched from its core), or None where
    there is no engine, or its core has gone (the scrape still answers)."""
    if engine is None:
        return None
    try:
        return await engine.fetch_stats()
    except EngineClosedError:
        return None


Handler = Callable[["ServerState", Request, Any], Awaitable[Response]]


async def _guard(state: ServerState, handler: Handler, kind: str | None, request: Request
                 ) -> Response:
    """API key, engine health and ApiError -> an OpenAI-style error response."""
    try:
        if state.api_key is not None:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
                raise ApiError(401, "invalid or missing API key (Authorization: Bearer ...)",
                               kind="authentication_error", code="invalid_api_key")
        if state.failure is not None:
            raise ApiError(503, f"the engine has failed: {state.failure}", kind="server_error")
        return await handler(state, request, kind)
    except ApiError as exc:
        return error_response(exc)


async def _models(state: ServerState, request: Request, kind: None) -> Response:
    return JSONResponse({"object": "list", "data": [
        {"id": state.model_name, "object": "model", "created": state.created,
         "owned_by": "specloop", "max_model_len": state.built_engine.config.model.max_seq_len}]})


async def _read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(400, f"body: the request body exceeds {limit} bytes", "body")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(400, f"body: the request body exceeds {limit} bytes", "body")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"body: not valid JSON ({exc})", "body") from None


def _prompt_ids(state: ServerState, parsed: ParsedRequest) -> list[int]:
    tokenizer: _Tokenizer | None = state.built_engine.tokenizer
    assert tokenizer is not None, "a built engine has its tokenizer"
    if parsed.kind == "chat":
        if not tokenizer.chat_template:
            raise ApiError(400, "messages: this model has no chat template; use "
                           "/v1/completions", "messages")
        assert parsed.messages is not None      # parse() sets them for chat
        return tokenizer.encode_chat(list(parsed.messages))
    if isinstance(parsed.prompt, str):
        try:
            return tokenizer.encode(parsed.prompt)
        except (TypeError, ValueError) as exc:
            raise ApiError(400, f"prompt: cannot be tokenized ({exc})", "prompt") from None
    assert parsed.prompt is not None            # parse() sets it for completions
    return list(parsed.prompt)


async def _completion(state: ServerState, request: Request, kind: str) -> Response:
    body = await _read_json(request, state.max_body_bytes)
    parsed = parse(body, kind, model_name=state.model_name,
                   default_max_tokens=state.built_engine.config.model.max_seq_len)
    run = RequestRun(state, parsed, _prompt_ids(state, parsed))
    if not await run.start(request):
        return Response(status_code=499)            # the client left; nobody reads this
    if parsed.stream:
        return StreamingResponse(_sse(run, kind), media_type="text/event-stream")
    if not await run.collect(request):
        return Response(status_code=499)
    return JSONResponse(_full_response(run, kind))


def _choice(run: RequestRun, kind: str, text: str, token_ids: Sequence[int], reason: str | None,
            *, delta: bool) -> dict[str, Any]:
    if kind == "chat":
        key = "delta" if delta else "message"
        content: dict[str, Any] = {"content": text} if delta else {"role": "assistant",
                                                                    "content": text}
        choice = {"index": 0, key: content, "logprobs": None, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    if run.parsed.return_token_ids:
        choice["token_ids"] = list(token_ids)
    return choice


def _envelope(run: RequestRun, kind: str, chunk: bool) -> dict[str, Any]:
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if kind == "chat" \
        else "text_completion"
    return {"id": run.response_id, "object": obj, "created": run.created,
            "model": run.state.model_name}


def _full_response(run: RequestRun, kind: str) -> dict[str, Any]:
    choice = _choice(run, kind, run.text, run.token_ids, finish_reason(run.reason), delta=False)
    return {**_envelope(run, kind, False), "choices": [choice], "usage": run.usage()}


async def _sse(run: RequestRun, kind: str) -> AsyncGenerator[str, None]:
    def event(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    try:
        if kind == "chat":           # the role first, as OpenAI streams it
            head = {**_envelope(run, kind, True), "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""},
                 "logprobs": None, "finish_reason": None}]}
            yield event(head)
        async for out in run.stream():
            reason = finish_reason(out.finish_reason) if out.finished else None
            if out.text or out.token_ids or reason:
                choice = _choice(run, kind, out.text, out.token_ids, reason, delta=True)
                yield event({**_envelope(run, kind, True), "choices": [choice]})
        if run.error is not None:
            yield event(ApiError(500, run.error, kind="server_error").body())
        elif run.parsed.include_usage:
            yield event({**_envelope(run, kind, True), "choices": [], "usage": run.usage()})
        yield "data: [DONE]\n\n"
    finally:
        await run.close()
