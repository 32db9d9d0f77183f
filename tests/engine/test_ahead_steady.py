"""The step queued ahead (no speculation, one GPU rank's path, run on the CPU) under a
server's load: rows ending at different iterations and requests arriving while others run
keep the step queued ahead in use (engine/_ahead.py), with the tokens of the eager path."""

import random
import time

import anyio

from specloop.engine import AsyncEngine, EngineConfig
from specloop.samplers import SamplingParams

from .conftest import PROMPTS, make_config


def _params(max_tokens, i):
    """Greedy and seeded sampled rows, alternately; EOS ignored (lengths end them)."""
    if i % 2:
        return SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _watch(worker, log):
    """Per VERIFY: (whether it took a step queued ahead, the batch); on the inline path."""
    take = worker.ahead.take

    def counted(rec):
        pending, rows = take(rec)
        log.append((pending is not None, tuple(rec.batch)))
        return pending, rows
    worker.ahead.take = counted


async def test_rows_ending_by_length_keep_the_step_ahead(tiny_dir, tiny_loaded):
    """Four requests admitted together end by max_tokens at four different iterations, one
    by the cache's length (max_seq_len 40): every iteration after the first takes the step
    the last one queued (for the rows left), the tokens are the eager path's, and every
    page comes back."""
    lengths = [5, 9, 13, 40]
    prompts = [PROMPTS[i] for i in range(4)]
    params = [_params(m, i) for i, m in enumerate(lengths)]

    async def run(ahead):
        log: list[tuple[bool, tuple]] = []
        async with AsyncEngine(make_config(tiny_dir, max_seq_len=40),
                               model=tiny_loaded) as engine:
            worker = engine.worker
            worker.verify_inline = worker.ahead.always = ahead
            _watch(worker, log)
            tokens: dict[str, list[int]] = {}
            async for outs in engine.generate_batch(prompts, params):
                for o in outs:
                    tokens.setdefault(o.request_id, []).extend(o.token_ids)
            pages = worker.runner.pages
            assert pages.num_free == pages.num_pages
        return [tokens[i] for i in sorted(tokens)], log

    eager, _ = await run(False)
    ahead, log = await run(True)
    assert ahead == eager
    assert [len(t) for t in ahead[:3]] == lengths[:3]
    assert len(ahead[3]) < lengths[3]           # ended by the cache's length
    taken = [t for t, _ in log]
    assert not taken[0] and all(taken[1:]), taken
    assert len({len(b) for _, b in log}) == 4   # taken for 4, 3, 2 and 1 rows



def _steady_config(tiny_dir):
    data = make_config(tiny_dir, max_batch_size=4, max_seq_len=64, rejection=True).to_dict()
    data["model"]["kv_page_size"] = 4       # steps cross page boundaries often
    data["components"]["graph_cache"] = "tests.engine.test_adaptive_ahead:StaticOutputs"
    data["graphs"] = {"batch_buckets": [1, 2, 4]}   # a joiner may change the key
    return EngineConfig.from_dict(data)


async def _steady(engine, lengths, in_flight, params=_params):
    """A server's load: ``in_flight`` requests at all times, the next submitted when one
    finishes (request i: ``params(lengths[i], i)``); -> the tokens of each."""
    out: dict[int, list[int]] = {}
    submitted = 0

    async def one(i, tg):
        nonlocal submitted
        tokens = out[i] = []
        async for o in engine.generate(PROMPTS[i % len(PROMPTS)], params(lengths[i], i)):
            tokens.extend(o.token_ids)
        if submitted < len(lengths):
            submitted += 1
            tg.start_soon(one, submitted - 1, tg)

    async with anyio.create_task_group() as tg:
        for _ in range(in_flight):
            submitted += 1
            tg.start_soon(one, submitted - 1, tg)
    return [out[i] for i in range(len(lengths))]


