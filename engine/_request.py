"""Requests as the engine tracks them, and the outputs it streams back."""

from __future__ import annotations

import enum

import attrs

from specloop.samplers import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"            # an end-of-sequence or stop token
    LENGTH = "length"        # max_tokens, or the model's max_seq_len
    CANCELLED = "cancelled"  # cancel(), or the engine shut down first
    ERROR = "error"          # the engine failed while serving it


@attrs.frozen(init=False)
class RequestOutput:
    """One streamed delta of a request."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None

    def __init__(self, request_id: str, token_ids: tuple[int, ...], text: str,
                 finished: bool = False, finish_reason: FinishReason | None = None,
                 error: str | None = None) -> None:
        # attrs' frozen __init__, through the slots' own setters: RESCAN builds one per
        # request per iteration, and attrs' (object.__setattr__ through a bound
        # method-wrapper per field) costs ~30 % more.
        _set_request_id(self, request_id)
        _set_token_ids(self, token_ids)
        _set_text(self, text)
        _set_finished(self, finished)
        _set_finish_reason(self, finish_reason)
        _set_error(self, error)


# The slots' setters (set once by __init__ and by the front door's text fill; the class
# stays frozen to everyone else).
(_set_request_id, _set_token_ids, _set_text, _set_finished, _set_finish_reason,
 _set_error) = (RequestOutput.__dict__[f.name].__set__ for f in attrs.fields(RequestOutput))


@attrs.frozen
class NewRequest:
    """What the front door hands to the rank that will serve a request (picklable)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    handle: int = 0     # rank 0's integer name for it in the SCHEDULE output blocks


@attrs.define(eq=False)
class Request:
    """A request being served on this rank. ``token_ids`` = prompt + generated tokens."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    token_ids: list[int]
    slot: int | None = None
    # Tokens whose K/V the target cache holds; after prefill it is always len(token_ids)-1.
    num_cached: int = 0
    finish_reason: FinishReason | None = None
    handle: int = 0
    # RESCAN's stop rules in the form its per-row check reads (``Outputs.rules``): the
    # length at which a limit ends the request, and the tokens that end it (stop ids, EOS
    # unless ignored). Derived from the params on the request's first commit.
    stop_length: int = 0
    stop_tokens: frozenset[int] | None = None
    # ``params.is_greedy``, kept as a plain attribute: the worker asks it of every row of a
    # batch at each batch change (``is_greedy`` is a property: a Python call a row; a
    # server's load at batch 128 changes the batch nearly every iteration).
    greedy: bool = attrs.field(init=False)

    @greedy.default
    def _greedy(self) -> bool:
        return self.params.is_greedy

    @classmethod
    def from_new(cls, new: NewRequest) -> Request:
        return cls(new.request_id, new.prompt_ids, new.params, new.seed, list(new.prompt_ids),
                   handle=new.handle)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def batch_slot(self) -> int:
        """``slot`` of a request in the batch: set from admission (``Scheduler.admit``)
        until it finishes."""
        assert self.slot is not None, f"request {self.request_id!r} is not in the batch"
        return self.slot
