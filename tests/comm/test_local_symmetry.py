"""Asymmetric collectives fail fast and loudly on every rank; missing ranks are named."""
import time

import anyio

import pytest
import torch

from specloop.comm import CollectiveMismatchError, CollectiveTimeoutError, InjectedFault, LocalGroup


async def _run_timed(group: LocalGroup, body):
    start = time.perf_counter()
    results = await group.run(body, return_exceptions=True)
    return results, time.perf_counter() - start


async def test_one_rank_skipping_a_collective_raises_mismatch_everywhere(group: LocalGroup):
    async def body(c):
        if c.rank != 1:  # rank 1 skips the all_gather and goes straight to all_reduce
            await c.all_gather(torch.zeros(3))
        await c.all_reduce(torch.zeros(3))

    results, elapsed = await _run_timed(group, body)
    assert elapsed < 1.0
    assert all(isinstance(e, CollectiveMismatchError) for e in results)
    msg = str(results[1])
    assert "rank 0 called all_gather(shape=(3,), dtype=float32) #0 on group 'world'" in msg
    assert "rank 1 called all_reduce(op=sum, shape=(3,), dtype=float32) #0 on group 'world'" in msg


async def test_two_collectives_reordered_on_one_rank(group: LocalGroup):
    async def body(c):
        a = lambda: c.all_gather(torch.zeros(2, dtype=torch.int64))  # noqa: E731
        b = lambda: c.all_gather_object(c.rank)  # noqa: E731
        first, second = (b, a) if c.rank == group.world_size - 1 else (a, b)
        await first()
        await second()

    results, elapsed = await _run_timed(group, body)
    assert elapsed < 1.0
    last = group.world_size - 1
    for e in results:
        assert isinstance(e, CollectiveMismatchError)
        assert f"rank {last} called all_gather_object() #0" in str(e)
    assert set(results[0].calls) == set(range(group.world_size)) - set(results[0].missing)


@pytest.mark.parametrize("what", ["shape", "dtype", "src", "reduce_op", "group", "bytes"])
async def test_different_arguments_at_the_same_sequence(group: LocalGroup, what):
    odd = {"shape": lambda c: c.all_gather(torch.zeros(4)),
           "dtype": lambda c: c.all_gather(torch.zeros(3, dtype=torch.float16)),
           "src": lambda c: c.broadcast_object(None, src=1),
           "reduce_op": lambda c: c.all_reduce(torch.zeros(3), op="max"),
           "bytes": lambda c: c.all_gather_bytes(bytes(4))}
    even = {"src": lambda c: c.broadcast_object(None, src=0), "reduce_op": lambda c: c.all_reduce(torch.zeros(3)),
            "bytes": lambda c: c.all_gather_bytes(bytes(3))}

    async def body(c):
        if what == "group":  # same op, but rank 0 thinks it is in another group
            sub = await c.subgroup(range(group.world_size), "adp" if c.rank == 0 else "tp")
            return await sub.all_gather(torch.zeros(3))
        call = odd[what] if c.rank == 1 else even.get(what, lambda c: c.all_gather(torch.zeros(3)))
        await call(c)

    results, elapsed = await _run_timed(group, body)
    assert elapsed < 1.0
    if what == "group":
        # Different groups never meet: each waits for ranks that went elsewhere.
        assert all(isinstance(e, CollectiveTimeoutError) for e in results)
        return
    assert all(isinstance(e, CollectiveMismatchError) for e in results)
    assert {0, 1} <= set(results[0].calls)


async def test_late_rank_joins_the_mismatch_and_sees_its_own_call():
    group = LocalGroup(3, timeout=1.0)

    async def body(c):
        if c.rank == 2:
            await anyio.sleep(0.05)  # arrives after ranks 0 and 1 already disagreed
        await (c.all_reduce(torch.zeros(1)) if c.rank == 1 else c.all_gather(torch.zeros(1)))

    results = await group.run(body, return_exceptions=True)
    assert all(isinstance(e, CollectiveMismatchError) for e in results)
    assert results[0].missing == (2,)
    assert "rank 2 called all_gather" in str(results[2])


