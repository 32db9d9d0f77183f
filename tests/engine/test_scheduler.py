"""Unit tests of continuous batching on one rank (engine/_scheduler.py): KV slots, FIFO
admission under the batch and prefill budgets, and finishing requests."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specloop.engine._request import FinishReason, NewRequest, Request
from specloop.engine._scheduler import Scheduler, SlotAllocator
from specloop.samplers import SamplingParams


def request(i: int, prompt_len: int) -> Request:
    ids = tuple(range(1, prompt_len + 1))
    return Request.from_new(NewRequest(f"r{i}", ids, SamplingParams(), seed=i, handle=i))


def test_slots_are_distinct_never_the_scratch_slot_and_reusable():
    slots = SlotAllocator(3)
    got = {slots.allocate() for _ in range(3)}
    assert got == {0, 1, 2}            # slot 3 is the cache's scratch slot
    assert slots.num_free == 0
    slots.free(1)
    assert slots.num_free == 1 and slots.allocate() == 1


@pytest.mark.parametrize("bad", [0, 3, -1])
def test_double_free_or_foreign_slot_raises(bad):
    slots = SlotAllocator(3)
    held = [slots.allocate() for _ in range(2)]  # 0 and 1 held, 2 free
    if bad == 0:
        slots.free(held[0])
    with pytest.raises(RuntimeError, match=f"slot {bad}"):
        slots.free(bad if bad != 0 else held[0])


def test_admits_in_arrival_order_up_to_the_batch_size():
    sched = Scheduler(max_batch_size=2, max_num_tokens=1000)
    reqs = [request(i, 5) for i in range(4)]
    for r in reqs:
        sched.add(r)
    assert sched.admit() == reqs[:2]
    assert sched.running == reqs[:2] and list(sched.waiting) == reqs[2:]
    assert {r.slot for r in reqs[:2]} == {0, 1} and reqs[2].slot is None
    assert sched.admit() == []                  # no free slot
    sched.finish(reqs[0], FinishReason.STOP)
    assert sched.admit() == [reqs[2]]
    assert reqs[2].slot == 0                    # the freed slot is handed out again
    assert sched.num_requests == 3


def test_prefill_budget_counts_prompt_tokens_not_yet_cached():
    # A prompt of n tokens prefills n - 1 (its last token is fed by the next step).
    sched = Scheduler(max_batch_size=8, max_num_tokens=10)
    reqs = [request(0, 6), request(1, 6), request(2, 2)]   # 5 + 5 + 1 tokens
    for r in reqs:
        sched.add(r)
    assert sched.admit() == reqs[:2]            # 10 tokens: exactly the budget
    assert sched.admit() == [reqs[2]]


def test_first_prompt_may_exceed_the_budget_later_ones_wait_in_order():
    sched = Scheduler(max_batch_size=8, max_num_tokens=4)
    big, next_big, small = request(0, 50), request(1, 8), request(2, 2)
    for r in (big, next_big, small):
        sched.add(r)
    assert sched.admit() == [big]               # alone: prefilled in chunks
    # FIFO: the small one does not overtake the one ahead of it that does not fit.
    assert sched.admit() == [next_big]
    assert sched.admit() == [small]


def test_finish_frees_the_slot_and_keeps_the_first_reason():
    sched = Scheduler(max_batch_size=1, max_num_tokens=100)
    r = request(0, 3)
    sched.add(r)
    sched.admit()
    r.finish_reason = FinishReason.STOP          # e.g. set by the stop rules
    sched.finish(r, FinishReason.CANCELLED)
    assert r.finish_reason is FinishReason.STOP
    assert r.slot is None and sched.running == [] and sched.slots.num_free == 1


def test_finishing_a_queued_request_removes_it_without_touching_slots():
    sched = Scheduler(max_batch_size=1, max_num_tokens=100)
    running, queued = request(0, 3), request(1, 3)
    sched.add(running)
    sched.add(queued)
    sched.admit()
    sched.finish(queued, FinishReason.CANCELLED)
    assert queued.finish_reason is FinishReason.CANCELLED
    assert list(sched.waiting) == [] and sched.running == [running]
    assert sched.slots.num_free == 0


def test_find_looks_in_the_batch_and_the_queue():
    sched = Scheduler(max_batch_size=1, max_num_tokens=100)
    a, b = request(0, 3), request(1, 3)
    sched.add(a)
    sched.add(b)
    sched.admit()
    assert sched.find("r0") is a and sched.find("r1") is b and sched.find("r9") is None


# Any interleaving of arrivals, admissions and finishes keeps the invariants.
OPS = st.lists(st.one_of(st.tuples(st.just("add"), st.integers(1, 40)),
                         st.tuples(st.just("admit"), st.just(0)),
                         st.tuples(st.just("finish"), st.integers(0, 10))),
               max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, max_batch_size=st.integers(1, 5), budget=st.integers(1, 50))
def test_any_interleaving_keeps_slots_order_and_budget(ops, max_batch_size, budget):
    sched = Scheduler(max_batch_size=max_batch_size, max_num_tokens=budget)
    added, admitted_order = [], []
    for op, arg in ops:
        if op == "add":
            r = request(len(added), arg)
            added.append(r)
            sched.add(r)
        elif op == "admit":
            batch = sched.admit()
            tokens = [len(r.token_ids) - 1 for r in batch]
            assert len(batch) <= 1 or sum(tokens) <= budget
            if not batch:   # nothing admitted: no slot, or nothing waiting
                assert not sched.waiting or sched.slots.num_free == 0
            admitted_order += batch
        elif sched.running or sched.waiting:
            pool = [*sched.running, *sched.waiting]
            sched.finish(pool[arg % len(pool)], FinishReason.CANCELLED)
        slots = [r.slot for r in sched.running]
        assert len(slots) == len(set(slots)) <= max_batch_size
        assert all(0 <= s < max_batch_size for s in slots)
        assert sched.slots.num_free + len(sched.running) == max_batch_size
        assert all(r.slot is None for r in sched.waiting)
    # FIFO: requests enter the batch in arrival order.
    assert [int(r.request_id[1:]) for r in admitted_order] == sorted(
        int(r.request_id[1:]) for r in admitted_order)
