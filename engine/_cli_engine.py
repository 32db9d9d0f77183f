"""The engine as the CLI's commands open it, with an optional trace of every rank."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import anyio

from ._engine import AsyncEngine
from ._components import build_communicator
from ._trace import TraceRecorder

if TYPE_CHECKING:
    from specloop.comm import Communicator

    from ._config import EngineConfig
    from ._states import IterationObserver

GATHER_TIMEOUT_S = 30.0


@contextlib.asynccontextmanager
async def open_engine(config: EngineConfig, *, trace: str | None = None,
                      observers: Sequence[IterationObserver] = ()
                      ) -> AsyncIterator[AsyncEngine]:
    """``async with open_engine(config, trace="t.json") as engine``. With a trace, the
    communicator is wrapped so collectives show; under torchrun rank 0 gathers every
    rank's events at the end and writes one file."""
    if trace is None:
        async with AsyncEngine(config, observers=observers) as engine:
            yield engine
        return
    recorder = TraceRecorder()
    comm = recorder.communicator(build_communicator(config))
    try:
        async with AsyncEngine(config, communicator=comm,
                               observers=(*observers, recorder)) as engine:
            yield engine
        await _write_trace(recorder, comm.inner, trace)
    finally:
        if comm.world_size == 1 and not recorder.written:
            recorder.write(trace)      # also after Ctrl-C or a failure: what there is
        await anyio.to_thread.run_sync(comm.close)


async def _write_trace(recorder: TraceRecorder, comm: Communicator, path: str) -> None:
    if comm.world_size == 1:
        recorder.write(path)
        return
    # Every rank reaches this only after a clean exit, so all of them enter the gather.
    comm = comm.bounded(GATHER_TIMEOUT_S)
    gathered = await comm.all_gather_object(recorder.events)
    if comm.rank == 0:
        recorder.write(path, [e for events in gathered for e in events])
