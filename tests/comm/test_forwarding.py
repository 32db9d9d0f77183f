"""ForwardingCommunicator: the base a user's wrapper overrides ``_around`` and ``_wrap`` of."""
import torch

from specloop.comm import Communicator, ForwardingCommunicator, LocalGroup


class Log(ForwardingCommunicator):
    """A user's wrapper: each collective's op, group and shape, shared with its views."""

    def __init__(self, inner: Communicator, seen: list | None = None) -> None:
        super().__init__(inner)
        self.seen = [] if seen is None else seen

    def _wrap(self, inner: Communicator) -> "Log":
        return Log(inner, self.seen)

    async def _around(self, op, call, shape=None):
        self.seen.append((op, self.name, shape))
        return await call


async def test_every_collective_passes_through_around_with_its_results_unchanged():
    async def body(c):
        log = Log(c)
        gathered = await log.all_gather(torch.full((2,), float(c.rank)))
        reduced = await log.all_reduce(torch.ones(3), op="sum")
        objects = await log.all_gather_object(c.rank)
        payloads = await log.all_gather_bytes(b"ab")
        sent = await log.broadcast_object(f"from {c.rank}", src=1)
        await log.barrier()
        sub = await log.subgroup([0, 1], "adp")
        await sub.all_gather(torch.zeros(1, 4))
        bounded = log.bounded(5.0)
        await bounded.barrier()
        assert type(sub) is Log and type(bounded) is Log
        assert (log.rank, log.world_size, log.name) == (c.rank, 2, c.name)
        assert (bounded.timeout_s, log.host_tensors) == (5.0, c.host_tensors)
        return log.seen, gathered, reduced, objects, payloads, sent

    for seen, gathered, reduced, objects, payloads, sent in await LocalGroup(2).run(body):
        assert gathered.tolist() == [[0.0, 0.0], [1.0, 1.0]]
        assert reduced.tolist() == [2.0, 2.0, 2.0]
        assert (objects, payloads, sent) == ([0, 1], [b"ab", b"ab"], "from 1")
        assert seen == [("all_gather", "world", (2,)), ("all_reduce", "world", (3,)),
                        ("all_gather_object", "world", None), ("all_gather_bytes", "world", (2,)),
                        ("broadcast_object", "world", None), ("barrier", "world", None),
                        ("all_gather", "adp", (1, 4)), ("barrier", "world", None)]