async def test_requests_joining_keep_the_step_ahead(tiny_dir, tiny_loaded):
    """Steady load (a request submitted whenever one ends, lengths spread, greedy and
    seeded sampled rows on the rejection path): requests admitted while a step queued
    ahead is on the device join at the next iteration, in the step that iteration takes
    (under a larger bucket when they need one); nearly every iteration takes a step queued
    ahead (before: 28 of 40), no newcomer waits more than one iteration, tokens are the
    eager path's, and every page comes back."""
    rng = random.Random(7)
    lengths = [rng.randint(3, 14) for _ in range(18)]

    async def run(ahead):
        log: list[tuple[bool, tuple]] = []
        admitted_at: dict[str, int] = {}
        async with AsyncEngine(_steady_config(tiny_dir), model=tiny_loaded) as engine:
            worker = engine.worker
            worker.verify_inline = worker.ahead.always = ahead
            _watch(worker, log)
            admit = worker.scheduler.admit

            def admitting():
                got = admit()
                admitted_at.update((r.request_id, len(log)) for r in got)
                return got
            worker.scheduler.admit = admitting
            outs = await _steady(engine, lengths, 4)
            pages = worker.runner.pages
            assert pages.num_free == pages.num_pages
            counts = (worker.ahead.joined_steps, worker.ahead.in_graph_steps)
        joined = {}
        for i, (_, batch) in enumerate(log):
            for r in batch:
                joined.setdefault(r.request_id, i)
        waits = [joined[rid] - at for rid, at in admitted_at.items()] if ahead else []
        return outs, log, waits, counts

    eager, _, _, _ = await run(False)
    ahead, log, waits, (joined_steps, in_graph) = await run(True)
    assert ahead == eager
    assert [len(t) for t in ahead] == lengths
    taken = sum(t for t, _ in log)
    assert taken > 0.8 * len(log), (taken, len(log))
    assert set(waits) == {0, 1}, waits      # the first four at once; later ones deferred
    assert joined_steps >= 5 and in_graph >= 5, (joined_steps, in_graph)


async def test_requests_join_k0_stretches_of_adaptive_k(tiny_dir, tiny_loaded):
    """Adaptive K on one GPU rank's path (mtp_eagle; K = 0 stretches queue their steps
    ahead, K > 0 iterations between them), requests arriving as others end: newcomers
    join K = 0 stretches through the step queued ahead, greedy tokens stay exact (the
    reference decode) and every page comes back."""
    from .test_adaptive import cycle_k
    from .test_adaptive_ahead import ahead_config, queue_ahead_on_cpu
    from .test_engine import reference_greedy

    rng = random.Random(3)
    lengths = [rng.randint(3, 12) for _ in range(16)]
    used: list[bool] = []
    async with AsyncEngine(ahead_config(tiny_dir, "mtp_eagle"), model=tiny_loaded) as engine:
        worker = engine.worker
        queue_ahead_on_cpu(worker, used)
        cycle_k(worker.adaptive, [0] * 6 + [2, 0, 0, 0, 0, 3])
        # Greedy rows only: joins change which iteration runs which K.
        outs = await _steady(engine, lengths, 4, lambda m, i: SamplingParams(
            temperature=0.0, max_tokens=m, ignore_eos=True))
        pages = worker.runner.pages
        assert pages.num_free == pages.num_pages
        joined = worker.ahead.joined_steps
    for i, out in enumerate(outs):
        assert out == reference_greedy(tiny_loaded, PROMPTS[i % len(PROMPTS)], lengths[i])
    assert joined >= 3 and sum(used) > 0.6 * len(used), (joined, sum(used), len(used))


