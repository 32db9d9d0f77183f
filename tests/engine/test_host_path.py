"""The host side of an iteration: the per-request output channel, and VERIFY queued from
the event loop (the GPU path) equal to VERIFY in the compute thread."""

import anyio
import pytest

from specloop.engine import AsyncEngine
from specloop.engine._frontdoor_state import OutputChannel
from specloop.engine._request import RequestOutput
from specloop.samplers import SamplingParams

from .conftest import PROMPTS, collect, make_config


def _out(i, finished=False):
    return RequestOutput("r", (i,), "", finished)


async def test_channel_takes_everything_sent_in_order_then_ends():
    channel = OutputChannel()
    for i in range(3):
        channel.put(_out(i))
    assert [o.token_ids for o in await channel.take()] == [(0,), (1,), (2,)]
    got = []

    async def consumer():
        while batch := await channel.take():
            got.extend(o.token_ids[0] for o in batch)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consumer)
        await anyio.sleep(0.01)         # the consumer waits on an empty channel
        channel.put(_out(3))
        channel.put(_out(4))
        await anyio.sleep(0.01)
        channel.put(_out(5, True))
        channel.close()                 # what was put before close is still taken
    assert got == [3, 4, 5]


async def test_channel_take_honours_cancellation_with_items_pending():
    channel = OutputChannel()
    channel.put(_out(0))
    with anyio.CancelScope() as scope:
        scope.cancel()
        await channel.take()
        pytest.fail("take returned in a cancelled scope")
    assert scope.cancelled_caught
    assert len(await channel.take()) == 1     # nothing was lost


@pytest.mark.parametrize("method", ["none", "ngram"])
async def test_verify_from_the_event_loop_equals_the_thread(tiny_dir, tiny_loaded, method):
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True)] * 2

    async def run(inline):
        out = {}
        async with AsyncEngine(make_config(tiny_dir, method=method),
                               model=tiny_loaded) as engine:
            engine.worker.verify_inline = inline

            async def one(i):
                out[i] = await collect(engine, PROMPTS[i], params[i])
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i)
        return [out[i] for i in range(4)]

    assert await run(True) == await run(False)


async def test_step_queued_ahead_equals_the_thread(tiny_dir, tiny_loaded):
    """No speculation, VERIFY queueing the next step before reading this one back: equal
    to the thread path token for token with rows ending at different iterations (stop
    tokens, EOS, lengths), requests waiting for a slot, a consumer leaving early and
    seeded sampled rows; the step queued ahead is used, also for the rows left when
    requests finished, and for requests that joined (admitted while it ran, they join
    in the next step queued ahead: tests/engine/test_ahead_steady.py); every page is
    free at the end."""
    stops = tuple(range(40, 80))            # ~10% of the vocabulary: rows end early
    params = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_tokens=20, stop_token_ids=stops),
              SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=stops),
              SamplingParams(temperature=0.7, seed=9, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=2, max_tokens=25),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]

    async def run(ahead):
        out, used = {}, []
        # max_seq_len 48: the last row ends by the cache's length, not max_tokens.
        async with AsyncEngine(make_config(tiny_dir, max_seq_len=48),
                               model=tiny_loaded) as engine:
            worker = engine.worker
            worker.verify_inline = worker.ahead.always = ahead
            take = worker.ahead.take

            def counted(rec):
                queued = worker.ahead.queued
                pending, rows = take(rec)
                # None: queued nothing; then whether it was used, and for fewer rows.
                used.append(None if queued is None else (
                    pending is not None, pending is not None and len(rows) < len(queued.batch)))
                return pending, rows
            worker.ahead.take = counted

            async def one(i):
                out[i] = await collect(engine, prompts[i], params[i])

            async def leaves_early():
                async for _ in engine.generate(PROMPTS[1], params[3]):
                    break
            async with anyio.create_task_group() as tg:
                for i in range(len(params)):
                    tg.start_soon(one, i)
                tg.start_soon(leaves_early)
            for _ in range(50):             # the early leaver's cancel lands
                if worker.scheduler.num_requests == 0:
                    break
                await anyio.sleep(0.01)
            pages = worker.runner.pages
            assert pages.num_free == pages.num_pages
        return [out[i] for i in range(len(params))], used

    thread, _ = await run(False)
    ahead, used = await run(True)
    assert ahead == thread
    taken = [u for u in used if u is not None]
    assert any(u[0] for u in taken)                     # used as queued
    assert any(u[1] for u in taken)                     # used after requests left
    assert used[0] is None                              # nothing before the first


