"""Adaptive K's K = 0 as cheap as no speculation: the whole iteration is timed, and on one
GPU rank a K = 0 stretch queues each step ahead (the next iteration committed to K = 0)."""

import copy
import time

import anyio
import pytest
import torch

from specloop.engine import AsyncEngine, EngineConfig
from specloop.engine._adaptive import (EXPLORE_EVERY, FIRST_DISTURBED, FIRST_SAMPLES, RECENT,
                                       AdaptiveK, CostTable, IterationClock)
from specloop.samplers import SamplingParams

from ..graphs.test_static_steps import StepReplayCache
from .conftest import PROMPTS, collect, make_config
from .test_adaptive import KS, check_first_drafts, cycle_k, record_first_drafts
from .test_engine import reference_greedy


class StaticOutputs(StepReplayCache):
    """As a CUDA graph: every replay of a key writes into the same output tensors (a
    step queued ahead overwrites the outputs of the one before it)."""

    def replay(self, key, inputs):
        out = super().replay(key, inputs)
        kept = self._graphs[key]
        if getattr(kept, "outputs", None) is None:
            kept.outputs = {name: t.clone() for name, t in out.items()}
        else:
            for name, t in out.items():
                kept.outputs[name].copy_(t)
        return kept.outputs


def ahead_config(tiny_dir, method, **kw):
    data = make_config(tiny_dir, method=method, k=3, speculative={"adaptive": True},
                       **kw).to_dict()
    data["components"]["graph_cache"] = "tests.engine.test_adaptive_ahead:StaticOutputs"
    data["graphs"] = {"batch_buckets": [1, 2, 4]}
    return EngineConfig.from_dict(data)


def queue_ahead_on_cpu(worker, used):
    """The one-GPU-rank path on CPU; ``used`` gets, per VERIFY, whether it took a step
    queued ahead."""
    worker.verify_inline = worker.ahead.at_k0 = True
    take = worker.ahead.take

    def counted(rec):
        pending, rows = take(rec)
        used.append(pending is not None)
        return pending, rows
    worker.ahead.take = counted


# The rule's side --------------------------------------------------------------------------
def test_next_k_is_the_next_choice():
    """next_k(b, k) is the next choice taken now (this iteration's time not known yet):
    first samples, the rule, exploration alike; ``commit`` holds the next choice to it
    (one choice only); ``stay`` gives k whatever the rule says."""
    cost = CostTable({(b, k): 0.001 * (1 + 0.2 * k * b) for b in (1, 8) for k in KS})
    adaptive = AdaptiveK(KS, cost)
    adaptive.record(3, [3, 2, 3, 1, 0, 3, 2])
    ks, k = set(), 0
    for i in range(EXPLORE_EVERY + 40):
        batch = 1 if i < EXPLORE_EVERY // 2 else 8        # the rule's choice flips
        twin = copy.deepcopy(adaptive)
        twin._measured_us = 0                   # the time not known yet
        early = twin.choose([twin.facts()], batch)
        assert adaptive.next_k(batch, k) == early, i
        if i % 2:
            adaptive.commit(early)
        k = adaptive.choose([adaptive.facts()], batch)
        assert k == early or not i % 2, i
        adaptive.measured(0.001 * (1 + 0.2 * k * batch))
        ks.add(k)
    assert ks == set(KS)
    # K = 3 wins at batch 1 with this acceptance, yet ``stay`` keeps K = 1, and a
    # commitment to it holds one choice.
    fresh = AdaptiveK(KS, CostTable({(1, k): 1.0 + 0.01 * k for k in KS}, learn=False))
    fresh.record(3, [3] * 8)
    assert fresh.next_k(1, 1) == 3 and fresh.next_k(1, 1, stay=True) == 1
    fresh.commit(1)
    assert fresh.choose([fresh.facts()], 1) == 1
    assert fresh.choose([fresh.facts()], 1) == 3
    # The summary's ``ways``: the committed choice came by ``stay``, the next by the rule.
    assert fresh.summary()["ways"] == {"stay": {1: 1}, "rule": {3: 1}}


