"""``set_max_running``: the running batch's cap at run time, on one rank, on every rank of a
LocalGroup (it rides SCHEDULE's exchange) and through a ProcessEngine's pipe."""

import anyio
import attrs
import pytest

from specloop.engine import AsyncEngine, ConfigError, EngineClosedError, ProcessEngine
from specloop.engine._request import NewRequest, Request
from specloop.engine._scheduler import Scheduler
from specloop.samplers import SamplingParams

from .conftest import PROMPTS, make_config, serve_staggered
from .test_adp import adp_config, run_group

PARAMS = [SamplingParams(temperature=0.0, max_tokens=10 + 2 * i, ignore_eos=True)
          for i in range(len(PROMPTS))]


class Batches:
    """IterationObserver: the largest batch each rank ran (VERIFY's rows)."""

    def __init__(self):
        self.largest: dict[int, int] = {}

    def on_transition(self, event):
        if event.state.value == "VERIFY":
            self.largest[event.rank] = max(self.largest.get(event.rank, 0),
                                           event.batch_size)


def _request(i: int) -> Request:
    new = NewRequest(f"r{i}", (1, 2, 3), SamplingParams(max_tokens=4), i)
    return Request.from_new(new)


def test_scheduler_admits_up_to_the_cap_and_lowering_it_ends_no_request():
    scheduler = Scheduler(max_batch_size=4, max_num_tokens=512)
    for i in range(6):
        scheduler.add(_request(i))
    scheduler.max_running = 2
    assert [r.request_id for r in scheduler.admit()] == ["r0", "r1"]
    assert scheduler.admit() == []          # at the cap: the rest wait
    scheduler.max_running = 3
    assert [r.request_id for r in scheduler.admit()] == ["r2"]
    scheduler.max_running = 1               # below the batch: nobody leaves, nobody joins
    assert scheduler.admit() == [] and len(scheduler.running) == 3
    scheduler.max_running = 4
    assert [r.request_id for r in scheduler.admit()] == ["r3"]   # the slots' limit too
    assert len(scheduler.waiting) == 2


async def test_one_rank_runs_at_most_the_cap_and_its_outputs_do_not_change(tiny_dir,
                                                                             tiny_loaded):
    config = make_config(tiny_dir, method="ngram", max_batch_size=4)
    reqs = [(p, q, 0) for p, q in zip(PROMPTS, PARAMS)]
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        expected = await serve_staggered(engine, reqs)
    seen = Batches()
    async with AsyncEngine(config, model=tiny_loaded, observers=[seen]) as engine:
        engine.set_max_running(2)
        assert await serve_staggered(engine, reqs) == expected
        assert seen.largest[0] == 2
        seen.largest.clear()
        engine.set_max_running(None)        # back to max_batch_size
        assert await serve_staggered(engine, reqs) == expected
        assert seen.largest[0] == min(4, len(PROMPTS))


async def test_a_bad_cap_is_refused_by_name_and_the_engine_keeps_serving(tiny_dir,
                                                                        tiny_loaded):
    config = make_config(tiny_dir, max_batch_size=4)
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        for bad in (0, 5, -1, True, 2.0, "2"):
            with pytest.raises(ConfigError, match=r"max_running = .*max_batch_size \(4\)"):
                engine.set_max_running(bad)
        got = await serve_staggered(engine, [(PROMPTS[0], PARAMS[0], 0)])
        assert len(got[0]) == PARAMS[0].max_tokens
    with pytest.raises(EngineClosedError):
        engine.set_max_running(2)


async def test_every_rank_of_a_group_takes_the_cap(tiny_dir, tiny_loaded):
    """Rank 0's cap reaches each rank in SCHEDULE's exchange: with 2 ranks of 4 slots and
    the cap at 1, no rank runs more than one request at a time; the outputs are a single
    rank's."""
    single = make_config(tiny_dir, method="ngram", max_batch_size=4)
    reqs = [(p, q, 0) for p, q in zip(PROMPTS, PARAMS)]
    async with AsyncEngine(single, model=tiny_loaded) as engine:
        expected = await serve_staggered(engine, reqs)
    seen = Batches()

    async def body(engine):
        engine.set_max_running(1)
        return await serve_staggered(engine, reqs)

    config = adp_config(tiny_dir, 2, method="ngram", max_batch_size=4)
    results, _ = await run_group(2, config, tiny_loaded, body, observers=lambda comm: [seen])
    assert results[0] == expected
    assert seen.largest == {0: 1, 1: 1}


@pytest.mark.slow
async def test_a_process_engine_takes_the_cap_through_its_pipe(tiny_dir, tiny_loaded):
    """The cap reaches the core in its pipe's message; and (one spawn for both) a
    ``detokenize=False`` request's outputs come back as token ids with no text, the same
    ids as a detokenized one's."""
    config = make_config(tiny_dir, method="ngram", max_batch_size=4)
    reqs = [(p, q, 0) for p, q in zip(PROMPTS, PARAMS)]
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        expected = await serve_staggered(engine, reqs)
    seen = Batches()
    async with ProcessEngine(config, observers=[seen]) as engine:
        with anyio.fail_after(120):
            engine.set_max_running(2)
            assert await serve_staggered(engine, reqs) == expected
            texts = {}
            for detokenize in (True, False):
                params = attrs.evolve(PARAMS[3], detokenize=detokenize)
                outs = [out async for out in engine.generate(PROMPTS[3], params)]
                texts[detokenize] = "".join(out.text for out in outs)
                assert [t for out in outs for t in out.token_ids] == expected[3]
            assert texts[True] and texts[False] == ""
    assert seen.largest[0] == 2


async def test_only_the_front_door_rank_takes_a_cap(tiny_dir, tiny_loaded):
    """Another rank of a group has no front door: its ``set_max_running`` raises
    ``EngineClosedError`` naming rank 0, as its ``generate`` does."""
    from specloop.comm import LocalGroup

    config = adp_config(tiny_dir, 2, method="ngram", max_batch_size=4)

    async def rank_main(comm):
        async with AsyncEngine(config, communicator=comm, model=tiny_loaded) as engine:
            if comm.rank == 1:
                with pytest.raises(EngineClosedError, match="rank 1 is not the front door"):
                    engine.set_max_running(2)
                await engine.wait_closed()
                return None
            engine.set_max_running(2)
            return await serve_staggered(engine, [(PROMPTS[0], PARAMS[0], 0)])

    results = await LocalGroup(2, timeout=5.0).run(rank_main)
    assert len(results[0][0]) == PARAMS[0].max_tokens
