"""The engine core of a ``ProcessEngine``: an ``AsyncEngine`` in a child process, serving
the parent's front door across a pipe.

Messages are tuples, their first item a kind. Parent -> core: ``("msg",
FrontDoorMessage)`` (requests, cancels, shutdown), ``("stats",)``. Core -> parent:
``("ready", {"k", "verify_drafts", "vocab_size"})`` or ``("failed", exception)`` once
built, ``("out", rows, events)`` once per RESCAN (rows: ``_wire.OutputRow``; events: the iteration
events since the last message, for the parent's observers, ahead of the outputs; None
without), ``("events", events)`` at SCHEDULE or idle (the rest of them),
``("close_all", reason index, error)``, ``("stats", EngineStats)``. A rank > 0 of a
group sends ``("ready", {...})`` or ``("failed", exception)``, then, where the parent has
observers, ``("events", events)`` at the end of each of its iterations. The core reads
the pipe only in SCHEDULE (or while idle), so a message costs the loop one ``poll`` an
iteration and nothing between.
"""

from __future__ import annotations

import os
import pickle
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import anyio

from ._frontdoor import NO_MESSAGE, FrontDoorMessage
from ._request import FinishReason, NewRequest, RequestOutput
from ._states import IterationState
from ._wire import REASON_INDEX, OutputRow, output_row

if TYPE_CHECKING:
    from ._config import EngineConfig
    from ._states import TransitionEvent
    from ._stats import EngineStats

class PipeFrontDoor:
    """``FrontDoorPort`` for the core: news comes from the parent's pipe, outputs go back
    on it. The parent assigned every request to rank 0 already. A closed pipe (the parent
    exited without shutting down) reads as a shutdown."""

    def __init__(self, conn: Connection, *, forward_events: bool = False) -> None:
        self._conn = conn
        self._news: list[FrontDoorMessage] = []
        self._gone = False          # the parent closed its end
        self.closing = False
        # Set once the engine is built: its counters.
        self.stats: Callable[[], EngineStats] | None = None
        # The iteration events since the last SCHEDULE, for the parent's observers (None:
        # it has none, nothing is kept).
        self._events: list[TransitionEvent] | None = [] if forward_events else None

    def on_transition(self, event: TransitionEvent) -> None:
        """IterationObserver: keeps the event for the parent's observers."""
        if self._events is not None:
            self._events.append(event)

    def _take_events(self) -> list[TransitionEvent] | None:
        """The events kept since the last message (None or [] when none)."""
        events = self._events
        if events:
            self._events = []
        return events

    def _flush_events(self) -> None:
        events = self._take_events()
        if events:
            self.send(("events", events))

    def send(self, message: tuple[Any, ...]) -> None:
        if self._gone:
            return
        try:
            self._conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
        except OSError:     # the parent is gone: what it would have read is moot
            self._gone = True

    def _receive(self) -> None:
        conn = self._conn
        while not self._gone and conn.poll():
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                self._gone = True
                self._news.append(FrontDoorMessage(shutdown=True))
                return
            if message[0] == "msg":
                self._news.append(message[1])
            elif message[0] == "stats":
                self.send(("stats", None if self.stats is None else self.stats()))

    @property
    def has_news(self) -> bool:
        self._receive()
        return bool(self._news)

    async def wait_for_work(self, timeout: float | None) -> None:
        self._flush_events()    # idle: the last iteration's, now rather than at the next
        with anyio.move_on_after(timeout):
            while not (self.has_news or self.closing or self._gone):
                await anyio.wait_readable(self._conn.fileno())

    def take_message(self, assign: Callable[[list[NewRequest]],
                                            tuple[tuple[int, NewRequest], ...]]
                     ) -> FrontDoorMessage:
        self._flush_events()    # the last iteration's, once per SCHEDULE
        self._receive()
        if not self._news:
            return NO_MESSAGE
        news, self._news = self._news, []
        # The parent put every request on rank 0; the group's loads are known here.
        requests = [request for m in news for _, request in m.assignments]
        caps = [m.max_running for m in news if m.max_running is not None]
        return FrontDoorMessage(assign(requests) if requests else (),
                                tuple(c for m in news for c in m.cancels),
                                any(m.shutdown for m in news), caps[-1] if caps else None)

    def deliver(self, outputs: Iterable[RequestOutput]) -> None:
        self.deliver_rows([output_row(o) for o in outputs])

    def deliver_rows(self, rows: list[OutputRow]) -> None:
        """``deliver`` of outputs RESCAN built as rows (``Outputs.deliver_rows``). The
        iteration's events so far (its VERIFY's among them) ride along, ahead of the
        outputs: an observer has seen a request's last VERIFY when its consumer sees its
        last output (per-request counts, as in process)."""
        self.send(("out", rows, self._take_events()))

    def deliver_blocks(self, blocks: Sequence[bytes], k: int) -> None:
        """Other ranks' output blocks, as bytes: the parent knows the handles' request
        ids and decodes them (a rank's outputs stay in order: one pipe, in sequence)."""
        self.send(("blocks", list(blocks)))

    def close(self) -> None:
        self.closing = True

    def close_all(self, reason: FinishReason, error: str | None = None) -> None:
        self._flush_events()
        self.send(("close_all", REASON_INDEX[reason], error))