# The worker's side ------------------------------------------------------------------------
async def test_iteration_is_timed_start_to_start_without_prefill(tiny_dir, tiny_loaded):
    """T(b, k) is one iteration from the start of SCHEDULE to the start of the next: the
    front-door exchange and the outputs' delivery count, prefill does not."""
    config = make_config(tiny_dir, method="ngram", k=3, speculative={"adaptive": True})
    times = []
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        worker = engine.worker
        measured, exchange, prefill = (worker.adaptive.measured, worker.exchange,
                                       worker._prefill)

        async def slow_exchange(*args):
            if worker.scheduler.num_requests:
                await anyio.sleep(0.02)         # delivering outputs, taking new requests
            return await exchange(*args)

        def slow_prefill(admitted):
            anyio.from_thread.run(anyio.sleep, 0.3)
            prefill(admitted)
        worker.exchange, worker._prefill = slow_exchange, slow_prefill
        worker.adaptive.measured = lambda s, full=None: (times.append(s), measured(s, full))
        await collect(engine, PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8,
                                                         ignore_eos=True))
    # The first iteration's exchange waited for the request: all of it left out.
    assert len(times) >= 3 and all(t < 0.3 for t in times), times
    assert all(t >= 0.02 for t in times[1:]), times


@pytest.mark.parametrize("ahead", [False, True])
async def test_admitting_iterations_do_not_make_k0_look_dear(tiny_dir, tiny_loaded, ahead):
    """A closed round whose admission spans several iterations: on a GPU, VERIFY waits
    behind the prefill's kernels (here: a read-back 100 ms late after each prefill), and
    the next iteration's admission keeps a step from being queued ahead. K = 0's first
    samples fall on those iterations (the rule tries K = 0 first), yet T(16, 0) must be
    what an iteration at K = 0 costs without them (the H200 at batch 128 learned 3 ms
    against 2.4 for K = 3 and drafted where no speculation was faster). ``ahead``: one
    GPU rank's path (K = 0 stretches queue their steps ahead; which iterations it times).
    The spill is long beside an iteration of the tiny model on a busy 2-core box (20-110 ms
    seen with two suites running at once; 0.1 s failed there), so that only a spill
    learned as K = 0's time crosses half of it."""
    spill = 0.3
    config = make_config(tiny_dir, method="ngram", k=3, speculative={"adaptive": True},
                         scheduler={"max_batch_size": 16, "max_num_tokens": 15})
    if ahead:
        data = config.to_dict()
        data["components"]["graph_cache"] = "tests.engine.test_adaptive_ahead:StaticOutputs"
        data["graphs"] = {"batch_buckets": [4, 8, 16]}
        config = EngineConfig.from_dict(data)
    prompts = [[3 + i, 40 + i, 7, 90 + i, 3 + i, 40 + i] for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        worker, late, used = engine.worker, [], []
        worker.adaptive.burn_in = 0     # K = 0's first samples are the admitting ones
        if ahead:
            queue_ahead_on_cpu(worker, used)
        prefill, read_back = worker._prefill, worker.runner.finish_read_back

        def prefill_queued(admitted):
            prefill(admitted)
            late.append(spill)          # its kernels still run when VERIFY is read back

        def waits_behind_prefill(pending):
            if late:
                time.sleep(late.pop())
            return read_back(pending)
        worker._prefill, worker.runner.finish_read_back = prefill_queued, waits_behind_prefill
        async for _ in engine.generate_batch(prompts, params):
            pass
        cost = worker.adaptive.cost
    # 3 prompts an iteration: batches 3, 6, 9, 12, 15, 16; (16, 0)'s first 3 timed admit.
    assert cost.samples[(16, 0)] >= FIRST_SAMPLES
    assert cost.measured[(16, 0)] < spill / 2, cost.measured
    assert not ahead or sum(used) >= 3


def test_disturbed_iterations_are_learned_only_where_nothing_else_is():
    """Steady load at a large batch: every iteration admits, so every K settles on its
    FIRST_DISTURBED disturbed iterations (the rule does not wait for undisturbed ones);
    once one undisturbed iteration is measured, disturbed ones no longer move T."""
    cost = CostTable({(1, k): 0.001 for k in KS})
    adaptive = AdaptiveK(KS, cost)
    picks = []
    for _ in range(FIRST_DISTURBED * len(KS) + 1):
        k = adaptive.choose([adaptive.facts()], 1)
        picks.append(k)
        adaptive.measured(0.002 + 0.001 * k)
        adaptive.disturb()
    assert picks[:-1] == [k for k in KS for _ in range(FIRST_DISTURBED)]
    assert cost.measured == {(1, k): pytest.approx(0.002 + 0.001 * k) for k in KS}
    cost.observe(1, 2, 0.010)                       # undisturbed: learned, and the
    after = cost.measured[(1, 2)]                   # disturbed ones before it leave T's
    assert after == 0.010                           # window
    cost.observe(1, 2, 0.010)
    assert cost.measured[(1, 2)] == 0.010
    cost.observe(1, 2, 0.100, disturbed=True)       # now left out
    assert cost.measured[(1, 2)] == after and cost.ignored == 1
    for _ in range(RECENT):                         # K = 3 has no undisturbed one yet
        cost.observe(1, 3, 0.100, disturbed=True)
    assert cost.measured[(1, 3)] == 0.100 and cost.ignored == 1
    # One undisturbed iteration, then only disturbed ones: settled all the same (on the
    # undisturbed time), not held at its first samples for good.
    cost = CostTable({(1, k): 0.001 for k in KS})
    for i in range(FIRST_DISTURBED):
        cost.observe(1, 0, 0.002 if i == 0 else 0.009, disturbed=i > 0)
        assert not cost.tried(1, 0)
    cost.observe(1, 0, 0.009, disturbed=True)
    assert cost.tried(1, 0) and cost.measured[(1, 0)] == 0.002


def _fake_events(done: bool, elapsed_ms: float | None = None,
                 read: list[int] | None = None) -> type:
    """CUDA events whose ``query`` says ``done``; ``elapsed_time`` gives ``elapsed_ms``
    (noted in ``read``), or fails where the clock must not read it (None), as does
    ``synchronize`` (the clock never waits for a prefill)."""
    class Event:
        def __init__(self, enable_timing):
            pass

        def record(self, stream):
            pass

        def query(self):
            return done

        def synchronize(self):
            raise AssertionError("the clock waited for the prefill")

        def elapsed_time(self, end):
            if elapsed_ms is None:
                raise AssertionError("timed an iteration that did not wait for its prefill")
            if read is not None:
                read.append(1)
            return elapsed_ms
    return Event


def _clock_on_fake_cuda(monkeypatch, event: type, stream: object = None):
    """An adaptive rule's clock on a GPU rank whose CUDA events are ``event`` and whose
    current stream is ``stream``, on a host clock the test moves (``now[0]``, seconds);
    -> (now, the rule, the clock, started: one ``tick`` made)."""
    now = [100.0]
    monkeypatch.setattr(torch.cuda, "Event", event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: stream)
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])   # the clock's module's too
    adaptive = AdaptiveK(KS, CostTable({(1, k): 0.001 for k in KS}))
    clock = IterationClock(adaptive, device=torch.device("cuda"))
    clock.tick()
    return now, adaptive, clock


