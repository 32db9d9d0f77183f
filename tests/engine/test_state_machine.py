import logging

import pytest
import structlog
from structlog.testing import capture_logs

from specloop.engine import (TRANSITIONS, AsyncEngine, IllegalTransitionError, IterationMachine,
                             IterationRecord, IterationState)
from specloop.samplers import SamplingParams, SpecMetadata

from .conftest import collect, make_config

S = IterationState
ORDER = ["SCHEDULE", "SYNC", "PICK_GRAPH_KEY", "DRAFT", "VERIFY", "RESCAN"]


@pytest.fixture
def debug_logs():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    with capture_logs() as logs:
        yield logs
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def test_transition_table_is_the_designed_cycle():
    assert TRANSITIONS[S.SCHEDULE] == {S.SYNC}
    assert TRANSITIONS[S.SYNC] == {S.PICK_GRAPH_KEY, S.DONE}
    assert TRANSITIONS[S.PICK_GRAPH_KEY] == {S.DRAFT}
    assert TRANSITIONS[S.DRAFT] == {S.VERIFY}
    assert TRANSITIONS[S.VERIFY] == {S.RESCAN}
    assert TRANSITIONS[S.RESCAN] == {S.DONE}


async def test_illegal_transition_raises():
    async def go(to):
        async def handler(rec):
            return to
        return handler

    handlers = {s: await go(n) for s, n in [
        (S.SCHEDULE, S.SYNC), (S.SYNC, S.PICK_GRAPH_KEY), (S.PICK_GRAPH_KEY, S.VERIFY),
        (S.DRAFT, S.VERIFY), (S.VERIFY, S.RESCAN), (S.RESCAN, S.DONE)]}
    machine = IterationMachine(handlers, rank=0, num_draft_tokens=2)
    with pytest.raises(IllegalTransitionError, match="PICK_GRAPH_KEY -> VERIFY"):
        await machine.run(IterationRecord(0, SpecMetadata(use_rejection_sampling=False)))


def test_machine_needs_every_handler():
    with pytest.raises(ValueError, match="no handler"):
        IterationMachine({}, rank=0, num_draft_tokens=0)


class Recorder:
    def __init__(self):
        self.events = []

    def on_transition(self, event):
        self.events.append(event)


async def test_iteration_order_events_and_observer(tiny_dir, tiny_loaded, debug_logs):
    observer = Recorder()
    config = make_config(tiny_dir, method="ngram", k=2)
    async with AsyncEngine(config, model=tiny_loaded, observers=[observer]) as engine:
        await collect(engine, [5, 6, 7, 5, 6], SamplingParams(temperature=0, max_tokens=4))
    events = [e for e in debug_logs if e["event"] == "iteration_state"]
    busy = [e for e in events if e["batch_size"] > 0]
    assert busy, events
    first = busy[0]["iteration"]
    states = [e["state"] for e in busy if e["iteration"] == first]
    assert states == ORDER
    nexts = [e["next_state"] for e in busy if e["iteration"] == first]
    assert nexts == ORDER[1:] + ["DONE"]
    for e in busy:
        assert {"rank", "iteration", "state", "next_state", "duration_us", "batch_size",
                "num_draft_tokens", "sampling_path", "accepted"} <= set(e)
        assert e["num_draft_tokens"] == 2 and e["rank"] == 0
    verify = [e for e in busy if e["state"] == "VERIFY"]
    assert all(len(e["accepted"]) == e["batch_size"] for e in verify)
    assert all(e["sampling_path"] == "greedy" for e in verify)
    assert [(e.state.value, e.next_state.value) for e in observer.events] == \
           [(e["state"], e["next_state"]) for e in events]
