"""Unit tests of rank 0's front door (engine/_frontdoor.py, _frontdoor_state.py), without an
engine: routing new requests to ranks, cancels, abandoned streams, shutdown, and how long a
request id stays reserved."""

import collections

import anyio
import anyio.lowlevel
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specloop.engine._frontdoor import assign_least_loaded
from specloop.engine._frontdoor_state import FrontDoor, OutputChannel
from specloop.engine._request import FinishReason, NewRequest, RequestOutput
from specloop.engine._wire import encode_rows
from specloop.samplers import SamplingParams


def new(i: int, request_id: str | None = None) -> NewRequest:
    return NewRequest(request_id or f"r{i}", (1, 2, 3), SamplingParams(), seed=i, handle=i)


def one_rank(batch: list[NewRequest]) -> tuple[tuple[int, NewRequest], ...]:
    return tuple((0, n) for n in batch)


def ids(message) -> list[str]:
    return [n.request_id for _, n in message.assignments]


K = 2


def block(handle: int, output: RequestOutput) -> bytes:
    """Another rank's output block as the exchange carries it (int64 bytes, 2 rows)."""
    flat = encode_rows([(handle, output)], 2, K)
    assert flat is not None
    return flat.tobytes()


def final(request_id: str, reason: FinishReason = FinishReason.STOP) -> RequestOutput:
    return RequestOutput(request_id, (7,), "", True, reason)


async def take(channel: OutputChannel) -> list[RequestOutput]:
    with anyio.fail_after(1):
        return await channel.take()


async def test_submitted_requests_go_out_once_in_order_and_ids_stay_reserved():
    door = FrontDoor()
    channels = [door.submit(new(i)) for i in range(3)]
    assert door.has_news and door.open_request_ids == {"r0", "r1", "r2"}
    message = door.take_message(one_rank)
    assert ids(message) == ["r0", "r1", "r2"] and not message.shutdown
    assert not door.has_news and ids(door.take_message(one_rank)) == []
    with pytest.raises(ValueError, match="live"):
        door.submit(new(9, "r1"))           # still being served
    # Another rank's outputs come as the exchange's blocks, named by handle.
    door.deliver_blocks([block(1, RequestOutput("", (5,), "", False))], K)
    assert "r1" in door.open_request_ids
    door.deliver([final("r1")])
    assert "r1" not in door.open_request_ids
    assert [o.token_ids for o in await take(channels[1])] == [(5,), (7,)]
    assert await take(channels[1]) == []    # closed by the final output
    door.deliver([RequestOutput("r1", (8,), "", False)])    # not live: dropped
    door.deliver_blocks([block(1, RequestOutput("", (8,), "", False))], K)    # so is its handle
    door.submit(new(4, "r1"))               # reusable once final


async def test_cancel_ends_a_queued_request_here_and_sends_a_running_ones_once():
    door = FrontDoor()
    running = door.submit(new(0))
    door.take_message(one_rank)
    queued = door.submit(new(1))
    door.cancel("r1")                       # never handed out: ended here, at once
    (out,) = await take(queued)
    assert out.finished and out.finish_reason is FinishReason.CANCELLED
    door.cancel("r0")
    door.cancel("r0")                       # asked twice, sent once
    door.cancel("unknown")                  # ignored
    message = door.take_message(one_rank)
    assert ids(message) == [] and message.cancels == ("r0",)
    assert "r0" in door.open_request_ids    # until its rank sends the final output
    door.deliver([final("r0", FinishReason.CANCELLED)])
    assert (await take(running))[-1].finish_reason is FinishReason.CANCELLED


async def test_a_cancel_not_yet_sent_never_reaches_a_request_reusing_the_id():
    door = FrontDoor()
    door.submit(new(0))
    door.take_message(one_rank)
    door.cancel("r0")
    door.deliver([final("r0")])             # it finished before the cancel went out
    door.submit(new(1, "r0"))
    assert door.take_message(one_rank).cancels == ()


async def test_abandon_closes_the_stream_cancels_and_keeps_the_id_until_final():
    door = FrontDoor()
    channel = door.submit(new(0))
    door.take_message(one_rank)
    door.abandon("r0")
    door.abandon("r0")                      # never raises
    assert await take(channel) == []        # the consumer's stream ended
    assert door.take_message(one_rank).cancels == ("r0",)
    assert "r0" in door.open_request_ids
    door.deliver([final("r0", FinishReason.CANCELLED)])
    assert door.open_request_ids == set()


