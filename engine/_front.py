"""The request side shared by the engines: admission (every argument checked), request
ids, seeds, tokenizing, and the streams ``generate`` and ``generate_batch`` hand out.

``AsyncEngine`` serves them in its own process; ``ProcessEngine`` from an engine core in a
child process. Both put requests into a ``FrontDoor`` and read its channels; what differs
is who takes the front door's messages and delivers its outputs."""

from __future__ import annotations

import re
import secrets
from typing import TYPE_CHECKING, AsyncGenerator, Sequence

from specloop.samplers import SamplingParams, derive_seed

from ._errors import EngineClosedError, RequestError
from ._frontdoor_state import FrontDoor, OutputChannel
from ._request import NewRequest, RequestOutput
from ._stop import TextStream

if TYPE_CHECKING:
    from specloop.models import Tokenizer

    from ._config import EngineConfig

# Automatic request ids are "req-N"; callers may not use that form, so the two never meet.
_AUTO_ID = re.compile(r"req-[0-9]+")


class FrontEnd:
    """``generate``, ``generate_batch`` and ``cancel`` over the engine's hooks:
    ``_front_door``, ``_check_front()`` (raises EngineClosedError when not serving),
    ``_tokenizer``, ``_draft_k`` (the largest K an iteration drafts), ``_vocab_size``."""

    config: EngineConfig
    _failure: BaseException | None
    _next_id: int
    _admitted: int

    @property
    def _front_door(self) -> FrontDoor:
        raise NotImplementedError

    @property
    def _tokenizer(self) -> Tokenizer:
        raise NotImplementedError

    @property
    def _draft_k(self) -> int:
        raise NotImplementedError

    @property
    def _vocab_size(self) -> int:
        raise NotImplementedError

    def _check_front(self) -> None:
        raise NotImplementedError

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       *, request_id: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        new = self._admit(prompt, params, request_id)
        # The front door detokenizes as it delivers (and ends the request at a stop
        # string): what the channel holds is what the caller gets.
        channel = self._front_door.submit(new, text=TextStream(self._tokenizer,
                                                               new.params.stop))
        finished = False        # the last output was (the engine's, or a stop string's)
        try:
            # One wake-up per iteration at most: all outputs sent meanwhile come at once.
            while outputs := await channel.take():
                for output in outputs:
                    if output.error is not None:
                        raise EngineClosedError(output.error) from self._failure
                    finished = output.finished
                    yield output
                    if finished:
                        return
        finally:
            if not finished:
                # The consumer left early (break, cancel scope, error): cancel the request
                # and free its slot; its id stays in use until the engine is done with it.
                self._front_door.abandon(new.request_id)

    async def generate_batch(self, prompts: Sequence[str | list[int]],
                             params: SamplingParams | Sequence[SamplingParams] | None = None
                             ) -> AsyncGenerator[list[RequestOutput], None]:
        """Several requests as one stream: each item is every output the engine produced
        for them since the last item, at most one item per iteration (``generate``'s
        outputs, same fields, automatic ids in prompt order). One consumer for the whole
        batch: no task wake-up per request per iteration (a batch job's path). Every
        prompt is checked before any is submitted; leaving early cancels the requests
        not finished yet."""
        # Each item is checked in _admit (as generate's params are).
        many: Sequence[object] = params if isinstance(params, (list, tuple)) \
            else [params] * len(prompts)
        if len(many) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(many)} params")
        news = [self._admit(prompt, p, None) for prompt, p in zip(prompts, many)]
        if not news:
            return
        channel = OutputChannel(len(news))
        front, tokenizer = self._front_door, self._tokenizer
        for new in news:
            # Detokenized as delivered; a stop string ends its request at the front door.
            front.submit(new, channel, TextStream(tokenizer, new.params.stop))
        live = {new.request_id for new in news}     # whose last output is not out yet
        try:
            while live and (outputs := await channel.take()):
                for output in outputs:
                    if output.error is not None:
                        raise EngineClosedError(output.error) from self._failure
                    if output.finished:
                        live.discard(output.request_id)
                yield outputs
        finally:
            for request_id in live:
                front.abandon(request_id)

    def cancel(self, request_id: str) -> None:
        """End a request (see docs/embedding.md); unknown or finished ids are ignored, so
        is every id once the engine closed (its streams have all ended)."""
        self._front_door.cancel(request_id)

    def _admit(self, prompt: object, params: object, request_id: object) -> NewRequest:
        """The request as submitted, every argument checked (callers' types unchecked)."""
        self._check_front()
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        request_id = self._request_id(request_id)
        prompt_ids = self._encode(prompt)
        k = self._draft_k
        room = self.config.model.max_seq_len - k - 1
        if len(prompt_ids) > room:
            raise RequestError(
                f"prompt has {len(prompt_ids)} tokens; max_seq_len = "
                f"{self.config.model.max_seq_len} with {k} draft tokens allows "
                f"at most {room}")
        handle, self._admitted = self._admitted, self._admitted + 1
        return NewRequest(request_id, tuple(prompt_ids), params,
                          self._seed_for(params, handle), handle=handle)

    def _request_id(self, request_id: object) -> str:
        """Caller ids are reusable once their request fully finished; automatic ids are
        never reused and have a form caller ids may not take."""
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
            return request_id
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(f"request_id must be a non-empty str, got {request_id!r}")
        if _AUTO_ID.fullmatch(request_id):
            raise RequestError(f"request_id {request_id!r} has the form of the engine's "
                               "automatic ids ('req-N'); choose another or pass None")
        if request_id in self._front_door.open_request_ids:
            raise RequestError(f"request_id {request_id!r} is already in use (its request "
                               "has not finished; an id is reusable once it has)")
        return request_id

    def _seed_for(self, params: SamplingParams, index: int) -> int:
        """The request's own seed, else one derived at admission (DESIGN: Randomness)."""
        if params.seed is not None:
            return params.seed
        base = self.config.scheduler.seed
        return secrets.randbits(62) if base is None else derive_seed(base, index)

    def _encode(self, prompt: object) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty")
            tokenizer = self._tokenizer
            try:
                if self.config.model.chat_template and tokenizer.chat_template:
                    return tokenizer.encode_chat([{"role": "user", "content": prompt}])
                return tokenizer.encode(prompt)
            except (ValueError, TypeError) as exc:
                raise RequestError(f"prompt cannot be tokenized: {exc}") from exc
        if not isinstance(prompt, (list, tuple)):
            raise RequestError(f"prompt must be a str or a list of token ids, "
                               f"got {type(prompt).__name__}")
        if not prompt:
            raise RequestError("prompt is empty")
        vocab = self._vocab_size
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids must be ints in [0, {vocab}); "
                               f"got {bad[:5]}")
        return list(prompt)
