"""distributed_argmax equals torch.argmax over the full rows, whatever the sharding."""
import math

import pytest
import torch

from specloop.comm import LocalGroup, SingleRankCommunicator, distributed_argmax


def _shards(full: torch.Tensor, g: int) -> list[torch.Tensor]:
    """Split [N, V] into g shards of ceil(V/g) columns, padding the tail with junk that
    would win if it were not ignored."""
    n, v = full.shape
    s = -(-v // g)
    junk = torch.full((n, s * g - v), torch.finfo(full.dtype).max, dtype=full.dtype)
    padded = torch.cat([full, junk], dim=1)
    return list(padded.split(s, dim=1))


async def _argmax(full: torch.Tensor, g: int) -> list[torch.Tensor]:
    shards = _shards(full, g)

    async def body(c):
        return await distributed_argmax(c, shards[c.rank], vocab_size=full.shape[1])

    return await LocalGroup(g).run(body)


def _assert_matches(results, full):
    expected = torch.argmax(full, dim=1)
    for got in results:
        assert got.dtype == torch.int64
        assert torch.equal(got, expected), (got, expected)


@pytest.mark.parametrize("g", [2, 3, 4])
@pytest.mark.parametrize("v", [5, 7, 10, 1001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
async def test_random_logits(g, v, dtype):
    full = torch.randn(8, v, generator=torch.Generator().manual_seed(v * 10 + g)).to(dtype)
    _assert_matches(await _argmax(full, g), full)


@pytest.mark.parametrize("g", [2, 3, 4])
async def test_ties_resolve_to_the_lowest_id_even_across_shards(g):
    v = 11
    full = torch.zeros(5, v)
    full[0, :] = 1.0  # all tied: id 0
    full[1, [3, 4, 9]] = 2.0  # tie inside and across shards
    full[2, [v - 1, 6]] = 5.0
    full[3, :] = -math.inf  # all -inf: torch.argmax says 0
    full[4, [2, 8]] = 3.0
    _assert_matches(await _argmax(full, g), full)


@pytest.mark.parametrize("g", [2, 3, 4])
async def test_nan_counts_as_largest_and_the_first_nan_wins(g):
    v = 10
    full = torch.randn(4, v, generator=torch.Generator().manual_seed(1))
    full[0, 7] = math.nan
    full[1, [8, 2]] = math.nan
    full[2, 1] = math.inf
    full[2, 9] = math.nan
    full[3, 0] = math.inf  # +inf without NaN: ordinary maximum
    _assert_matches(await _argmax(full, g), full)


async def test_rank_without_real_columns():
    # V=5 over 4 ranks: S=2, rank 3 holds only padding (columns 6 and 7).
    full = torch.randn(3, 5, generator=torch.Generator().manual_seed(2))
    full[1, :] = -math.inf
    _assert_matches(await _argmax(full, 4), full)


@pytest.mark.parametrize("g", [2, 3])
async def test_ids_above_2_pow_24_stay_exact(g):
    v = 2**24 + 5
    s = -(-v // g)
    winners = [2**24 + 3, 2**24 + 1, 2**24 + 4]  # float32 cannot tell 2^24+1 from 2^24

    def shard(rank: int) -> torch.Tensor:
        # Built per rank (fp16, ~17 MB per shard of 3 rows) instead of one full [3, V].
        out = torch.zeros(len(winners), s, dtype=torch.float16)
        for row, w in enumerate(winners):
            if rank * s <= w < (rank + 1) * s:
                out[row, w - rank * s] = 1.0
        return out

    async def body(c):
        return await distributed_argmax(c, shard(c.rank), vocab_size=v)

    for got in await LocalGroup(g).run(body):
        assert got.tolist() == winners


async def test_single_rank_and_empty_batch():
    c = SingleRankCommunicator()
    full = torch.randn(4, 9)
    assert torch.equal(await distributed_argmax(c, full, vocab_size=9), full.argmax(1))
    assert (await distributed_argmax(c, torch.empty(0, 9), vocab_size=9)).shape == (0,)


async def test_shard_width_and_dtype_are_checked():
    c = SingleRankCommunicator()
    with pytest.raises(ValueError, match=r"ceil\(V/g\) = 9"):
        await distributed_argmax(c, torch.zeros(2, 8), vocab_size=9)
    with pytest.raises(TypeError, match="floating"):
        await distributed_argmax(c, torch.zeros(2, 9, dtype=torch.int64), vocab_size=9)
    with pytest.raises(ValueError, match="2-D"):
        await distributed_argmax(c, torch.zeros(9), vocab_size=9)


async def test_exactly_one_collective():
    from specloop.comm import CollectiveCounter

    async def body(c):
        counter = CollectiveCounter(c)
        await distributed_argmax(counter, torch.randn(3, 4), vocab_size=8)
        return counter.by_op()

    assert await LocalGroup(2).run(body) == [{"all_gather": 1}] * 2
