"""Request lifecycle: one regression test per defect of issue 10 (each failed on the main
of 2026-11-30), on the tiny model."""

import contextlib
import time
from pathlib import Path

import anyio
import pytest
from structlog.testing import capture_logs

from specloop.comm import CollectiveTimeoutError, LocalGroup
from specloop.engine import (AsyncEngine, ConfigError, EngineClosedError, EngineStateError,
                             FinishReason, RequestError)
from specloop.samplers import SamplingParams, SamplingParamsError

from .conftest import PROMPTS, collect, make_config
from .test_engine import reference_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
ENDLESS = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
DOCS = Path(__file__).resolve().parents[2] / "docs"


def flatten(exc):
    if isinstance(exc, BaseExceptionGroup):
        return [e for sub in exc.exceptions for e in flatten(sub)]
    return [exc]


# 1 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("top_k", 2**63), ("top_k", 10**30), ("temperature", 1e-40), ("temperature", 1e300),
    ("max_tokens", 2**64), ("seed", 2**63), ("stop_token_ids", (2**63,))])
def test_values_the_tensors_cannot_hold_are_rejected_at_the_edge(field, value):
    with pytest.raises(SamplingParamsError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


async def test_extreme_valid_params_do_not_disturb_other_requests(tiny_dir, tiny_loaded):
    extremes = [SamplingParams(top_k=2**63 - 1, max_tokens=5, seed=1),
                SamplingParams(temperature=1e-6, top_p=1e-300, max_tokens=5),
                SamplingParams(temperature=1e6, min_p=1.0, max_tokens=5),
                SamplingParams(temperature=0.5, top_k=1, max_tokens=2**63 - 1)]
    async with AsyncEngine(make_config(tiny_dir, method="ngram"), model=tiny_loaded) as engine:
        results = {}

        async def one(i, prompt, params):
            results[i] = await collect(engine, prompt, params)

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "good", PROMPTS[0], GREEDY)
            for i, params in enumerate(extremes):
                tg.start_soon(one, i, PROMPTS[1], params)
    assert results["good"] == reference_greedy(tiny_loaded, PROMPTS[0], GREEDY.max_tokens)
    assert all(len(results[i]) >= 1 for i in range(len(extremes)))


# 2 -----------------------------------------------------------------------------------
async def test_a_reused_id_never_receives_the_earlier_requests_tokens(tiny_dir, tiny_loaded):
    expected = reference_greedy(tiny_loaded, PROMPTS[0], GREEDY.max_tokens)
    async with AsyncEngine(make_config(tiny_dir, method="ngram"), model=tiny_loaded) as engine:
        for _ in range(5):
            async with contextlib.aclosing(engine.generate([207, 207], LONG,
                                                           request_id="x")) as stream:
                async for _out in stream:
                    break
            try:        # still finishing: refused, never aliased
                outs = [o async for o in engine.generate(PROMPTS[0], GREEDY, request_id="x")]
            except RequestError as exc:
                assert "already in use" in str(exc)
                with anyio.fail_after(5):
                    while "x" in engine.front.open_request_ids:
                        await anyio.sleep(0.005)
                outs = [o async for o in engine.generate(PROMPTS[0], GREEDY, request_id="x")]
            assert [t for o in outs for t in o.token_ids] == expected
            assert outs[-1].finish_reason is FinishReason.LENGTH
        assert engine.num_free_slots == 4


# 3 -----------------------------------------------------------------------------------
async def test_automatic_ids_never_collide_with_caller_ids(tiny_dir, tiny_loaded):
    async with AsyncEngine(make_config(tiny_dir), model=tiny_loaded) as engine:
        with pytest.raises(RequestError, match="automatic ids"):
            await collect(engine, PROMPTS[0], GREEDY, request_id="req-0")
        with pytest.raises(RequestError, match="non-empty str"):
            await collect(engine, PROMPTS[0], GREEDY, request_id=7)
        ids = []

        async def auto():
            async for out in engine.generate(PROMPTS[1], GREEDY):
                ids.append(out.request_id)

        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: collect(engine, PROMPTS[0], LONG, request_id="req-x"))
            for _ in range(3):
                tg.start_soon(auto)
        assert len(set(ids)) == 3 and all(i.startswith("req-") for i in ids)