async def test_a_consumer_leaving_late_never_ends_a_request_reusing_its_id():
    """The final output is delivered (the id released) but not yet taken when its consumer
    leaves (a timeout fired on a loaded host); meanwhile a new request took the id. The
    late consumer's ``abandon`` names its own request (the handle) and touches nothing of
    the new one: its stream stays open, no cancel goes out. (Found by
    test_lifecycle_props.py's steps-queued-ahead property on a busy 2-core box: the new
    request's stream ended with no final output.)"""
    door = FrontDoor()
    old = door.submit(new(0, "a"))
    door.take_message(one_rank)
    door.deliver([final("a")])              # released; still in the old channel
    fresh = door.submit(new(1, "a"))
    door.abandon("a", 0)                    # the old consumer leaves now
    message = door.take_message(one_rank)
    assert ids(message) == ["a"] and message.cancels == ()
    assert "a" in door.open_request_ids
    door.deliver([RequestOutput("a", (5,), "", False)])
    assert [o.token_ids for o in await take(fresh)] == [(5,)]      # still its stream
    assert (await take(old))[0].finished                          # the old one's final
    door.abandon("a", 1)                    # its own consumer leaving does end it
    assert await take(fresh) == [] and door.take_message(one_rank).cancels == ("a",)


async def test_closing_cancels_what_was_not_handed_out_and_shuts_the_group_down():
    door = FrontDoor()
    running = door.submit(new(0))
    door.take_message(one_rank)
    late = door.submit(new(1))
    door.close()
    message = door.take_message(one_rank)
    assert message.shutdown and ids(message) == []
    assert (await take(late))[0].finish_reason is FinishReason.CANCELLED
    door.close_all(FinishReason.ERROR, "boom")
    (out,) = await take(running)
    assert (out.finished, out.finish_reason, out.error) == (True, FinishReason.ERROR, "boom")
    assert door.open_request_ids == set()


async def test_wait_for_work_returns_on_news_and_times_out_without():
    door = FrontDoor()
    with anyio.fail_after(1):
        await door.wait_for_work(timeout=0.01)      # nothing: the timeout ends it
    door.submit(new(0))
    with anyio.fail_after(0.5):
        await door.wait_for_work(timeout=None)      # news: at once


def test_assignment_goes_to_the_least_loaded_rank_lowest_on_ties():
    got = assign_least_loaded([new(i) for i in range(4)], [2, 0, 1])
    assert [rank for rank, _ in got] == [1, 1, 2, 0]
    assert [n.request_id for _, n in got] == ["r0", "r1", "r2", "r3"]


@settings(max_examples=60, deadline=None)
@given(loads=st.lists(st.integers(0, 6), min_size=1, max_size=5), count=st.integers(0, 12))
def test_each_assignment_takes_a_least_loaded_rank(loads, count):
    got = assign_least_loaded([new(i) for i in range(count)], loads)
    current = list(loads)
    for rank, _ in got:
        assert current[rank] == min(current)
        assert rank == current.index(min(current))
        current[rank] += 1
    assert len(got) == count


async def test_cancelled_consumers_stop_while_outputs_keep_coming():
    """Consumers cancelled by their task group stop within a bounded number of outputs
    even when an output wakes each of them every cycle (a busy engine): anyio does not
    cancel a task whose future is already done (it went on for ~27k iterations)."""
    channels = [OutputChannel() for _ in range(16)]
    taken = [0] * len(channels)
    cycles = 0

    async def consume(i: int) -> None:
        while await channels[i].take():
            taken[i] += 1

    async def produce() -> None:
        nonlocal cycles
        while cycles < 2000:    # an engine iteration: one output per request, a yield
            for channel in channels:
                channel.put(RequestOutput("r", (7,), ""))
            cycles += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as outer:
        outer.start_soon(produce)
        with anyio.fail_after(5):
            async with anyio.create_task_group() as consumers:
                for i in range(len(channels)):
                    consumers.start_soon(consume, i)
                while min(taken) < 3:
                    await anyio.lowlevel.checkpoint()
                at = cycles
                consumers.cancel_scope.cancel()
        assert cycles - at <= 40, cycles - at      # was: until the producer stopped
        outer.cancel_scope.cancel()