def test_clock_leaves_out_the_prefills_device_time(monkeypatch):
    """On a GPU the prefill's kernels run after the host queued them; VERIFY waits for
    them. The clock leaves out the longer of the host's and the device's time for the
    prefill (CUDA events, faked here: 50 ms on the device, 10 ms on the host) and marks
    the iteration, and the one before it, disturbed (a negative time in the facts)."""
    made, records = [], []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing
            made.append(self)

        def record(self, stream):
            assert stream == "the current stream"
            records.append("record")

        def query(self):
            return True     # VERIFY's read-back waited behind the prefill

        def elapsed_time(self, end):
            return 50.0
    now, adaptive, clock = _clock_on_fake_cuda(monkeypatch, Event, "the current stream")
    clock.timed = True
    now[0] += 0.005
    clock.tick()                    # an iteration of 5 ms, undisturbed so far ...
    clock.timed = True
    assert adaptive._measured_us == 5000
    mark = clock.prefill_started()  # ... but the next one admits
    assert not records
    # The events are recorded by the compute thread's job, around the prefill: no CUDA
    # call on the loop thread (it would wait for the GIL held by the compute thread).
    assert clock.on_device(lambda: records.append("prefill") or 7)() == 7
    assert records == ["record", "prefill", "record"]
    now[0] += 0.010
    clock.prefill_done(mark)
    assert len(records) == 3
    assert adaptive.facts()[-1] == -5000
    now[0] += 0.060                 # VERIFY: 40 ms behind the prefill, 20 ms its own
    clock.tick()
    assert adaptive.facts()[-1] == -20000
    clock.timed = True              # the next one admits too: the same two events again
    mark = clock.prefill_started()
    clock.on_device(lambda: None)()
    clock.prefill_done(mark)
    now[0] += 0.060
    clock.tick()
    assert adaptive.facts()[-1] == -10000 and len(made) == 2
    # Without adaptive K, or off a GPU, the prefill runs as it is.
    job = lambda: None  # noqa: E731
    assert IterationClock(None, device=torch.device("cuda")).on_device(job) is job
    assert IterationClock(adaptive, device=torch.device("cpu")).on_device(job) is job


