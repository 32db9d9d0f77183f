"""The request side shared by the engines: admission (every argument checked), request
ids, seeds, tokenizing, the streams ``generate`` and ``generate_batch`` hand out, and the
``async with`` lifecycle (one run per engine, the GC freeze while it runs).

``AsyncEngine`` serves them in its own process; ``ProcessEngine`` from an engine core in a
child process. Both put requests into a ``FrontDoor`` and read its channels; what differs
is who takes the front door's messages and delivers its outputs."""

from __future__ import annotations

import gc
import re
import secrets
import threading
from types import TracebackType
from typing import TYPE_CHECKING, Any, AsyncGenerator, Callable, Coroutine, Self, Sequence

import anyio
import anyio.abc

from specloop.samplers import SamplingParams, derive_seed

from ._errors import ConfigError, EngineClosedError, EngineStateError, RequestError
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
    ``_tokenizer``, ``_verify_drafts`` (the most draft rows a VERIFY adds to a request:
    the largest K, or a draft tree's nodes), ``_vocab_size``; and
    the ``async with`` lifecycle over ``_start()`` (build; -> the device type, whose
    ``parallel.freeze_gc = "auto"`` decides), ``_tasks()`` (run in the engine's task group
    until it leaves) and ``_release()`` (after the block, or a failed start)."""

    config: EngineConfig
    _failure: BaseException | None
    _next_id: int
    _admitted: int

    def _init_front_end(self) -> None:
        """The shared state; each engine calls it in ``__init__``."""
        self._failure = None    # set when the engine (or its core) failed
        self._next_id = 0       # the next automatic id's number
        self._admitted = 0      # the next request's handle
        self._state = "new"     # -> "running" in __aenter__ -> "closed" in __aexit__
        self._frozen = False    # holds the GC freeze (parallel.freeze_gc) while running
        self._task_group: anyio.abc.TaskGroup | None = None

    async def _start(self) -> str:
        raise NotImplementedError

    def _tasks(self) -> Sequence[Callable[[], Coroutine[Any, Any, None]]]:
        raise NotImplementedError

    async def _release(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        # One run per engine: its loop, streams and communicator end with the block.
        name = type(self).__name__
        if self._state != "new":
            raise EngineStateError(
                f"this {name} is already running; nesting `async with` on one engine "
                "is not supported" if self._state == "running" else
                f"this {name} has already run; an engine runs once, build a new one")
        self._state = "running"
        try:
            device_type = await self._start()
            freeze = self.config.parallel.freeze_gc
            if freeze == "on" or (freeze == "auto" and device_type == "cuda"):
                FROZEN.enter()
                self._frozen = True
        except BaseException:
            self._state = "closed"
            await self._release()
            raise
        task_group = self._task_group = anyio.create_task_group()
        await task_group.__aenter__()
        for task in self._tasks():
            task_group.start_soon(task)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> bool | None:
        task_group = self._task_group
        assert task_group is not None, "__aexit__ follows a successful __aenter__"
        self._close_front()
        try:
            return await task_group.__aexit__(exc_type, exc, tb)
        finally:
            self._state, self._task_group = "closed", None
            if self._frozen:
                self._frozen = False
                FROZEN.leave()
            await self._release()

    def _close_front(self) -> None:
        self._front_door.close()

    @property
    def _front_door(self) -> FrontDoor:
        raise NotImplementedError

    @property
    def _tokenizer(self) -> Tokenizer:
        raise NotImplementedError

    @property
    def _verify_drafts(self) -> int:
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
        channel = self._front_door.submit(new, text=self._text_stream(new))
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
                self._front_door.abandon(new.request_id, new.handle)

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
        front = self._front_door
        for new in news:
            # Detokenized as delivered; a stop string ends its request at the front door.
            front.submit(new, channel, self._text_stream(new))
        # Whose last output is not out yet, with its handle (``abandon``'s).
        live = {new.request_id: new.handle for new in news}
        try:
            while live and (outputs := await channel.take()):
                for output in outputs:
                    if output.error is not None:
                        raise EngineClosedError(output.error) from self._failure
                    if output.finished:
                        live.pop(output.request_id, None)
                yield outputs
        finally:
            for request_id, handle in live.items():
                front.abandon(request_id, handle)

    def cancel(self, request_id: str) -> None:
        """End a request (see docs/embedding.md); unknown or finished ids are ignored, so
        is every id once the engine closed (its streams have all ended)."""
        self._front_door.cancel(request_id)

    def _text_stream(self, new: NewRequest) -> TextStream | None:
        """The request's detokenizer and stop-string matcher, which the front door runs
        as it delivers; None with ``detokenize=False`` (token ids only, ``text`` "")."""
        params = new.params
        return TextStream(self._tokenizer, params.stop) if params.detokenize else None

    def set_max_running(self, max_running: int | None) -> None:
        """Cap each rank's running batch at ``max_running`` requests (None: the config's
        ``scheduler.max_batch_size`` again) from the next iteration on, on every rank of a
        group (it rides SCHEDULE's exchange). Requests beyond it wait in the queue; lowering
        it ends no running request, it stops admissions until the batch is below it. For a
        server that sheds load at run time, and a bench that runs every batch size on one
        engine (the graphs are the ones captured for ``max_batch_size``'s buckets)."""
        self._check_front()
        top = self.config.scheduler.max_batch_size
        if max_running is None:
            max_running = top
        if isinstance(max_running, bool) or not isinstance(max_running, int) or \
                not 1 <= max_running <= top:
            raise ConfigError("max_running", max_running,
                              f"must be an int from 1 to scheduler.max_batch_size ({top})",
                              "or None for max_batch_size")
        self._front_door.limit_running(max_running)

    def _admit(self, prompt: object, params: object, request_id: object) -> NewRequest:
        """The request as submitted, every argument checked (callers' types unchecked)."""
        self._check_front()
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        request_id = self._request_id(request_id)
        prompt_ids = self._encode(prompt)
        k = self._verify_drafts
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


class _GCFreeze:
    """``gc.freeze`` while an engine of the process runs (``parallel.freeze_gc``): the
    objects alive when one starts (torch, the model, the tokenizer: ~200k) leave the
    cyclic GC's reach. Serving allocates GC-tracked objects per request per iteration
    (outputs, futures, handles), so full collections come every few dozen iterations, and
    each walked all of them: ~40 ms on the CPU bench at batch 256, ~0.4 ms an iteration
    (bench_host_overhead --gpu-path). Frozen objects are still freed by reference
    counting; cycles among them wait until the last engine closes (``gc.unfreeze``, then
    a full collection)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines = 0

    def enter(self) -> None:
        with self._lock:
            self._engines += 1
            gc.freeze()     # O(1): the generations' lists moved, nothing walked

    def leave(self) -> None:
        with self._lock:
            self._engines -= 1
            if not self._engines:
                gc.unfreeze()
                # The closed engines' objects (in reference cycles: the worker and its
                # parts) and their memory (KV caches: GBs, on a GPU too) go now, not at
                # some later full collection: one frozen by the next engine to start
                # would stay (engines built one after another in one process ran out
                # of memory). ~40 ms, once an engine closes.
                gc.collect()


FROZEN = _GCFreeze()
