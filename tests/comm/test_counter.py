import torch

from specloop.comm import CollectiveCounter, LocalGroup, SingleRankCommunicator, collective_label


async def test_counts_by_op_label_and_group():
    group = LocalGroup(2)

    async def body(c):
        counter = CollectiveCounter(c)
        counter.label = "SYNC"
        await counter.all_gather(torch.zeros(3))
        with counter.labelled("DRAFT"):
            adp = await counter.subgroup([0, 1], "adp")
            await adp.all_gather(torch.zeros(1))
            await adp.all_reduce(torch.zeros(1), op="max")
        assert counter.label == "SYNC"  # restored
        counter.label = None
        await counter.barrier()
        await counter.broadcast_object("x")
        await counter.all_gather_object(c.rank)
        return counter

    for counter in await group.run(body):
        assert counter.count(label="SYNC") == 1
        assert counter.count("all_gather", label="SYNC") == 1
        assert counter.count(label="DRAFT") == 2
        assert counter.count(label="DRAFT", group="adp") == 2
        assert counter.count(label=None) == 3
        assert counter.count() == 6
        assert counter.by_op() == {"all_gather": 2, "all_reduce": 1, "barrier": 1, "broadcast_object": 1,
                                   "all_gather_object": 1}
        assert counter.by_label() == {"SYNC": 1, "DRAFT": 2, None: 3}
        counter.reset()
        assert counter.count() == 0


async def test_collective_label_works_with_any_communicator():
    plain = SingleRankCommunicator()
    with collective_label(plain, "SYNC"):  # no counter: does nothing
        await plain.barrier()
    counter = CollectiveCounter(plain)
    with collective_label(counter, "SYNC"):
        await counter.all_gather(torch.zeros(1))
    assert counter.count(label="SYNC") == 1 and counter.label is None
    assert (counter.rank, counter.world_size, counter.name) == (0, 1, "world")