class PipeEvents:
    """IterationObserver of a rank > 0 of a ``ProcessEngine`` group: its iteration events
    to the parent's observers, one message at each iteration's end (the transition into
    DONE). That is before SCHEDULE's exchange carries the iteration's outputs towards
    rank 0, so the parent, which reads a rank's pending events before delivering blocks
    from it, has seen a request's last VERIFY when its consumer sees its last output."""

    def __init__(self, send: Callable[[tuple[Any, ...]], None]) -> None:
        self._send = send
        self._events: list[TransitionEvent] = []

    def on_transition(self, event: TransitionEvent) -> None:
        self._events.append(event)
        if event.next_state is IterationState.DONE:
            events, self._events = self._events, []
            self._send(("events", events))


def serve_core(conn: Connection, config: EngineConfig, log_level: str | None,
               forward_events: bool = False, rank_env: dict[str, str] | None = None) -> None:
    """The child's entry point (spawned): build the engine, report ready (or why not),
    serve until the parent's shutdown, or until its pipe closes. ``forward_events``: send
    every iteration event to the parent (its observers). ``rank_env``: one rank of a
    group the parent spawned (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, as
    torchrun would set them); rank 0 serves the pipe as its front door, the others use
    theirs only to report ready and serve until rank 0 shuts the group down."""
    if rank_env:
        os.environ.update(rank_env)     # read by the communicator as the engine builds
    if log_level is not None:
        from .cli import configure_logging  # noqa: PLC0415 - the child's own logging

        configure_logging("console", log_level)
    rank = int((rank_env or {}).get("RANK", "0"))
    try:
        anyio.run(_serve, conn, config, forward_events, rank)
    finally:
        conn.close()


async def _serve(conn: Connection, config: EngineConfig, forward_events: bool,
                 rank: int) -> None:
    from ._engine import AsyncEngine  # noqa: PLC0415 - torch, in the child only

    # Rank 0's front door; on the other ranks only its ``send`` (ready, failed) is used,
    # and their events go through a ``PipeEvents``.
    front = PipeFrontDoor(conn, forward_events=forward_events and rank == 0)
    observer: PipeFrontDoor | PipeEvents = front if rank == 0 else PipeEvents(front.send)
    ready = False
    try:
        async with AsyncEngine(config, front_door=front,
                               observers=[observer] if forward_events else ()) as engine:
            worker = engine.worker
            assert worker is not None, "built in `async with`"
            front.stats = lambda: worker.stats
            front.send(("ready", {"k": worker.k, "verify_drafts": worker.verify_drafts,
                                  "vocab_size": worker.runner.args.vocab_size}))
            ready = True
            await engine.wait_closed()
    except BaseException as exc:
        if not ready:
            front.send(("failed", _picklable(exc)))
            return
        raise


def _picklable(exc: BaseException) -> BaseException:
    """The exception itself when it crosses the pipe, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:   # noqa: BLE001 - any pickling failure: send its text instead
        return RuntimeError(f"{type(exc).__name__}: {exc}")
