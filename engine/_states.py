"""The iteration state machine's states, its transition table (data), and its events."""

from __future__ import annotations

import enum
from typing import Protocol, runtime_checkable

import attrs

from ._errors import IllegalTransitionError


class IterationState(str, enum.Enum):
    SCHEDULE = "SCHEDULE"
    SYNC = "SYNC"
    PICK_GRAPH_KEY = "PICK_GRAPH_KEY"
    DRAFT = "DRAFT"
    VERIFY = "VERIFY"
    RESCAN = "RESCAN"
    # Not a handler: the iteration is over and its outputs are emitted.
    DONE = "DONE"


S = IterationState

# SYNC -> DONE: the whole group is idle, so nothing is drafted or verified this iteration.
TRANSITIONS: dict[IterationState, frozenset[IterationState]] = {
    S.SCHEDULE: frozenset({S.SYNC}),
    S.SYNC: frozenset({S.PICK_GRAPH_KEY, S.DONE}),
    S.PICK_GRAPH_KEY: frozenset({S.DRAFT}),
    S.DRAFT: frozenset({S.VERIFY}),
    S.VERIFY: frozenset({S.RESCAN}),
    S.RESCAN: frozenset({S.DONE}),
    S.DONE: frozenset(),
}


def check_transition(state: IterationState, next_state: IterationState) -> None:
    if next_state not in TRANSITIONS[state]:
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[state])) or "nothing"
        raise IllegalTransitionError(
            f"illegal transition {state.value} -> {next_state.value}; "
            f"{state.value} may go to: {allowed}")


@attrs.frozen
class TransitionEvent:
    """What observers and the ``iteration_state`` log event see for each transition."""

    rank: int
    iteration: int
    state: IterationState
    next_state: IterationState
    duration_us: float
    batch_size: int
    num_draft_tokens: int
    sampling_path: str | None
    accepted: tuple[int, ...] | None = None
    # VERIFY only: the batch's request ids, row for row with ``accepted``.
    request_ids: tuple[str, ...] = ()
    # time.perf_counter() when the state began (timelines place slices by it).
    started_at: float = 0.0
    # VERIFY only: whether it took the step the last VERIFY queued ahead or chained (the
    # host's work overlapped the GPU's); False where it queued its own (a one-token prompt
    # joining a chained batch, a K switch that cannot chain, a group, the CPU). None
    # elsewhere.
    overlapped: bool | None = None


@runtime_checkable
class IterationObserver(Protocol):
    """Hooks into the state machine, like trio's Instrument; called on the event loop."""

    def on_transition(self, event: TransitionEvent) -> None: ...