def test_clock_does_not_wait_for_a_prefill_nobody_waited_for(monkeypatch):
    """When the prefilling iteration's VERIFY took a step queued before the prefill
    (newcomers held back an iteration), its kernels may still run at the next tick: the
    clock neither waits for them (no synchronize: the host would stall behind the GPU)
    nor learns that iteration's time (it would subtract a device time it did not wait
    for); the next iteration is timed again."""
    Event = _fake_events(done=False)    # still running
    now, adaptive, clock = _clock_on_fake_cuda(monkeypatch, Event)
    clock.timed = True
    mark = clock.prefill_started()
    clock.on_device(lambda: None)()
    clock.prefill_done(mark)
    now[0] += 0.004
    clock.tick()
    assert adaptive.facts()[-1] == 0        # nothing learned from it
    clock.timed = True
    now[0] += 0.003
    clock.tick()
    assert adaptive.facts()[-1] == 3000


def test_clock_reads_the_prefills_device_time_only_where_the_rule_can_use_it(monkeypatch):
    """Reading the prefill's device time (``elapsed_time``) is a CUDA call on the loop
    thread, a GIL handoff to the compute thread, under a server's load nearly every
    iteration. A prefilling iteration is disturbed: the rule learns its seconds only at a
    (bucket, K) with no undisturbed sample yet; its time with the prefill (X(b)'s) does
    not depend on the device time. So on one rank, where the next choice is committed
    (its ``choose_committed`` alone reads the time), the clock reads the events only
    while its K has no undisturbed sample; a choice from the facts (a group sends them)
    always has them read. Either way the time with the prefill is the same."""
    read: list[int] = []
    Event = _fake_events(done=True, elapsed_ms=2.0, read=read)     # ms: 1 beyond the host's
    now, adaptive, clock = _clock_on_fake_cuda(monkeypatch, Event)

    def iteration(prefill: bool, commit: bool) -> None:
        if adaptive.committed:
            k = adaptive.choose_committed(1)
        else:
            k = adaptive.choose([adaptive.facts()], 1)
        clock.timed = True
        if prefill:
            mark = clock.prefill_started()
            clock.on_device(lambda: None)()
            now[0] += 0.001
            clock.prefill_done(mark)
        if commit:
            adaptive.commit(k)
        now[0] += 0.004
        clock.tick()
        assert adaptive._full_us == (5000 if prefill else 4000)

    iteration(prefill=True, commit=False)       # a choice from the facts: read
    assert read == [1] and adaptive._measured_us == -3000
    iteration(prefill=True, commit=True)        # K = 0 has no undisturbed sample: read
    assert read == [1, 1] and adaptive._measured_us == -3000
    iteration(prefill=False, commit=True)       # its first undisturbed one
    iteration(prefill=True, commit=True)        # then disturbed ones: not read
    iteration(prefill=True, commit=True)
    assert read == [1, 1] and adaptive._measured_us < 0
    iteration(prefill=True, commit=False)       # a choice from the facts: read
    assert read == [1, 1, 1] and adaptive._measured_us == -3000
    assert adaptive.cost.samples[(1, 0)] == 3 and adaptive.cost.ignored == 2