# 4 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2])
async def test_leaving_a_queued_request_ends_it_cleanly(tiny_dir, tiny_loaded, world):
    """A timeout while the request is still in rank 0's inbox used to raise
    BrokenResourceError into the consumer and out of the engine's exit."""
    config = make_config(tiny_dir, max_batch_size=1,
                         parallel={"world_size": world, "attention_dp": world > 1})
    outcome = {}

    async def body(engine):
        with anyio.move_on_after(0):            # cancelled at the first wait: queued
            await collect(engine, PROMPTS[0], GREEDY, request_id="q")
        with anyio.fail_after(5):
            while engine.front.open_request_ids:
                await anyio.sleep(0.005)
        outcome["after"] = await collect(engine, PROMPTS[0], GREEDY, request_id="q")

    async def rank_main(comm):
        async with AsyncEngine(config, communicator=comm, model=tiny_loaded) as engine:
            if comm.rank == 0:
                await body(engine)
            else:
                await engine.wait_closed()
            outcome[comm.rank] = engine.num_free_slots

    await LocalGroup(world).run(rank_main)
    assert outcome["after"] == reference_greedy(tiny_loaded, PROMPTS[0], GREEDY.max_tokens)
    assert all(outcome[r] == 1 for r in range(world))


# 5 -----------------------------------------------------------------------------------
async def test_collective_timeout_from_config_reaches_an_injected_local_group(
        tiny_dir, tiny_loaded):
    config = make_config(tiny_dir, parallel={"world_size": 2, "attention_dp": True,
                                             "collective_timeout_s": 0.5})
    group = LocalGroup(2, timeout=60.0)        # its own bound would wait a minute
    errors, stalled_at = {}, []

    async def rank_main(comm):
        try:
            async with AsyncEngine(config, communicator=comm, model=tiny_loaded) as engine:
                assert engine.comm.timeout_s == 0.5
                if comm.rank == 0:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(collect, engine, PROMPTS[0], LONG)
                        await anyio.sleep(0.2)
                        stalled_at.append(time.monotonic())
                        group.stall(1)
                else:
                    await engine.wait_closed()
        except BaseException as exc:  # noqa: BLE001 - inspected below
            errors[comm.rank] = (exc, time.monotonic())

    with anyio.fail_after(20):
        await group.run(rank_main, return_exceptions=True)
    exc, when = errors[0]
    assert any(isinstance(e, CollectiveTimeoutError) for e in flatten(exc)), exc
    assert when - stalled_at[0] < 5.0       # far below the group's own 60 s


async def test_every_stream_ends_when_a_rank_dies(tiny_dir, tiny_loaded):
    config = make_config(tiny_dir, method="ngram", max_batch_size=2,
                         parallel={"world_size": 2, "attention_dp": True,
                                   "collective_timeout_s": 2.0})
    group = LocalGroup(2)
    endings = {}

    async def consume(engine, i):
        try:
            async for out in engine.generate(PROMPTS[i], ENDLESS, request_id=f"s{i}"):
                if out.finished:
                    endings.setdefault(i, []).append(out.finish_reason)
        except EngineClosedError as exc:
            endings.setdefault(i, []).append(type(exc))

    async def rank_main(comm):
        async with AsyncEngine(config, communicator=comm, model=tiny_loaded) as engine:
            if comm.rank == 1:
                await engine.wait_closed()
                return
            async with anyio.create_task_group() as tg:
                for i in range(5):          # 2 + 2 served, 1 queued
                    tg.start_soon(consume, engine, i)
                await anyio.sleep(0.1)
                group.fail(1)

    with anyio.fail_after(20):
        await group.run(rank_main, return_exceptions=True)
    assert sorted(endings) == list(range(5)) and all(len(e) == 1 for e in endings.values())
    assert all(e[0] is EngineClosedError for e in endings.values()), endings


