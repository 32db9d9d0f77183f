"""One iteration per rank as an explicit state machine (DESIGN.md, "One iteration").

Each handler is async, takes the iteration's record and returns the next state; the
transition table in ``_states`` is checked, and each transition emits one
``iteration_state`` event to structlog and to the observers.
"""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable, Sequence

import attrs
import structlog
import torch

from specloop.graphs import GraphKey
from specloop.samplers import RejectionResult, SamplingBatch, SpecMetadata
from specloop.samplers._tree import DraftTree

from ._request import Request
from ._states import IterationObserver, IterationState, TransitionEvent, check_transition

log = structlog.get_logger(__name__)
S = IterationState


@attrs.define
class IterationRecord:
    """What one iteration has decided so far; handlers fill it in order."""

    iteration: int
    spec: SpecMetadata
    batch: list[Request] = attrs.Factory(list)
    padded_batch_size: int = 0
    # K this iteration drafts: SYNC's choice under adaptive K, else the configured K.
    num_draft_tokens: int | None = None
    # The draft tree this iteration drafts and verifies (``speculative.tree`` on a batch
    # off the advanced path; num_draft_tokens is then its size), else None: a chain.
    tree: DraftTree | None = None
    # Adaptive K: whether SYNC let K = num_draft_tokens stand for the tree (from values
    # the group agrees on, so every rank's rule reads the tree's acceptance alike).
    tree_agreed: bool = False
    # Adaptive K: each row's draft class as the choice of K saw it (``Drafter.draft_classes``;
    # None: unclassed), which RESCAN counts its acceptance under.
    draft_classes: list[int] | None = None
    graph_key: GraphKey | None = None
    graph_captured: bool = False                 # whether a captured graph serves the key
    sampling: SamplingBatch | None = None
    draft_token_ids: torch.Tensor | None = None  # [B, K]
    draft_probs: torch.Tensor | None = None      # [B, K, V] or None
    result: RejectionResult | None = None
    # VERIFY: whether it took the step the last VERIFY queued ahead (or chained): the
    # host's work then overlapped the GPU's (EngineStats.num_overlapped_iterations).
    overlapped: bool = False
    finished: list[Request] = attrs.Factory(list)
    shutdown: bool = False

    @property
    def sampling_path(self) -> str | None:
        return self.graph_key.sampling_path.value if self.graph_key else None

    # The fields as read by the states after the one that sets them (the transition
    # table orders the states, so each is set by then).
    @property
    def k(self) -> int:
        assert self.num_draft_tokens is not None, "PICK_GRAPH_KEY sets num_draft_tokens"
        return self.num_draft_tokens

    @property
    def key(self) -> GraphKey:
        assert self.graph_key is not None, "PICK_GRAPH_KEY sets graph_key"
        return self.graph_key

    @property
    def batch_sampling(self) -> SamplingBatch:
        assert self.sampling is not None, "PICK_GRAPH_KEY sets sampling (for a batch)"
        return self.sampling


Handler = Callable[[IterationRecord], Awaitable[IterationState]]


class IterationMachine:
    """Runs the handlers from SCHEDULE to DONE, checking each transition."""

    def __init__(self, handlers: dict[IterationState, Handler], *, rank: int,
                 num_draft_tokens: int, observers: Sequence[IterationObserver] = ()) -> None:
        missing = set(S) - {S.DONE} - set(handlers)
        if missing:
            raise ValueError(f"no handler for states {sorted(s.value for s in missing)}")
        self.handlers = handlers
        self.rank = rank
        self.num_draft_tokens = num_draft_tokens
        self.observers = tuple(observers)
        # The last VERIFY event's batch and its request ids (``_emit``).
        self._ids: tuple[list[Request], tuple[str, ...]] = ([], ())

    async def run(self, record: IterationRecord) -> IterationRecord:
        state = S.SCHEDULE
        # One bind per iteration (not per event), under the logging config of the moment;
        # when debug is filtered out and nobody observes, an event costs nothing.
        # structlog unconfigured prints every level to stdout: a library stays quiet then.
        bound = log.bind()
        debug = enabled_for(bound, logging.DEBUG)
        emit = debug or bool(self.observers)
        while state is not S.DONE:
            start = time.perf_counter()
            next_state = await self.handlers[state](record)
            check_transition(state, next_state)
            if emit:
                self._emit(bound if debug else None, record, state, next_state, start,
                           time.perf_counter() - start)
            state = next_state
        return record

    def _emit(self, bound: structlog.typing.FilteringBoundLogger | None,
              record: IterationRecord, state: IterationState,
              next_state: IterationState, start: float, duration_s: float) -> None:
        accepted: tuple[int, ...] | None = None
        request_ids: tuple[str, ...] = ()
        overlapped: bool | None = None
        if state is S.VERIFY and record.result is not None:
            overlapped = record.overlapped
            accepted = tuple(record.result.num_accepted.tolist())
            # Most iterations run the last one's batch: its ids again (a list comparison
            # by identity, not an attribute read and a tuple item per row).
            batch, ids = self._ids
            if batch != record.batch:
                ids = tuple([r.request_id for r in record.batch])
                self._ids = (list(record.batch), ids)
            request_ids = ids
        event = TransitionEvent(
            rank=self.rank, iteration=record.iteration, state=state, next_state=next_state,
            duration_us=round(duration_s * 1e6, 1), batch_size=len(record.batch),
            num_draft_tokens=self.num_draft_tokens if record.num_draft_tokens is None
            else record.num_draft_tokens, sampling_path=record.sampling_path,
            accepted=accepted, request_ids=request_ids, started_at=start,
            overlapped=overlapped)
        if bound is not None:
            bound.debug("iteration_state", rank=event.rank, iteration=event.iteration,
                        state=state.value, next_state=next_state.value,
                        duration_us=event.duration_us, batch_size=event.batch_size,
                        num_draft_tokens=event.num_draft_tokens,
                        sampling_path=event.sampling_path, accepted=accepted,
                        overlapped=overlapped)
        notify(self.observers, event)


def enabled_for(bound: structlog.typing.FilteringBoundLogger, level: int) -> bool:
    """Whether ``bound`` (a ``log.bind()`` under the logging config of the moment) lets
    ``level`` through: never while structlog is unconfigured (it would print every level
    to stdout; a library stays quiet then)."""
    return structlog.is_configured() and getattr(
        bound, "is_enabled_for", lambda level: True)(level)


def notify(observers: Sequence[IterationObserver], event: TransitionEvent) -> None:
    """Each observer's ``on_transition``; one that raises is logged (``observer_failed``)
    and called again for later events: a broken hook costs its metrics, not serving."""
    for observer in observers:
        try:
            observer.on_transition(event)
        except Exception as exc:  # noqa: BLE001 - a broken hook must not stop serving
            log.error("observer_failed", observer=type(observer).__name__, error=repr(exc))

