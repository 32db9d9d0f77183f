"""Attention data parallelism in one process: N engines over a LocalGroup."""

import anyio
import pytest

from specloop.comm import (CollectiveCounter, CollectiveTimeoutError, LocalGroup)
from specloop.engine import AsyncEngine, ConfigError, EngineClosedError
from specloop.samplers import SamplingParams

from .conftest import PROMPTS, collect, make_config, serve_staggered

PARAMS = [SamplingParams(temperature=0.0, max_tokens=12 + 3 * i, ignore_eos=True)
          for i in range(len(PROMPTS))]


def adp_config(model_dir, world, **kw):
    return make_config(model_dir, parallel={"world_size": world, "attention_dp": world > 1},
                       **kw)


async def serve(engine, prompts, params):
    return await serve_staggered(engine, [(p, q, 0) for p, q in zip(prompts, params)])


async def run_group(world, config, loaded, body, *, wrap=None, observers=None, timeout=5.0):
    group = LocalGroup(world, timeout=timeout)

    async def rank_main(comm):
        comm = wrap(comm) if wrap else comm
        obs = observers(comm) if observers else ()
        async with AsyncEngine(config, communicator=comm, model=loaded,
                               observers=obs) as engine:
            if comm.rank == 0:
                return await body(engine)
            await engine.wait_closed()
            return engine.stats.num_generated_tokens

    return await group.run(rank_main), group


async def single_rank(config, loaded):
    async with AsyncEngine(config, model=loaded) as engine:
        return await serve(engine, PROMPTS, PARAMS)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", ["none", "ngram", "draft_model"])
async def test_greedy_outputs_equal_single_rank(tiny_dir, tiny_draft_dir, tiny_loaded,
                                                world, method):
    draft = tiny_draft_dir if method == "draft_model" else None
    expected = await single_rank(make_config(tiny_dir, method=method, draft_model=draft),
                                 tiny_loaded)
    config = adp_config(tiny_dir, world, method=method, draft_model=draft, max_batch_size=2)
    results, _ = await run_group(world, config, tiny_loaded,
                                 lambda e: serve(e, PROMPTS, PARAMS))
    assert results[0] == expected
    # The work was spread: every rank served something.
    assert all(n > 0 for n in results[1:])


class LabelByState:
    """Labels the counter with the state about to run, so counts are per state."""

    def __init__(self, counter):
        self.counter = counter
        counter.label = "SCHEDULE"

    def on_transition(self, event):
        nxt = event.next_state.value
        self.counter.label = "SCHEDULE" if nxt == "DONE" else nxt


@pytest.mark.parametrize("lm_head_tp", [False, True])
async def test_one_collective_per_iteration_sync_facts_ride_the_exchange(
        tiny_dir, tiny_loaded, lm_head_tp):
    """SCHEDULE's all-gather carries the outputs and SYNC's facts: one tensor collective
    per iteration; the object exchange only when rank 0 has news (each request is
    submitted once, plus the shutdown); nothing in SYNC or later."""
    counters = {}

    def wrap(comm):
        counters[comm.rank] = CollectiveCounter(comm)
        return counters[comm.rank]

    iterations = {}

    class CountIterations(LabelByState):
        def on_transition(self, event):
            super().on_transition(event)
            if event.state.value == "SYNC":
                iterations[event.rank] = iterations.get(event.rank, 0) + 1

    config = make_config(tiny_dir, method="ngram", rejection=True,
                         parallel={"world_size": 2, "attention_dp": True,
                                   "lm_head_tp_in_adp": lm_head_tp})
    await run_group(2, config, tiny_loaded, lambda e: serve(e, PROMPTS, PARAMS), wrap=wrap,
                    observers=lambda c: [CountIterations(c)])
    for rank, counter in counters.items():
        by_label = counter.by_label()
        assert counter.count("all_gather_bytes", label="SCHEDULE") == iterations[rank] > 0, by_label
        assert counter.count("all_gather_object", label="SCHEDULE") <= len(PROMPTS) + 1
        for state in ("SYNC", "PICK_GRAPH_KEY", "DRAFT", "VERIFY", "RESCAN"):
            assert counter.count(label=state) == 0, by_label


