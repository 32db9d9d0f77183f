"""distributed_topk equals a top-k over the full rows (lower id first among equal values),
whatever the sharding, on every rank."""
import math

import pytest
import torch

from specloop.comm import LocalGroup, SingleRankCommunicator, distributed_topk

from .test_argmax import _shards


def reference(full: torch.Tensor, k: int) -> torch.Tensor:
    """[N, k]: ids by value descending, lower id first among equal values."""
    order = full.double().argsort(dim=1, descending=True, stable=True)
    return order[:, :k]


async def topk(full: torch.Tensor, g: int, k: int) -> list[torch.Tensor]:
    shards = _shards(full, g)

    async def body(c):
        return await distributed_topk(c, shards[c.rank], k, vocab_size=full.shape[1])

    return await LocalGroup(g).run(body)


@pytest.mark.parametrize("g", [1, 2, 3, 4])
@pytest.mark.parametrize("v, k", [(5, 1), (7, 3), (10, 4), (1001, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
async def test_random_logits(g, v, k, dtype):
    full = torch.randn(8, v, generator=torch.Generator().manual_seed(v * 10 + g)).to(dtype)
    want = reference(full, k)
    for got in await topk(full, g, k):
        assert got.dtype == torch.int64
        assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("g", [2, 3, 4])
async def test_ties_and_shards_with_fewer_than_k_columns(g):
    """V = 5 over 4 ranks: shards of 2 columns, the last one empty; ties across shards
    go to the lower id; a row all -inf gives its first k ids."""
    v, k = 5, 3
    full = torch.zeros(4, v)
    full[0, [1, 3, 4]] = 2.0
    full[1, :] = -math.inf
    full[2] = torch.tensor([0.5, 3.0, 3.0, -1.0, 3.0])
    full[3] = torch.arange(v, dtype=torch.float32)
    want = reference(full, k)
    for got in await topk(full, g, k):
        assert torch.equal(got, want), (got, want)


async def test_a_bad_k_is_refused():
    with pytest.raises(ValueError, match="k must be an int in"):
        await distributed_topk(SingleRankCommunicator(), torch.zeros(2, 4), 5, vocab_size=4)