def test_collective_timeout_must_exceed_the_idle_wait(tiny_dir):
    with pytest.raises(ConfigError, match="parallel.collective_timeout_s"):
        make_config(tiny_dir, parallel={"collective_timeout_s": 0.01})
    with pytest.raises(ConfigError, match="parallel.collective_timeout_s"):
        make_config(tiny_dir, parallel={"collective_timeout_s": 0})


def test_the_torch_distributed_factory_gets_the_timeout(tiny_dir, monkeypatch):
    from specloop.comm import TorchDistributedCommunicator
    from specloop.engine._components import torch_distributed_communicator
    seen = {}
    monkeypatch.setattr(TorchDistributedCommunicator, "from_env",
                        classmethod(lambda cls, **kw: seen.update(kw)))
    torch_distributed_communicator(make_config(
        tiny_dir, parallel={"collective_timeout_s": 7.5}))
    assert seen["timeout"] == 7.5


# 6 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True])
async def test_a_lone_surrogate_is_a_request_error(tiny_dir, tiny_loaded, chat):
    config = make_config(tiny_dir, model={"name": str(tiny_dir), "dtype": "float64",
                                          "device": "cpu", "chat_template": chat})
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        with pytest.raises(RequestError, match="not valid Unicode"):
            await collect(engine, "llamas \ud800 and alpacas", GREEDY)
        assert len(await collect(engine, PROMPTS[0], GREEDY)) == GREEDY.max_tokens


# 7 -----------------------------------------------------------------------------------
async def test_an_engine_runs_once(tiny_dir, tiny_loaded):
    engine = AsyncEngine(make_config(tiny_dir), model=tiny_loaded)
    async with engine:
        assert len(await collect(engine, PROMPTS[0], GREEDY)) == GREEDY.max_tokens
    with pytest.raises(EngineStateError, match="already run"):
        async with engine:
            pass


async def test_nesting_is_refused_and_leaves_other_engines_alone(tiny_dir, tiny_loaded):
    config = make_config(tiny_dir)
    engine = AsyncEngine(config, model=tiny_loaded)
    with pytest.raises(BaseException) as info:
        async with engine:
            async with engine:
                pass
    assert any(isinstance(e, EngineStateError) and "nesting" in str(e)
               for e in flatten(info.value)), info.value
    # An unrelated engine in the same task is not cancelled by the refused one.
    async with AsyncEngine(config, model=tiny_loaded) as other:
        await anyio.sleep(0.1)
        assert len(await collect(other, PROMPTS[0], GREEDY)) == GREEDY.max_tokens


async def test_cancel_racing_shutdown_is_harmless(tiny_dir, tiny_loaded):
    engine = AsyncEngine(make_config(tiny_dir), model=tiny_loaded)
    engine.cancel("early")                      # before the engine started: ignored
    finals = []

    async def consume():
        try:
            async for out in engine.generate(PROMPTS[0], LONG, request_id="late"):
                finals.append(out.finish_reason)
        finally:
            engine.cancel("late")               # e.g. a disconnect handler

    async with anyio.create_task_group() as tg:
        async with engine:
            tg.start_soon(consume)
            await anyio.sleep(0.05)
    engine.cancel("late")
    assert finals[-1] is FinishReason.CANCELLED


# 8 -----------------------------------------------------------------------------------
class Broken:
    def __init__(self):
        self.calls = 0

    def on_transition(self, event):
        self.calls += 1
        raise RuntimeError("observer bug")


async def test_a_raising_observer_is_logged_and_the_engine_keeps_serving(tiny_dir,
                                                                         tiny_loaded):
    broken = Broken()
    with capture_logs() as logs:
        async with AsyncEngine(make_config(tiny_dir, method="ngram"), model=tiny_loaded,
                               observers=[broken]) as engine:
            out = await collect(engine, PROMPTS[0], GREEDY)
    assert out == reference_greedy(tiny_loaded, PROMPTS[0], GREEDY.max_tokens)
    failed = [e for e in logs if e["event"] == "observer_failed"]
    assert failed and len(failed) == broken.calls
    # ...and the embedding guide says exactly that (it used to say the engine fails).
    text = (DOCS / "embedding.md").read_text()
    assert "observer_failed" in text and "an exception fails the engine" not in text
