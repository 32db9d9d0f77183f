"""Running the server: the engine, uvicorn in the same event loop, graceful shutdown.

SIGINT/SIGTERM: stop accepting, let open streams finish for ``shutdown_timeout_s``,
cancel the rest, close the engine, exit 0. If the engine dies, /health turns 503 and
requests get 503 until the process is stopped (a supervisor restarts it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import anyio
import attrs
import structlog
import uvicorn

from specloop.engine._cli_common import leaf_error
from specloop.engine import ProcessEngine
from specloop.engine._cli_engine import open_engine

from ._app import ServerState, build_app
from ._metrics import ServeMetrics
from ._spec import SpecTracker

if TYPE_CHECKING:
    from specloop.engine import EngineConfig

log = structlog.get_logger(__name__)


@attrs.frozen
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = 1 << 20
    cors_origins: tuple[str, ...] = ()
    trace: str | None = None
    shutdown_timeout_s: float = 10.0
    core_process: bool = False      # the engine core in a child process (ProcessEngine)


class _Server(uvicorn.Server):
    """uvicorn's server, but a handled SIGINT/SIGTERM is not re-raised afterwards (uvicorn
    re-raises it, which would turn a clean shutdown into exit 130)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        saved = {sig: signal.signal(sig, self.handle_exit)
                 for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)


# uvicorn's default backlog, which its server passes to listen() too.
BACKLOG = 2048


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


async def serve(config: EngineConfig, options: ServeOptions,
                sock: socket.socket | None = None) -> None:
    """Serve until SIGINT/SIGTERM. Ranks > 0 of a torchrun group run their engine until
    rank 0 shuts the group down."""
    k = config.speculative.k
    metrics, spec = ServeMetrics(num_draft_tokens=k), SpecTracker(k)
    state = ServerState(engine=None, metrics=metrics, spec=spec,
                        model_name=options.served_model_name or config.model.name,
                        api_key=options.api_key, max_body_bytes=options.max_body_bytes)
    ready, stop = anyio.Event(), anyio.Event()

    async def run_engine() -> None:
        # Its own task: an engine that dies cancels only this, and the server stays up
        # to answer /health with 503.
        try:
            async with (ProcessEngine(config, observers=(metrics, spec))
                        if options.core_process else
                        open_engine(config, trace=options.trace,
                                    observers=(metrics, spec))) as engine:
                state.engine = engine
                ready.set()
                if engine.front is None:
                    with _ignore_signals():     # rank 0 decides when the group stops
                        await engine.wait_closed()
                    stop.set()
                    return
                metrics.slots_free.set_function(lambda: engine.num_free_slots)
                await stop.wait()
        except Exception as exc:
            if not ready.is_set():
                raise                           # it never started: the command fails
            leaf = leaf_error(exc)
            state.failure = f"{type(leaf).__name__}: {leaf}"
            log.error("engine_failed_while_serving", error=state.failure)

    interrupted = False
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_engine)
        if not await _ready_unless_signalled(ready):
            interrupted = True          # Ctrl-C while the model loads
            tg.cancel_scope.cancel()
        elif state.built_engine.front is not None:
            try:
                await _serve_http(state, options, sock)
            finally:
                stop.set()
    if interrupted:
        raise KeyboardInterrupt


async def _ready_unless_signalled(ready: anyio.Event) -> bool:
    """True once the engine is ready, False on SIGINT/SIGTERM before that (uvicorn only
    handles signals once it serves)."""
    if threading.current_thread() is not threading.main_thread():
        await ready.wait()
        return True
    outcome: list[bool] = []
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:
            async def on_signal() -> None:
                async for _ in signals:
                    outcome.append(False)
                    tg.cancel_scope.cancel()

            async def on_ready() -> None:
                await ready.wait()
                outcome.append(True)
                tg.cancel_scope.cancel()

            tg.start_soon(on_signal)
            tg.start_soon(on_ready)
    return outcome[0]


async def _serve_http(state: ServerState, options: ServeOptions, sock: socket.socket | None
                      ) -> None:
    sock = sock or bind(options.host, options.port)
    server = _Server(uvicorn.Config(
        build_app(state, cors_origins=options.cors_origins), log_level="warning",
        lifespan="off",
        # uvicorn passes it to asyncio.wait_for, which takes a float; its annotation says int.
        timeout_graceful_shutdown=options.shutdown_timeout_s,  # type: ignore[arg-type]
        access_log=False))
    # Listening before the address is announced: a client that connects on reading it
    # (a supervisor, a test) is queued, where before uvicorn's own listen() it was refused
    # (seen once in test_two_ranks_serve). uvicorn's listen() on it again only sets the
    # backlog.
    sock.listen(BACKLOG)
    host, port = sock.getsockname()[:2]
    print(f"specloop serve: {state.model_name} on http://{host}:{port} "
          f"(pid {os.getpid()}; Ctrl-C to stop)", flush=True)
    await server.serve(sockets=[sock])
    print("specloop serve: stopped", flush=True)


@contextlib.contextmanager
def _ignore_signals() -> Iterator[None]:
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
