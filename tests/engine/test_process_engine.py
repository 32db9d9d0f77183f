"""``ProcessEngine``: AsyncEngine's request API with the engine core in a spawned child.

One engine per test (a spawn imports torch: ~2-4 s), each test covering several paths:
token-for-token equality with the in-process engine (greedy, seeded sampling, n-gram
drafting, a stop string, ``generate_batch``), the same errors for bad input while other
requests keep being served, cancellation, stats from the core, and a core that dies:
every live request ends with an error and new ones are refused, nothing hangs.
"""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from specloop.engine import (AsyncEngine, ConfigError, EngineClosedError, FinishReason,
                             ProcessEngine, RequestError)
from specloop.samplers import SamplingParams

from .conftest import PROMPTS, make_config

# A child process each (one torch thread), not a group of ranks: "slow" (out of
# `make test-fast`), not "distributed" (whose tests run one at a time on one worker).
pytestmark = pytest.mark.slow


async def _one(engine, prompt, params, request_id=None):
    text, ids, reason = "", [], None
    async for out in engine.generate(prompt, params, request_id=request_id):
        text, reason = text + out.text, out.finish_reason
        ids.extend(out.token_ids)
    return text, ids, reason


def _params():
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [greedy,
            SamplingParams(temperature=0.8, seed=4, max_tokens=16, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=7, max_tokens=20,
                           stop_token_ids=tuple(range(40, 80)))]


async def _all(engine, prompts, params):
    """Every request at once (one batch), each through its own ``generate``."""
    results = [None] * len(prompts)

    async def run(i):
        results[i] = await _one(engine, prompts[i], params[i], request_id=f"r{i}")

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(run, i)
    return results


class Seen:
    """IterationObserver: the events of iterations with requests, and the drafts each
    VERIFY accepted."""

    def __init__(self):
        self.events, self.accepted = [], 0

    def on_transition(self, event):
        if event.batch_size:
            self.events.append(event)
        if event.accepted is not None:
            self.accepted += sum(event.accepted)