async def test_dead_rank_surfaces_as_timeout_not_hang(tiny_dir, tiny_loaded):
    config = adp_config(tiny_dir, 2, method="ngram")
    long = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    group = LocalGroup(2, timeout=1.0)
    errors = {}

    async def rank_main(comm):
        try:
            async with AsyncEngine(config, communicator=comm, model=tiny_loaded) as engine:
                if comm.rank == 0:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(collect, engine, [1, 2, 3], long)
                        tg.start_soon(collect, engine, [4, 5, 6], long)
                        await anyio.sleep(0.3)
                        group.fail(1)
                else:
                    await engine.wait_closed()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors[comm.rank] = exc

    with anyio.fail_after(10):
        await group.run(rank_main, return_exceptions=True)
    flat = []

    def walk(e):
        if isinstance(e, BaseExceptionGroup):
            for sub in e.exceptions:
                walk(sub)
        else:
            flat.append(e)
    walk(errors[0])
    assert any(isinstance(e, (CollectiveTimeoutError, EngineClosedError)) for e in flat), flat
    assert any("rank 1" in str(e) or "rank(s) 1" in str(e) for e in flat
               if isinstance(e, CollectiveTimeoutError)) or \
        any(isinstance(e, EngineClosedError) for e in flat)


async def test_world_size_must_match_the_communicator(tiny_dir, tiny_loaded):
    group = LocalGroup(2)
    with pytest.raises(ConfigError, match="parallel.world_size"):
        AsyncEngine(adp_config(tiny_dir, 4), communicator=group.communicator(0),
                    model=tiny_loaded)


async def test_cancel_reaches_the_serving_rank_and_frees_its_slot(tiny_dir, tiny_loaded):
    """Requests are spread over 2 ranks; cancelling each mid-stream ends it with CANCELLED
    and every rank's slots come back."""
    from specloop.engine import FinishReason
    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    free = {}

    async def body(engine):
        finals = {}

        async def one(i):
            seen = 0
            async for out in engine.generate(PROMPTS[i], long, request_id=f"c{i}"):
                seen += len(out.token_ids)
                if seen >= 3 and not out.finished:
                    engine.cancel(f"c{i}")
                if out.finished:
                    finals[i] = (out.finish_reason, seen)

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
        for _ in range(100):        # the cancels reach rank 1 with the next exchanges
            await anyio.sleep(0.01)
            if all(e.num_free_slots == 2 for e in engines.values()):
                break
        free.update({rank: e.num_free_slots for rank, e in engines.items()})
        return finals

    group = LocalGroup(2)
    engines = {}

    async def rank_main(comm):
        async with AsyncEngine(adp_config(tiny_dir, 2, max_batch_size=2), communicator=comm,
                               model=tiny_loaded) as engine:
            engines[comm.rank] = engine
            if comm.rank == 0:
                return await body(engine)
            await engine.wait_closed()
            return engine.stats.num_generated_tokens

    finals, served_by_1 = await group.run(rank_main)
    assert all(reason is FinishReason.CANCELLED and n < 500 for reason, n in finals.values())
    assert len(finals) == 4 and served_by_1 > 0
    assert free == {0: 2, 1: 2}


async def test_step_queued_ahead_in_a_group_equals_single_rank(tiny_dir, tiny_loaded):
    """No speculation, each rank queueing its next step before reading this one back (the
    GPU path; the group's exchange then runs on the host): outputs equal one rank's, greedy
    and seeded sampled, with requests waiting for slots; every rank used steps queued
    ahead."""
    params = [SamplingParams(temperature=0.0, max_tokens=10 + 3 * i, ignore_eos=True)
              if i % 2 else SamplingParams(temperature=0.9, seed=i, max_tokens=12 + i)
              for i in range(len(PROMPTS))]
    async with AsyncEngine(make_config(tiny_dir), model=tiny_loaded) as engine:
        expected = await serve(engine, PROMPTS, params)
    config = adp_config(tiny_dir, 2, max_batch_size=2)
    used = [0, 0]

    async def rank_main(comm):
        async with AsyncEngine(config, communicator=comm, model=tiny_loaded) as engine:
            worker = engine.worker
            worker.verify_inline = worker.ahead.always = True
            take = worker.ahead.take

            def counted(rec):
                pending, rows = take(rec)
                used[comm.rank] += pending is not None
                return pending, rows
            worker.ahead.take = counted
            if comm.rank == 0:
                return await serve(engine, PROMPTS, params)
            await engine.wait_closed()

    results = await LocalGroup(2, timeout=5.0).run(rank_main)
    assert results[0] == expected
    assert all(used), used