def test_sampling_rows_padded_to_the_batch_size_are_built_once():
    """PICK_GRAPH_KEY's unpadded rows and the graph's rows padded to a bucket equal to the
    batch are one SamplingBatch (one build, one copy to the device, per batch change);
    another padding has its own, and neither evicts the other. At a batch change the
    unpadded rows (SYNC asks first) are the real rows of the padding in use (views), and
    that padding's rows are built once for both; a request leaving keeps the columns it
    did not change (the same tensors: not copied again)."""
    from types import SimpleNamespace

    import torch

    from specloop.engine._worker import RankWorker

    class Worker:
        _sampling_batch = RankWorker._sampling_batch

        def __init__(self):
            self._sampling_cache = {}
            self.runner = SimpleNamespace(device=torch.device("cpu"))

    worker = Worker()
    batch = [SimpleNamespace(params=SamplingParams(temperature=t), seed=s)
             for t, s in ((0.0, 1), (0.7, 2))]
    plain = worker._sampling_batch(batch, None)
    assert worker._sampling_batch(batch, 2) is plain
    padded = worker._sampling_batch(batch, 4)
    assert padded.size == 4 and plain.size == 2
    assert worker._sampling_batch(batch, None) is plain
    assert worker._sampling_batch(batch, 4) is padded
    # A request left: SYNC's unpadded rows first, then the graph's padding.
    smaller = worker._sampling_batch(batch[1:], None)
    smaller_padded = worker._sampling_batch(batch[1:], 4)
    assert smaller.size == 1 and smaller_padded.size == 4
    assert smaller.seeds.data_ptr() == smaller_padded.seeds.data_ptr()     # views
    assert smaller.any_greedy is False and smaller_padded.any_greedy is True
    assert smaller_padded.seeds.tolist() == [2, 0, 0, 0]
    assert smaller_padded.top_p is padded.top_p and smaller_padded.min_p is padded.min_p
    assert smaller_padded.seeds is not padded.seeds


def test_request_output_builds_as_attrs_would():
    """RequestOutput's own __init__ (the slots' setters, per request per iteration) keeps
    attrs' class: defaults, keywords, frozen, equality and hash, evolve, pickling."""
    import pickle

    import attrs

    from specloop.engine import FinishReason
    a = RequestOutput("r", (1, 2), "x")
    assert attrs.astuple(a) == ("r", (1, 2), "x", False, None, None)
    b = RequestOutput(request_id="r", token_ids=(1, 2), text="x", finished=False)
    assert a == b and hash(a) == hash(b) and repr(a) == repr(b)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        a.text = "y"
    c = attrs.evolve(a, text="y", finished=True, finish_reason=FinishReason.STOP, error="e")
    assert attrs.astuple(c) == ("r", (1, 2), "y", True, FinishReason.STOP, "e")
    assert pickle.loads(pickle.dumps(c)) == c and a != c


def test_a_full_batchs_rows_at_a_join_build_nothing(monkeypatch):
    """At the largest padding (a server's load at the largest bucket: a request ends and
    one joins nearly every iteration), an all-greedy batch's unpadded rows are the first
    rows of an all-greedy batch built before (views: nothing built, nothing copied); a
    batch with a sampled row is then built from the real rows kept (``changed``), not
    from every row's params."""
    from types import SimpleNamespace

    import torch

    from specloop.engine._worker import RankWorker
    from specloop.samplers import SamplingBatch

    class Worker:
        _sampling_batch = RankWorker._sampling_batch

        def __init__(self):
            self._sampling_cache = {}
            self.runner = SimpleNamespace(device=torch.device("cpu"))

    def request(t, seed):
        params = SamplingParams(temperature=t)
        return SimpleNamespace(params=params, seed=seed, greedy=params.is_greedy)

    worker = Worker()
    batch = [request(0.0, s) for s in range(4)]
    first = worker._sampling_batch(batch, None)        # built once
    built = []
    real = SamplingBatch.from_params.__func__
    monkeypatch.setattr(SamplingBatch, "from_params", classmethod(
        lambda cls, *a, **kw: built.append(len(a[0])) or real(cls, *a, **kw)))
    joined = [*batch[1:], request(0.0, 9)]              # one ended, one joined
    rows = worker._sampling_batch(joined, None)
    assert built == [] and rows.size == 4 and rows.all_greedy and rows.num_real == 4
    # The very tensors, not views of them: a graph replay copies every input tensor it
    # has not seen (CudaGraphCache.replay compares by identity), and new views at every
    # join copied all six columns into the graphs' inputs (~8 device copies an iteration
    # at batch 32 under a server's load, bench/bench_chain_host.py --steady).
    assert all(getattr(rows, n) is getattr(first, n) for n in SamplingBatch.COLUMNS)
    assert worker._sampling_batch(joined, None) is rows
    again = worker._sampling_batch([*joined[1:], request(0.0, 10)], None)
    assert all(getattr(again, n) is getattr(first, n) for n in SamplingBatch.COLUMNS)
    # A sampled request joins: built from the params once (the greedy rows' seeds were
    # another batch's); at the next change the rows kept are sliced, only the new built.
    sampled = [*joined[1:], request(0.8, 5)]
    assert not worker._sampling_batch(sampled, None).all_greedy and built == [4]
    again = [*sampled[1:], request(0.9, 6)]
    got = worker._sampling_batch(again, None)
    assert built == [4]
    want = SamplingBatch.from_params([r.params for r in again], [r.seed for r in again])
    for name in SamplingBatch.COLUMNS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.row_flags == want.row_flags and not got.all_greedy


def test_a_requests_greedy_is_its_params():
    """``Request.greedy`` (read at every batch change, a C-level pass) is
    ``params.is_greedy``: temperature 0, or top-k 1 at any temperature."""
    from specloop.engine._request import Request

    for params, greedy in ((SamplingParams(temperature=0.0), True),
                           (SamplingParams(temperature=0.7, top_k=1), True),
                           (SamplingParams(temperature=0.7), False),
                           (SamplingParams(temperature=1.0, top_p=0.9), False)):
        r = Request("r", (1, 2), params, 0, [1, 2])
        assert r.greedy is greedy is params.is_greedy