async def test_process_engine_equals_in_process(tiny_dir, tiny_loaded):
    config = make_config(tiny_dir, method="ngram", k=3, max_batch_size=4)
    prompts = [PROMPTS[0], PROMPTS[1], "The quick brown fox", PROMPTS[3]]
    params = _params()
    local_seen, seen = Seen(), Seen()
    async with AsyncEngine(config, model=tiny_loaded, observers=[local_seen]) as local:
        expect = await _all(local, prompts, params)
        local_accepted = local_seen.accepted
        full = expect[0][0]
        stop = full[len(full) // 2:len(full) // 2 + 3]
        stopped = await _one(local, prompts[0], SamplingParams(
            temperature=0, max_tokens=300, ignore_eos=True, stop=stop))
        batch_expect = [await _one(local, p, q) for p, q in zip(prompts, params)]
        local_stats = local.stats

    async with ProcessEngine(config, observers=[seen]) as engine:
        with anyio.fail_after(120):
            got = await _all(engine, prompts, params)
            assert got == expect
            # The core's iteration events reach this process's observers, in order, at
            # the core's next SCHEDULE (the next request's first): the same drafts
            # accepted (greedy n-gram: each request's own), every state of an iteration.
            assert await _one(engine, prompts[2], params[2]) == expect[2]
            ours = {f"r{i}" for i in range(len(prompts))}
            assert sum(sum(e.accepted) for e in seen.events if e.accepted is not None
                       and set(e.request_ids) <= ours) == local_accepted > 0
            for before, after in zip(seen.events, seen.events[1:]):
                assert (after.iteration, after.started_at) >= (before.iteration,
                                                               before.started_at)
                if after.iteration == before.iteration:
                    assert after.state is before.next_state
            assert engine.num_free_slots == config.scheduler.max_batch_size
            # A stop string is matched here, in the front door, and ends the request in
            # the core: the same text and tokens as in-process.
            assert await _one(engine, prompts[0], SamplingParams(
                temperature=0, max_tokens=300, ignore_eos=True, stop=stop)) == stopped
            assert stopped[2] is FinishReason.STOP
            # generate_batch: the same outputs, request by request.
            seen: dict[str, list[int]] = {}
            async for item in engine.generate_batch(prompts, params):
                for out in item:
                    seen.setdefault(out.request_id, []).extend(out.token_ids)
            assert [ids for ids in seen.values()] == [e[1] for e in batch_expect]
            # Bad input: the same errors, raised here; the engine keeps serving.
            with pytest.raises(RequestError, match="token ids must be ints"):
                await _one(engine, [1, 10 ** 9], params[0])
            with pytest.raises(RequestError, match="params must be a SamplingParams"):
                await _one(engine, "hi", {"temperature": 0})
            with pytest.raises(RequestError, match="max_seq_len"):
                await _one(engine, [1] * 1000, params[0])
            assert await _one(engine, prompts[2], params[2]) == expect[2]
            # Cancel a long request mid-way: its stream ends CANCELLED, its slot is freed
            # in the core (the next requests all run), and its id is reusable.
            long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            outs = []
            async for out in engine.generate(prompts[1], long, request_id="long"):
                outs.append(out)
                if len(outs) == 3:
                    engine.cancel("long")
            assert outs[-1].finished and outs[-1].finish_reason is FinishReason.CANCELLED
            assert sum(len(o.token_ids) for o in outs) < 200
            assert await _all(engine, prompts, params) == expect
            # The core's counters: every token generated above, drafts included.
            stats = await engine.fetch_stats()
            assert stats.num_generated_tokens >= 2 * sum(len(e[1]) for e in expect)
            assert stats.num_draft_tokens > 0 and local_stats.num_draft_tokens > 0
    with pytest.raises(EngineClosedError, match="not running"):
        await _one(engine, prompts[0], params[0])


class VerifiedBeforeOutput(Seen):
    """Seen, counting each request's VERIFY rows; and, when a request's final output
    reaches the front door (``watch``), how many had been seen by then."""

    def __init__(self):
        super().__init__()
        self.rows: dict[str, int] = {}
        self.rows_at_final: dict[str, int] = {}

    def watch(self, front):
        deliver = front.deliver

        def counted(outputs):
            outputs = list(outputs)
            for out in outputs:
                if out.finished:
                    self.rows_at_final[out.request_id] = self.rows.get(out.request_id, 0)
            deliver(outputs)
        front.deliver = counted

    def on_transition(self, event):
        super().on_transition(event)
        for rid in event.request_ids:
            self.rows[rid] = self.rows.get(rid, 0) + 1


async def _errors_when_killed(engine, pid: int) -> list[BaseException]:
    """Three endless streams, then the core process ``pid`` killed once tokens flow: the
    errors the consumers got (each should have got one)."""
    endless = SamplingParams(temperature=0, max_tokens=10 ** 4, ignore_eos=True)
    got: list[BaseException] = []

    async def consume(prompt):
        try:
            async for _ in engine.generate(prompt, endless):
                pass
        except EngineClosedError as exc:
            got.append(exc)

    async with anyio.create_task_group() as tg:
        for prompt in PROMPTS[:3]:
            tg.start_soon(consume, prompt)
        while (await engine.fetch_stats()).num_generated_tokens < 20:
            await anyio.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
    return got


async def test_core_death_ends_every_stream_with_an_error(tiny_dir):
    config = make_config(tiny_dir, max_batch_size=2)
    async with ProcessEngine(config) as engine:
        with anyio.fail_after(120):
            await _one(engine, PROMPTS[0], _params()[2])     # it serves
            assert engine._process is not None
            # Two running, one waiting for a slot: every one ends, none hangs.
            got = await _errors_when_killed(engine, engine._process.pid)
            assert len(got) == 3
            assert all("engine core process exited" in str(e) for e in got)
            with pytest.raises(EngineClosedError, match="engine failed"):
                await _one(engine, PROMPTS[0], _params()[2])


async def test_process_engine_refuses_what_it_cannot_run(tiny_dir, tmp_path):
    # Ranks it spawns talk through torch.distributed: another communicator is refused.
    with pytest.raises(ConfigError, match='components.communicator.*"torch_distributed"'):
        ProcessEngine(make_config(tiny_dir, parallel={"world_size": 2, "attention_dp": True}))
    # The core's own build error reaches the caller, as the in-process engine raises it.
    bad = make_config(tiny_dir, method="draft_model", draft_model=tmp_path / "missing")
    with pytest.raises(Exception) as in_process:
        async with AsyncEngine(bad):
            pass
    with pytest.raises(type(in_process.value)) as across:
        async with ProcessEngine(bad):
            pass
    assert str(across.value) == str(in_process.value)


async def test_random_lifecycles_lose_nothing(tiny_dir, tiny_loaded):
    """Two seeded scenarios on one engine (a spawn each would cost ~2.5 s of CPU)."""
    config = make_config(tiny_dir, method="ngram", k=3, max_batch_size=3)
    async with ProcessEngine(config) as engine:
        for seed in (1, 2):
            await _random_lifecycles(engine, config, tiny_loaded, seed)


@pytest.mark.distributed
async def test_random_lifecycles_lose_nothing_over_two_ranks(tiny_dir, tiny_loaded):
    """The same on a group of two spawned ranks (3 slots each): cancels and consumers
    leaving reach whichever rank serves the request, outputs equal one in-process rank's,
    and the group's every slot comes back."""
    one = make_config(tiny_dir, method="ngram", k=3, max_batch_size=3)
    group = make_config(tiny_dir, method="ngram", k=3, max_batch_size=3,
                        parallel={"world_size": 2, "attention_dp": True},
                        components={"communicator": "torch_distributed"})
    async with ProcessEngine(group) as engine:
        await _random_lifecycles(engine, one, tiny_loaded, 3)


async def _random_lifecycles(engine, config, tiny_loaded, seed):
    """30 requests through 3 slots a rank, each at random: read to the end, left after a few
    outputs, cancelled by id mid-way or before its first output, greedy or seeded
    sampling, started at random moments. Every stream ends once; one read to the end
    equals the in-process engine token for token; a cancelled one ends CANCELLED with a
    prefix of that; every slot comes back and every caller id is reusable after."""
    import random

    rng = random.Random(seed)
    plans = []
    for i in range(30):
        params = SamplingParams(temperature=rng.choice([0, 0, 0.8]), seed=rng.randrange(99),
                                max_tokens=rng.randint(1, 24), ignore_eos=True)
        plans.append((f"q{i}", PROMPTS[rng.randrange(len(PROMPTS))], params,
                      rng.choice(["read", "read", "leave", "cancel", "cancel_first"]),
                      rng.randint(1, 4), rng.random() * 0.05))
    async with AsyncEngine(config, model=tiny_loaded) as local:
        reference = {rid: (await _one(local, prompt, params))[1]
                     for rid, prompt, params, *_ in plans}

    ended: dict[str, list] = {}

    async def cancel_soon(rid):
        await anyio.sleep(0)    # its consumer has submitted it: queued, or in the core
        engine.cancel(rid)

    async def run(rid, prompt, params, action, after, delay):
        await anyio.sleep(delay)
        outs = []
        stream = engine.generate(prompt, params, request_id=rid)
        if action == "cancel_first":
            tg.start_soon(cancel_soon, rid)
        async for out in stream:
            outs.append(out)
            if len(outs) == after and action == "leave":
                break
            if len(outs) == after and action == "cancel":
                engine.cancel(rid)
        await stream.aclose()
        ended[rid] = outs

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for plan in plans:
                tg.start_soon(run, *plan)
        assert set(ended) == {p[0] for p in plans}
        for rid, _, _, action, after, _ in plans:
            outs, expect = ended[rid], reference[rid]
            ids = [t for o in outs for t in o.token_ids]
            assert ids == expect[:len(ids)], rid
            if action == "leave" and len(outs) == after and not outs[-1].finished:
                continue
            assert outs[-1].finished and sum(o.finished for o in outs) == 1, rid
            if outs[-1].finish_reason is FinishReason.CANCELLED:
                assert action in ("cancel", "cancel_first"), rid
            else:
                assert ids == expect, rid
        # The paths ran: some requests ended CANCELLED, some consumers left early.
        reasons = [ended[p[0]][-1].finish_reason for p in plans if ended[p[0]]]
        assert FinishReason.CANCELLED in reasons and FinishReason.LENGTH in reasons
        assert any(not ended[p[0]][-1].finished for p in plans if p[3] == "leave")
        slots = engine.config.scheduler.max_batch_size * engine.config.parallel.world_size
        while engine.num_free_slots != slots:
            await anyio.sleep(0.01)
        # Every id is free again: a second round under the same ids runs.
        again = [await _one(engine, prompt, params, request_id=rid)
                 for rid, prompt, params, *_ in plans[:5]]
        assert [a[1] for a in again] == [reference[p[0]] for p in plans[:5]]


async def test_reader_lets_consumers_run_between_batches(tiny_dir):
    """The parent's reader hands over what is pending, up to READ_BATCH messages a
    wake-up, then yields: a consumer takes several iterations' outputs at once when the
    reader lags, and is never starved by a core faster than the reader. A core that
    closes its pipe without a shutdown ends the stream with an error."""
    import multiprocessing
    import pickle

    from specloop.engine._wire import output_row
    from specloop.engine._process import READ_BATCH
    from specloop.engine._request import NewRequest, RequestOutput

    engine = ProcessEngine(make_config(tiny_dir))
    engine._conn, core = multiprocessing.Pipe()
    channel = engine.front.submit(NewRequest("a", (1,), SamplingParams(), 0))
    pending = 2 * READ_BATCH + 3
    for i in range(pending):     # the core ran ahead: every message waits in the pipe
        row = output_row(RequestOutput("a", (i,), ""))
        core.send_bytes(pickle.dumps(("out", [row], None)))
    takes: list[list[int]] = []

    async def consume():
        while outputs := await channel.take():
            takes.append([t for o in outputs for t in o.token_ids])
            if outputs[-1].finished:
                return

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            tg.start_soon(engine._read)
            while sum(map(len, takes)) < pending:
                await anyio.sleep(0.001)
            core.close()
    assert [len(t) for t in takes[:3]] == [READ_BATCH, READ_BATCH, 3]
    assert [t for take in takes for t in take] == list(range(pending))
    assert len(takes) == 4 and takes[3] == []           # the error's final output
    assert engine.num_free_slots == 4
    assert isinstance(engine._failure, EngineClosedError)


@pytest.mark.distributed
async def test_process_engine_of_two_ranks_equals_one_rank(tiny_dir, tiny_loaded):
    """Two cores spawned as a gloo group (no torchrun), rank 0 taking the requests:
    greedy and seeded sampled requests spread over both ranks give the outputs of one
    in-process rank, token for token (streams and ``generate_batch``); the other rank's
    outputs reach this process as the exchange's blocks; cancels reach either rank;
    every slot of the group comes back. Then a rank > 0 dies: every live stream ends with
    an error naming it, nothing hangs."""
    config = make_config(tiny_dir, method="ngram", k=3, max_batch_size=2)
    group = make_config(tiny_dir, method="ngram", k=3, max_batch_size=2,
                        parallel={"world_size": 2, "attention_dp": True},
                        components={"communicator": "torch_distributed"})
    prompts = [PROMPTS[0], PROMPTS[1], "The quick brown fox", PROMPTS[3], PROMPTS[2],
               "Once upon a time"]
    params = [*_params(), *_params()[:2]]
    async with AsyncEngine(config, model=tiny_loaded) as local:
        expect = await _all(local, prompts, params)
    seen = VerifiedBeforeOutput()
    engine = ProcessEngine(group, observers=[seen])
    seen.watch(engine.front)
    kinds: list[str] = []
    handle = engine._handle
    engine._handle = lambda message: (kinds.append(message[0]), handle(message))[1]
    async with engine:
        with anyio.fail_after(180):
            assert engine.num_free_slots == 4
            assert await _all(engine, prompts, params) == expect
            assert "blocks" in kinds            # rank 1 served some of them
            # Both ranks' iterations reach the observers here; each request's VERIFY
            # rows all came before its consumer saw its final output.
            assert {e.rank for e in seen.events} == {0, 1}
            assert seen.rows_at_final == {f"r{i}": seen.rows[f"r{i}"]
                                          for i in range(len(prompts))}
            got: dict[str, list[int]] = {}
            async for item in engine.generate_batch(prompts, params):
                for out in item:
                    got.setdefault(out.request_id, []).extend(out.token_ids)
            # In prompt order (automatic ids "req-N", N increasing): two ranks' first
            # outputs arrive in no fixed order.
            assert [got[rid] for rid in sorted(got, key=lambda r: int(r.split("-")[1]))] \
                == [e[1] for e in expect]
            # Two long requests at once go to the two ranks (least loaded): each is
            # cancelled mid-way and ends CANCELLED.
            long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            ends = {}

            async def cancelled(rid, prompt):
                outs = []
                async for out in engine.generate(prompt, long, request_id=rid):
                    outs.append(out)
                    if len(outs) == 3:
                        engine.cancel(rid)
                ends[rid] = outs

            async with anyio.create_task_group() as tg:
                tg.start_soon(cancelled, "long0", PROMPTS[0])
                tg.start_soon(cancelled, "long1", PROMPTS[1])
            for outs in ends.values():
                assert outs[-1].finish_reason is FinishReason.CANCELLED
                assert sum(len(o.token_ids) for o in outs) < 200
            while engine.num_free_slots != 4:
                await anyio.sleep(0.01)
            # Rank 1 dies with requests on both ranks.
            errors = await _errors_when_killed(engine, engine._ranks[0][0].pid)
            assert len(errors) == 3
            assert all("rank 1's engine core process exited" in str(e) for e in errors), \
                [str(e) for e in errors]


@pytest.mark.distributed
async def test_a_group_that_cannot_build_raises_the_build_error(tiny_dir, tmp_path):
    """Every rank fails to build (a missing draft model): the first failure to arrive is
    raised from ``__aenter__``, as the in-process engine raises it, and nothing waits for
    a collective's timeout."""
    bad = make_config(tiny_dir, method="draft_model", draft_model=tmp_path / "missing",
                      parallel={"world_size": 2, "attention_dp": True,
                                "collective_timeout_s": 300.0},
                      components={"communicator": "torch_distributed"})
    with pytest.raises(Exception) as in_process:
        async with AsyncEngine(make_config(tiny_dir, method="draft_model",
                                           draft_model=tmp_path / "missing")):
            pass
    with anyio.fail_after(60):
        with pytest.raises(type(in_process.value)) as across:
            async with ProcessEngine(bad):
                pass
    assert str(across.value) == str(in_process.value)


def test_blocks_are_delivered_after_their_ranks_pending_events(tiny_dir):
    """A rank > 0's events reach the observers before outputs it sent later through rank
    0: the parent reads every rank's pending events before it delivers blocks (no core
    here: the pipes are faked)."""
    import multiprocessing
    import pickle

    from specloop.engine._request import NewRequest, RequestOutput
    from specloop.engine._states import IterationState, TransitionEvent
    from specloop.engine._wire import encode_rows

    order: list[str] = []

    class Order:
        def on_transition(self, event):
            order.append(f"event {event.request_ids[0]}")

    engine = ProcessEngine(make_config(tiny_dir), observers=[Order()])
    parent, rank1 = multiprocessing.Pipe()
    engine._ranks, engine._core = [(None, parent)], {"k": 2}
    engine.front.submit(NewRequest("a", (1,), SamplingParams(), 0, handle=5))
    deliver = engine.front.deliver
    engine.front.deliver = lambda outs: (order.extend(f"output {o.request_id}" for o in outs),
                                         deliver(outs))
    verify = TransitionEvent(rank=1, iteration=3, state=IterationState.VERIFY,
                             next_state=IterationState.RESCAN, duration_us=1.0, batch_size=1,
                             num_draft_tokens=2, sampling_path="greedy", accepted=(1,),
                             request_ids=("a",))
    rank1.send_bytes(pickle.dumps(("events", [verify])))
    block = encode_rows([(5, RequestOutput("", (7, 8), "", True, FinishReason.LENGTH))], 2, 2)
    assert block is not None
    engine._handle(("blocks", [block.tobytes()]))
    assert order == ["event a", "output a"]