async def test_rank0_defers_other_ranks_outputs_until_hand_over(tiny_dir):
    """``exchange(defer=True)`` on rank 0 keeps rank 1's outputs out of the front door
    until ``hand_over`` (VERIFY calls it once the step is queued); an exchange that
    follows without one hands the held outputs over first, so a request's outputs reach
    its consumer complete and in order. Without ``defer`` they arrive in the exchange."""
    import torch

    from specloop.engine._exchange import OutputExchange
    from specloop.engine._frontdoor_state import FrontDoor
    from specloop.engine._request import NewRequest, RequestOutput
    from specloop.engine._scheduler import Scheduler

    config = adp_config(tiny_dir, 2)
    front = FrontDoor()
    channel = front.submit(NewRequest("r", (1, 2), SamplingParams(), 0, handle=5))
    front.take_message(lambda new: ())     # as if assigned already: no flagged exchange
    got: list[tuple[int, ...]] = []

    async def rank_main(comm):
        ex = OutputExchange(config=config, comm=comm, front=front if comm.rank == 0 else None,
                            scheduler=Scheduler(4, 512))
        ex.loads = [0, 1]       # rank 0 does not wait for work
        for n, defer in enumerate((True, True, False)):
            if comm.rank == 1:
                ex.deliver(5, RequestOutput("r", (10 + n,), "", False, None))
            await ex(defer=defer)
            if comm.rank == 0:
                got.append(tuple(t for o in await _drain(channel) for t in o.token_ids))
        if comm.rank == 0:
            ex.hand_over()
            got.append(tuple(t for o in await _drain(channel) for t in o.token_ids))

    await LocalGroup(2, timeout=5.0).run(rank_main)
    assert got == [(), (10,), (11, 12), ()]


async def test_rank0_holds_its_own_outputs_after_a_deferred_exchange(tiny_dir):
    """Once an exchange was deferred, rank 0's own outputs (RESCAN's) wait for
    ``hand_over`` too: no consumer wakes between RESCAN and the next exchange, where it
    would run while rank 0 polls for the other rows or before rank 0 posts its own. An
    exchange without ``defer`` hands them over first and stops holding."""
    import torch

    from specloop.engine._exchange import OutputExchange
    from specloop.engine._frontdoor_state import FrontDoor
    from specloop.engine._request import NewRequest, RequestOutput
    from specloop.engine._scheduler import Scheduler

    config = adp_config(tiny_dir, 2)
    front = FrontDoor()
    channel = front.submit(NewRequest("own", (1, 2), SamplingParams(), 0, handle=6))
    front.take_message(lambda new: ())
    got: list[tuple[int, ...]] = []

    async def seen():
        got.append(tuple(t for o in await _drain(channel) for t in o.token_ids))

    async def rank_main(comm):
        ex = OutputExchange(config=config, comm=comm, front=front if comm.rank == 0 else None,
                            scheduler=Scheduler(4, 512))
        ex.loads = [1, 0]
        own = (lambda t: ex.deliver(6, RequestOutput("own", (t,), "", False, None))) \
            if comm.rank == 0 else (lambda t: None)
        own(20)
        if comm.rank == 0:
            await seen()                        # no exchange deferred yet: at once
        await ex(defer=True)
        own(21)
        if comm.rank == 0:
            await seen()                        # held
            ex.hand_over()
            await seen()                        # VERIFY's hand-over
        own(22)
        await ex(defer=False)
        if comm.rank == 0:
            await seen()                        # handed over before the exchange
        own(23)
        if comm.rank == 0:
            await seen()                        # not deferring any more: at once

    await LocalGroup(2, timeout=5.0).run(rank_main)
    assert got == [(20,), (), (21,), (22,), (23,)]


async def _drain(channel):
    """What the channel holds now (without waiting)."""
    with anyio.move_on_after(0.01):
        return await channel.take()
    return []