async def test_stalled_rank_times_out_the_others_naming_it(group: LocalGroup):
    group.stall(1)

    async def body(c):
        await c.barrier()

    results, elapsed = await _run_timed(group, body)
    assert group.timeout <= elapsed < group.timeout + 1.0
    for rank, e in enumerate(results):
        assert isinstance(e, CollectiveTimeoutError)
        if rank != 1:
            assert e.missing == (1,)
            assert "rank(s) 1 did not enter barrier() #0 on group 'world'" in str(e)
    assert "stalled on purpose" in str(results[1])


@pytest.mark.parametrize("world_size", [2, 4])
async def test_failed_rank_raises_and_the_others_learn_at_once(world_size):
    group = LocalGroup(world_size, timeout=30.0)  # the others must not need the timeout
    group.fail(1, exc=RuntimeError("boom"))

    async def body(c):
        await c.all_gather(torch.zeros(2))
        await c.all_gather(torch.zeros(2))

    results, elapsed = await _run_timed(group, body)
    assert elapsed < 1.0
    assert isinstance(results[1], RuntimeError) and str(results[1]) == "boom"
    for rank, e in enumerate(results):
        if rank != 1:
            assert isinstance(e, CollectiveTimeoutError) and e.missing == (1,)
            assert "rank 1 died: RuntimeError('boom')" in str(e)


async def test_default_fault_is_injected_fault():
    group = LocalGroup(2, timeout=0.3)
    group.fail(0)
    results = await group.run(lambda c: c.barrier(), return_exceptions=True)
    assert isinstance(results[0], InjectedFault)
    assert isinstance(results[1], CollectiveTimeoutError)


async def test_rank_that_returns_early_is_reported_missing_without_waiting():
    group = LocalGroup(2, timeout=30.0)

    async def body(c):
        await c.all_gather(torch.zeros(1))
        if c.rank == 0:
            await c.all_gather(torch.zeros(1))  # rank 1 skips the last one and returns

    results, elapsed = await _run_timed(group, body)
    assert elapsed < 1.0
    assert results[1] is None
    assert isinstance(results[0], CollectiveTimeoutError) and results[0].missing == (1,)
    assert "returned from its function" in str(results[0])


async def test_run_raises_an_exception_group_by_default():
    group = LocalGroup(2, timeout=0.3)

    async def body(c):
        await (c.barrier() if c.rank == 0 else c.all_gather_object(None))

    with pytest.raises(ExceptionGroup) as info:
        await group.run(body)
    assert len(info.value.exceptions) == 2


async def test_subgroups_have_independent_sequence_numbers():
    group = LocalGroup(4, timeout=0.3)

    async def body(c):
        sub = await c.subgroup([0, 1] if c.rank < 2 else [2, 3], "pair")
        for _ in range(1 if c.rank < 2 else 3):  # pairs differ; the world sequence does not move
            await sub.barrier()
        return await c.all_gather(torch.tensor([c.rank]))

    results = await group.run(body)
    assert all(r.flatten().tolist() == [0, 1, 2, 3] for r in results)


async def test_subgroup_errors_name_the_subgroup_and_its_sequence():
    group = LocalGroup(4, timeout=0.3)

    async def body(c):
        await c.barrier()  # world #0
        sub = await c.subgroup([2, 3], "tp") if c.rank >= 2 else None
        if sub is not None:
            await sub.barrier()  # tp #0
            await (sub.all_gather(torch.zeros(1)) if c.rank == 2 else sub.all_gather(torch.zeros(2)))

    results = await group.run(body, return_exceptions=True)
    assert results[:2] == [None, None]
    for e in results[2:]:
        assert isinstance(e, CollectiveMismatchError)
        assert "rank 2 called all_gather(shape=(1,), dtype=float32) #1 on group 'tp'" in str(e)
        assert "rank 3 called all_gather(shape=(2,), dtype=float32) #1 on group 'tp'" in str(e)
