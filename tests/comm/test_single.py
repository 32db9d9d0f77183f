import pickle

import pytest
import torch

from specloop.comm import SingleRankCommunicator


async def test_collectives_are_copies_of_the_input():
    c = SingleRankCommunicator()
    assert (c.rank, c.world_size, c.name) == (0, 1, "world")
    t = torch.tensor([1.0, 2.0])
    gathered = await c.all_gather(t)
    assert gathered.shape == (1, 2) and torch.equal(gathered[0], t)
    gathered[0, 0] = 9.0
    reduced = await c.all_reduce(t, op="max")
    reduced[0] = 7.0
    assert t.tolist() == [1.0, 2.0]
    obj = {"a": [1]}
    (got,) = await c.all_gather_object(obj)
    assert got == obj and got is not obj
    assert await c.broadcast_object(obj) == obj
    await c.barrier()
    sub = await c.subgroup([0], "adp")
    assert (sub.rank, sub.world_size, sub.name) == (0, 1, "adp")


async def test_arguments_are_checked_as_with_more_ranks():
    c = SingleRankCommunicator()
    with pytest.raises(TypeError, match="torch.Tensor"):
        await c.all_gather([1, 2])
    with pytest.raises(ValueError, match="reduce op"):
        await c.all_reduce(torch.zeros(1), op="mean")
    with pytest.raises(ValueError, match="src"):
        await c.broadcast_object(1, src=1)
    with pytest.raises(ValueError, match="not in the parent"):
        await c.subgroup([0, 1], "adp")
    with pytest.raises((pickle.PicklingError, AttributeError)):
        await c.all_gather_object(lambda: 0)  # unpicklable, as between processes