async def test_channels_started_together_check_for_cancellation_apart(monkeypatch):
    """A consumer checks for cancellation at every 16th wake; channels created together
    (requests that start at once) each from a phase of their own, so an iteration that
    wakes 32 of them runs 2 checks, not 32 in one iteration out of 16 (a ~0.3 ms spike at
    128 consumers on the CPU)."""
    from specloop.engine import _frontdoor_state
    checks: list[int] = []
    cycle = 0
    real = anyio.lowlevel.checkpoint_if_cancelled

    async def counted():
        checks.append(cycle)
        await real()
    monkeypatch.setattr(_frontdoor_state.anyio.lowlevel, "checkpoint_if_cancelled", counted)
    channels = [OutputChannel() for _ in range(32)]

    async def consume(channel):
        while await channel.take():
            pass

    async with anyio.create_task_group() as tg:
        for channel in channels:
            tg.start_soon(consume, channel)
        await anyio.sleep(0.01)             # every consumer waits
        for cycle in range(1, 65):          # an iteration: an output for each, a yield
            for channel in channels:
                channel.put(RequestOutput("r", (7,), ""))
            for _ in range(3):
                await anyio.lowlevel.checkpoint()
        for channel in channels:
            channel.close()
    per_cycle = collections.Counter(checks)
    assert sum(per_cycle.values()) >= 32 * 3        # each consumer checks every 16 wakes
    assert max(per_cycle.values()) <= 3, per_cycle  # 2 a cycle, not 32 in one of 16

@pytest.mark.parametrize("stops", [(), ("zz",), ("e", "th")])
async def test_delivery_through_text_streams_equals_the_one_shot_decode(tiny_dir, stops):
    """Outputs of 1-4 tokens (a speculative step's), several requests' in one ``deliver``:
    each request's texts concatenate to the decode of its ids, cut before the first stop
    string; a stop string ends the output with the token that completed it (finished,
    STOP) and cancels the request; every output equals what ``TextStream.step`` (which
    builds a new output, the reference) makes of the same engine outputs."""
    import random

    from specloop.engine._stop import TextStream
    from specloop.models import Tokenizer
    tok = Tokenizer.from_dir(tiny_dir)
    words = tok.encode("the quick brown fox jumps over the lazy dog; café 🦙 naïve zz end")
    rng = random.Random(len(stops))
    stopped = 0
    for trial in range(30):
        front = FrontDoor()
        news = [new(i, f"t{trial}-{i}") for i in range(3)]
        channels = [front.submit(n, text=TextStream(tok, stops)) for n in news]
        references = [TextStream(tok, stops) for _ in news]
        front.take_message(one_rank)
        sent: list[list[int]] = [[] for _ in news]
        expect: list[list[RequestOutput]] = [[] for _ in news]
        for step in range(12):
            outputs, ending = [], []
            for i, n in enumerate(news):
                ids = tuple(rng.choice(words) if rng.random() < 0.8 else
                            rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 4)))
                last = step == 11
                out = RequestOutput(n.request_id, ids, "", last,
                                    FinishReason.LENGTH if last else None)
                if not references[i].stopped and n.request_id in front.open_request_ids:
                    sent[i].extend(ids)
                    expect[i].append(references[i].step(out))
                    if references[i].stopped and not last:
                        ending.append(n.request_id)
                outputs.append(out)
            front.deliver(outputs)
            # Ended at the front door by a stop string: the engine is asked to cancel it.
            assert front.take_message(one_rank).cancels == tuple(ending)
        for i, n in enumerate(news):
            got = await take(channels[i])
            assert got == expect[i]
            text = tok.decode(sent[i])
            cut = min((text.find(s) for s in stops if s in text), default=-1)
            assert "".join(o.text for o in got) == (text if cut < 0 else text[:cut])
            assert got[-1].finished and [o.finished for o in got[:-1]] == [False] * (len(got) - 1)
            assert got[-1].finish_reason is (FinishReason.STOP if cut >= 0 else
                                             FinishReason.LENGTH)
            tokens = [t for o in got for t in o.token_ids]
            assert tokens == (sent[i] if cut < 0 else sent[i][:len(tokens)])
            stopped += cut >= 0
    assert stopped > 0 if stops else stopped == 0
