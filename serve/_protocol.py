"""OpenAI request bodies -> what the engine needs, with 400s that name the field."""

from __future__ import annotations

import math
from typing import Any, overload

import attrs

from specloop.samplers import SamplingParams, SamplingParamsError

# OpenAI fields we accept but that change nothing here (the client may send them).
IGNORED = {"user", "frequency_penalty", "presence_penalty", "logit_bias", "metadata",
           "store", "parallel_tool_calls", "service_tier", "echo", "best_of", "suffix"}


class ApiError(Exception):
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status, message, param, kind, code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param)


@attrs.frozen
class ParsedRequest:
    kind: str                          # "chat" or "completion"
    prompt: str | tuple[int, ...] | None
    messages: tuple[dict[str, str], ...] | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool


# A request body is parsed JSON: its values are whatever the client sent (Any), and each
# reader below checks the type of the one it takes.
Body = dict[str, Any]


def _number(body: Body, name: str, default: float, *, low: float | None = None,
            high: float | None = None, low_open: bool = False) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        raise bad(name, f"must be a number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise bad(name, f"must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise bad(name, f"must be <= {high}, got {value!r}")
    return value


@overload
def _integer(body: Body, name: str, default: int, *, low: int | None = None) -> int: ...
@overload
def _integer(body: Body, name: str, default: None, *, low: int | None = None
             ) -> int | None: ...
def _integer(body: Body, name: str, default: int | None, *, low: int | None = None
             ) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"must be an integer, got {value!r}")
    if low is not None and value < low:
        raise bad(name, f"must be >= {low}, got {value!r}")
    return value


def _bool(body: Body, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"must be true or false, got {value!r}")
    return value


def _stop(body: Body) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise bad("stop", "must be a non-empty string or a list of non-empty strings")
    return tuple(value)


def _token_ids(body: Body, name: str) -> tuple[int, ...]:
    value = body.get(name) or []
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise bad(name, "must be a list of token ids (integers >= 0)")
    return tuple(value)


def sampling_params(body: Body, default_max_tokens: int) -> SamplingParams:
    max_tokens = _integer(body, "max_completion_tokens", None, low=1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", default_max_tokens, low=1)
    top_k = _integer(body, "top_k", 0, low=-1)
    try:
        return SamplingParams(
            temperature=float(_number(body, "temperature", 1.0, low=0)),
            top_p=float(_number(body, "top_p", 1.0, low=0, high=1, low_open=True)),
            top_k=max(top_k, 0),                     # -1 means off, as in vLLM
            min_p=float(_number(body, "min_p", 0.0, low=0, high=1)),
            seed=_integer(body, "seed", None, low=0), max_tokens=max_tokens,
            stop=_stop(body), stop_token_ids=_token_ids(body, "stop_token_ids"),
            ignore_eos=_bool(body, "ignore_eos"))
    except SamplingParamsError as exc:
        field = str(exc).split("SamplingParams.", 1)[-1].split(" ", 1)[0]
        raise ApiError(400, str(exc), field) from None


def _messages(body: Body) -> tuple[dict[str, str], ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in (
                "system", "user", "assistant", "developer"):
            raise bad(f"messages[{i}].role", "must be system, user, assistant or developer")
        content = message.get("content")
        if isinstance(content, list):       # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise bad(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", "must be a string")
        role = "system" if message["role"] == "developer" else message["role"]
        out.append({"role": role, "content": content})
    return tuple(out)


def _prompt(body: Body) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return tuple(prompt)
    raise bad("prompt", "must be a non-empty string or a list of token ids (one prompt)")


def parse(body: Any, kind: str, *, model_name: str, default_max_tokens: int
          ) -> ParsedRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("model") not in (model_name, None):
        raise ApiError(400, f"model: {body.get('model')!r} is not served here; use "
                       f"{model_name!r} (see /v1/models)", "model", code="model_not_found")
    if _integer(body, "n", 1, low=1) != 1:
        raise bad("n", "only n = 1 is supported")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs"):
        raise bad("logprobs", "logprobs are not supported")
    if body.get("tools"):
        raise bad("tools", "tool calls are not supported")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options", "must be an object")
    return ParsedRequest(
        kind=kind, prompt=_prompt(body) if kind == "completion" else None,
        messages=_messages(body) if kind == "chat" else None,
        params=sampling_params(body, default_max_tokens), stream=_bool(body, "stream"),
        include_usage=_bool(options, "include_usage"),
        return_token_ids=_bool(body, "return_token_ids"))
