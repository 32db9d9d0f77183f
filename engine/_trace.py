"""A timeline of every iteration state and collective on every rank, as Chrome trace-event
JSON (Perfetto and chrome://tracing open it). An observer plus a communicator wrapper: the
engine itself knows nothing of it.

Each rank is a process track with two threads: "iteration" (one slice per state) and
"collectives" (one slice per collective, so a rank that waits for a slow one shows).
Times come from ``time.perf_counter`` (CLOCK_MONOTONIC on Linux, shared by the processes
of one host), so ranks of a torchrun group line up.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from specloop.comm import Communicator, ForwardingCommunicator

from ._states import TransitionEvent

T = TypeVar("T")
ITERATION_TID, COLLECTIVES_TID = 0, 1


def _now_us() -> float:
    return time.perf_counter_ns() / 1e3


class TraceRecorder:
    """An iteration observer; ``communicator(comm)`` wraps a rank's collectives too.

    ``max_events`` bounds memory for a long-running server: later events are dropped and
    the trace says so in its metadata.
    """

    def __init__(self, *, max_events: int = 2_000_000) -> None:
        self.events: list[dict[str, Any]] = []
        self.max_events = max_events
        self.dropped = 0
        self.written = False

    def on_transition(self, event: TransitionEvent) -> None:
        start = event.started_at * 1e6
        # duration_us is rounded to 0.1 us: round down so slices never overlap.
        end = start + max(event.duration_us - 0.05, 0.0)
        args: dict[str, Any] = {"iteration": event.iteration, "batch_size": event.batch_size,
                "k": event.num_draft_tokens, "sampling_path": event.sampling_path,
                "next_state": event.next_state.value}
        if event.accepted is not None:
            args["accepted"] = list(event.accepted)
        self._add({"name": event.state.value, "cat": "state", "ph": "X", "ts": start,
                   "dur": end - start, "pid": event.rank, "tid": ITERATION_TID,
                   "args": args})

    def collective(self, rank: int, op: str, group: str, start: float, end: float,
                   shape: Sequence[int] | None) -> None:
        args: dict[str, Any] = {"group": group}
        if shape is not None:
            args["shape"] = list(shape)
        self._add({"name": op, "cat": "collective", "ph": "X", "ts": start,
                   "dur": end - start, "pid": rank, "tid": COLLECTIVES_TID, "args": args})

    def communicator(self, inner: Communicator) -> TracedCommunicator:
        return TracedCommunicator(inner, self)

    def _add(self, event: dict[str, Any]) -> None:
        if len(self.events) < self.max_events:
            self.events.append(event)
        else:
            self.dropped += 1

    def trace(self, events: Sequence[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The trace-event document: times relative to the first event, track names."""
        events = list(self.events if events is None else events)
        origin = min((e["ts"] for e in events), default=0.0)
        out = [{**e, "ts": round(e["ts"] - origin, 3), "dur": round(e["dur"], 3)}
               for e in sorted(events, key=lambda e: (e["pid"], e["tid"], e["ts"]))]
        for rank in sorted({e["pid"] for e in events}):
            out.append({"name": "process_name", "ph": "M", "pid": rank,
                        "args": {"name": f"rank {rank}"}})
            for tid, name in ((ITERATION_TID, "iteration"), (COLLECTIVES_TID, "collectives")):
                out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                            "args": {"name": name}})
        return {"traceEvents": out, "displayTimeUnit": "ms",
                "otherData": {"producer": "specloop", "dropped_events": self.dropped}}

    def write(self, path: str | Path, events: Sequence[dict[str, Any]] | None = None) -> None:
        Path(path).write_text(json.dumps(self.trace(events)))
        self.written = True


class TracedCommunicator(ForwardingCommunicator):
    """Forwards to ``inner`` and records each collective as a slice on the rank's track."""

    def __init__(self, inner: Communicator, recorder: TraceRecorder) -> None:
        super().__init__(inner)
        self._recorder = recorder

    def _wrap(self, inner: Communicator) -> TracedCommunicator:
        return TracedCommunicator(inner, self._recorder)

    async def _around(self, op: str, call: Awaitable[T],
                      shape: tuple[int, ...] | None = None) -> T:
        start = _now_us()
        try:
            return await call
        finally:
            self._recorder.collective(self.rank, op, self.name, start, _now_us(), shape)