async def test_joined_iterations_do_not_make_k0_look_dear(tiny_dir, tiny_loaded):
    """Adaptive K on one GPU rank's path, admission spanning several iterations (3
    prompts an iteration), newcomers held back an iteration: the step that waits behind a
    prefill's kernels on the device is the first one queued after it (here: its read-back
    100 ms late), i.e. the iteration the newcomers join, not the one that prefilled (its
    step was queued before). That iteration is disturbed too, so T(16, 0) stays what an
    iteration at K = 0 costs without a prefill (engine/_adaptive.py, IterationClock;
    RankWorker._schedule_local)."""
    from .test_adaptive_ahead import queue_ahead_on_cpu

    spill = 0.1
    data = make_config(tiny_dir, method="ngram", k=3, speculative={"adaptive": True},
                       scheduler={"max_batch_size": 16, "max_num_tokens": 15}).to_dict()
    data["components"]["graph_cache"] = "tests.engine.test_adaptive_ahead:StaticOutputs"
    data["graphs"] = {"batch_buckets": [4, 8, 16]}
    prompts = [[3 + i, 40 + i, 7, 90 + i, 3 + i, 40 + i] for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    async with AsyncEngine(EngineConfig.from_dict(data), model=tiny_loaded) as engine:
        worker, runner, used = engine.worker, engine.worker.runner, []
        worker.adaptive.burn_in = 0     # K = 0's first samples are the joining ones
        queue_ahead_on_cpu(worker, used)
        prefill, start, finish = worker._prefill, runner.start_read_back, runner.finish_read_back
        behind: list[float] = []        # a prefill queued since the last step
        late: dict[int, float] = {}     # read-backs of steps queued behind a prefill

        def prefill_queued(admitted):
            prefill(admitted)
            behind[:] = [spill]

        def started(packed):
            read = start(packed)
            if behind:
                late[id(read)] = behind.pop()
            return read

        def finished(read):
            time.sleep(late.pop(id(read), 0.0))
            return finish(read)
        worker._prefill = prefill_queued
        runner.start_read_back, runner.finish_read_back = started, finished
        async for _ in engine.generate_batch(prompts, params):
            pass
        cost, joined = worker.adaptive.cost, worker.ahead.joined_steps
    assert joined >= 3 and cost.samples[(16, 0)] >= 3
    # Before the joining iteration was disturbed: T(8, 0) = 0.105 s (a spill learned).
    assert all(t < spill / 2 for t in cost.measured.values()), cost.measured


def test_batch_likely_ends_by_the_rows_tokens_left():
    """``batch_likely_ends``: a row with one token left ends at VERIFY n for certain; with
    ``left`` more, by the acceptance of ``left - 1`` drafts or more (asked only then); the
    rows' product against ENDS_LIKELY; no limit known yet, more left than the step can
    commit, or an empty batch: no."""
    from specloop.engine._ahead import ENDS_LIKELY, batch_likely_ends
    from specloop.engine._request import Request

    def row(length, limit):
        r = Request("r", (1,), SamplingParams(), 0, [1] * length)
        r.stop_length = limit
        return r

    asked = []

    def rates():
        asked.append(1)
        return [0.9, 0.6, 0.2]
    assert ENDS_LIKELY == 0.5
    assert batch_likely_ends([row(9, 10)], 0) and batch_likely_ends([row(9, 10)] * 3, 3, rates)
    assert not asked                                        # certain: no rates asked
    assert not batch_likely_ends([row(8, 10)], 0)           # K = 0 commits one token
    assert batch_likely_ends([row(8, 10)], 3, rates)        # 2 left: P(1+ accepted) 0.9
    assert batch_likely_ends([row(7, 10)], 3, rates)        # 3 left: 0.6
    assert not batch_likely_ends([row(7, 10), row(7, 10)], 3, rates)    # 0.36
    assert batch_likely_ends([row(7, 10), row(9, 10)], 3, rates)        # 0.6 x 1
    assert not batch_likely_ends([row(6, 10)], 3, rates)    # 4 left: 0.2
    assert not batch_likely_ends([row(5, 10)], 3, rates)    # 5 left: past K + 1
    assert not batch_likely_ends([row(8, 10)], 3, lambda: [])   # no acceptance yet
    assert not batch_likely_ends([row(9, 0)], 3, rates)     # no limit known yet
    assert not batch_likely_ends([row(8, 10)], 3)           # no rates: certain ends only
    assert not batch_likely_ends([], 3, rates)


async def test_no_step_is_queued_behind_a_batchs_last_verify(tiny_dir, tiny_loaded):
    """Batch 1, no speculation, requests one after another: the last VERIFY of each
    request (its one token left) queues no step ahead, which nothing would take (device
    work ahead of the next request's prefill); every other iteration takes the step the
    last one queued, and the tokens are the eager path's."""
    prompts = [PROMPTS[0], PROMPTS[1]]

    async def run(ahead):
        log: list[tuple[bool, tuple]] = []
        async with AsyncEngine(make_config(tiny_dir), model=tiny_loaded) as engine:
            worker = engine.worker
            worker.verify_inline = worker.ahead.always = ahead
            _watch(worker, log)
            tokens = []
            for i, p in enumerate(prompts):
                out = []
                async for o in engine.generate(p, _params(7, 2 * i)):
                    out.extend(o.token_ids)
                tokens.append(out)
            skipped = worker.ahead.ends_skipped
        return tokens, log, skipped

    eager, _, _ = await run(False)
    ahead, log, skipped = await run(True)
    assert ahead == eager and [len(t) for t in ahead] == [7, 7]
    assert skipped == 2                         # one a request: its last VERIFY's
    taken = [t for t, _ in log]
    # Each request: its first iteration after prefill queues its own step, then takes.
    assert taken.count(False) == 2 and sum(taken) == len(taken) - 2, taken
