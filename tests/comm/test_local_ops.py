"""LocalGroup collectives give the right values, fresh per rank."""
import pytest
import torch

from specloop.comm import LocalGroup


async def test_all_gather_stacks_rows_by_rank(group: LocalGroup):
    async def body(c):
        return await c.all_gather(torch.tensor([[c.rank, 10 * c.rank]]))

    results = await group.run(body)
    expected = torch.tensor([[[r, 10 * r]] for r in range(group.world_size)])
    for got in results:
        assert torch.equal(got, expected)
    results[0][0, 0, 0] = 99  # no aliasing between ranks
    assert results[1][0, 0, 0] == 0


@pytest.mark.parametrize(
    "op,expected", [("sum", lambda g: sum(range(g))), ("max", lambda g: g - 1), ("min", lambda g: 0)]
)
async def test_all_reduce(group: LocalGroup, op, expected):
    async def body(c):
        t = torch.tensor([c.rank], dtype=torch.int64)
        out = await c.all_reduce(t, op=op)
        assert t.item() == c.rank  # input untouched
        return out

    for got in await group.run(body):
        assert got.dtype == torch.int64 and got.item() == expected(group.world_size)


async def test_all_reduce_is_bit_identical_on_every_rank(group: LocalGroup):
    async def body(c):
        return await c.all_reduce(torch.randn(64, generator=torch.Generator().manual_seed(c.rank)))

    results = await group.run(body)
    for got in results[1:]:
        assert torch.equal(got, results[0])


async def test_objects_are_gathered_and_broadcast_as_copies(group: LocalGroup):
    shared = {"payload": [1, 2]}

    async def body(c):
        gathered = await c.all_gather_object({"rank": c.rank})
        src = group.world_size - 1
        got = await c.broadcast_object(shared if c.rank == src else None, src=src)
        await c.barrier()
        return gathered, got

    for gathered, got in await group.run(body):
        assert gathered == [{"rank": r} for r in range(group.world_size)]
        assert got == shared and got is not shared


async def test_subgroup_renumbers_ranks_and_has_its_own_sequence(group: LocalGroup):
    members = [r for r in range(group.world_size) if r % 2 == 1]

    async def body(c):
        if c.rank not in members:
            return await c.all_gather(torch.tensor([c.rank]))
        sub = await c.subgroup(list(reversed(members)), "odd")
        assert (sub.world_size, sub.name) == (len(members), "odd")
        inner = await sub.all_gather(torch.tensor([sub.rank, c.rank]))  # only members: world seq unaffected
        outer = await c.all_gather(torch.tensor([c.rank]))
        return inner, outer

    results = await group.run(body)
    for r in members:
        inner, outer = results[r]
        assert inner.tolist() == [[i, m] for i, m in enumerate(members)]
        assert outer.flatten().tolist() == list(range(group.world_size))


async def test_subgroup_arguments_are_checked():
    c = LocalGroup(4).communicator(1)
    with pytest.raises(ValueError, match="not a member"):
        await c.subgroup([0, 2], "tp")
    with pytest.raises(ValueError, match="distinct"):
        await c.subgroup([1, 1], "tp")
    sub = await c.subgroup([0, 1], "tp")
    with pytest.raises(ValueError, match="not in the parent"):
        await sub.subgroup([1, 3], "inner")


def test_constructor_arguments_are_checked():
    with pytest.raises(ValueError, match="world_size"):
        LocalGroup(0)
    with pytest.raises(ValueError, match="timeout"):
        LocalGroup(2, timeout=0)
    with pytest.raises(ValueError, match="rank"):
        LocalGroup(2).communicator(2)


async def test_bytes_are_gathered_in_rank_order(group: LocalGroup):
    async def body(c):
        return await c.all_gather_bytes(bytes([c.rank]) * 5)

    for got in await group.run(body):
        assert got == [bytes([r]) * 5 for r in range(group.world_size)]


async def test_the_protocols_default_bytes_gather_checks_the_lengths(group: LocalGroup):
    """A communicator that inherits ``all_gather_bytes`` gets it through
    ``all_gather_object``; ranks passing different lengths all get the same error."""
    from specloop.comm import Communicator

    class ObjectsOnly(Communicator):
        def __init__(self, inner):
            self.inner = inner

        rank = property(lambda self: self.inner.rank)
        world_size = property(lambda self: self.inner.world_size)
        name = property(lambda self: self.inner.name)

        async def all_gather_object(self, obj):
            return await self.inner.all_gather_object(obj)

    async def body(c):
        wrapped = ObjectsOnly(c)
        equal = await wrapped.all_gather_bytes(bytes([c.rank, 1]))
        with pytest.raises(ValueError, match=r"passed \[1, 2.*same length"):
            await wrapped.all_gather_bytes(bytes(1 + c.rank))
        return equal

    for got in await group.run(body):
        assert got == [bytes([r, 1]) for r in range(group.world_size)]