async def test_k0_stretch_queues_ahead_and_keeps_the_head_current(tiny_dir, tiny_loaded):
    """One GPU rank's path (on CPU, outputs reused by every replay as CUDA graphs do):
    K = 0 iterations followed by K = 0 take a step queued ahead; greedy equals no
    speculation and every first draft equals the head run afresh (the rows of steps
    queued ahead reach the head, none lost to the next step's outputs)."""
    prompt, n = [5, 17, 99, 3, 42], 60
    seen, used = [], []
    async with AsyncEngine(ahead_config(tiny_dir, "eagle3"), model=tiny_loaded) as engine:
        queue_ahead_on_cpu(engine.worker, used)
        # K = 0 first: the first draft catches the head up over every row since the prompt.
        cycle_k(engine.worker.adaptive, [0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0,
                                         1, 3])
        worker, drafter = engine.worker, engine.worker.drafter
        record_first_drafts(drafter, seen)
        on_verified, rows = worker.on_verified, []

        def recording(slots, start_pos, hidden, accepted):
            rows.append((start_pos[0], hidden[0, :accepted[0] + 1].clone()))
            on_verified(slots, start_pos, hidden, accepted)
        worker.on_verified = recording
        out = await collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                           ignore_eos=True))
    assert out == reference_greedy(tiny_loaded, prompt, n)
    check_first_drafts(tiny_loaded, drafter, prompt, out, seen)
    assert len(seen) >= 6 and sum(used) >= 15, (len(seen), sum(used))
    # The rows the head was handed are the target's at their positions.
    model, full = tiny_loaded.model, torch.tensor([prompt + out])
    with torch.inference_mode():
        features = model(full, torch.tensor([0]), torch.tensor([0]), model.make_cache(1, 256),
                         capture=drafter.feature_layers)[1][0]
    assert len(rows) >= 40
    for start, got in rows:
        torch.testing.assert_close(got, features[start:start + len(got)])


async def test_steps_queued_ahead_change_no_token(tiny_dir, tiny_loaded):
    """The same K per iteration with and without steps queued ahead: the same tokens for
    every request, seeded sampled ones with rejection sampling included, and requests
    ending at different iterations (the step queued ahead is then used for fewer rows)."""
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=8, max_tokens=21, ignore_eos=True)]
    pattern = [2, 0, 0, 0, 0, 1, 0, 0, 3, 0, 0, 0, 0, 0, 0]

    async def run(ahead):
        used = []
        config = ahead_config(tiny_dir, "mtp_eagle", rejection=True)
        async with AsyncEngine(config, model=tiny_loaded) as engine:
            if ahead:
                queue_ahead_on_cpu(engine.worker, used)
            cycle_k(engine.worker.adaptive, pattern)
            tokens = {}
            async for outs in engine.generate_batch(PROMPTS[:4], params):
                for o in outs:
                    tokens.setdefault(o.request_id, []).extend(o.token_ids)
        return [tokens[i] for i in sorted(tokens)], used

    plain, _ = await run(False)
    ahead, used = await run(True)
    assert ahead == plain
    assert sum(used) >= 10
    for prompt, p, out in zip(PROMPTS, params, ahead):
        if p.is_greedy:
            assert out == reference_greedy(tiny_loaded, prompt, p.max_tokens)


@pytest.mark.parametrize("method", ["ngram", "mtp_eagle"])
async def test_k0_stretches_take_a_page_once_per_page(tiny_dir, tiny_loaded, method):
    """Adaptive K's K = 0 stretch on one GPU rank's path: DRAFT reserves for the K it
    runs (VERIFY's one position at K = 0), not the drafter's K, and a reservation never
    gives pages back (RESCAN's trim does), so the page table changes once per page of
    tokens; before, DRAFT took a page for K positions that the step queued ahead then
    gave back, a table copy nearly every iteration. Outputs equal reading back each step."""
    from specloop.models import _cache

    syncs = []
    sync = _cache.PageTable.sync

    def counted(self):
        syncs.append(bool(self._dirty))
        return sync(self)
    tokens = 96
    config = ahead_config(tiny_dir, method)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        worker, used = engine.worker, []
        queue_ahead_on_cpu(worker, used)
        cycle_k(worker.adaptive, [0])
        page = worker.runner.pages.page_size
        _cache.PageTable.sync = counted
        try:
            out = await collect(engine, PROMPTS[0], params)
        finally:
            _cache.PageTable.sync = sync
    assert out == reference_greedy(tiny_loaded, PROMPTS[0], tokens)
    assert sum(used) >= tokens - 4      # K = 0 steps queued ahead and taken
    assert sum(syncs) <= tokens // page + 4, (sum(syncs), len(syncs))
