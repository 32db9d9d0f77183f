import torch

from specloop.samplers import Stream, derive_seed, uniform


def test_open_interval_and_uniformity():
    seeds = torch.arange(1000, dtype=torch.int64)
    pos = torch.arange(100, dtype=torch.int64).expand(1000, 100) + 5
    u = uniform(seeds, pos, Stream.ACCEPT)
    assert u.dtype == torch.float64 and u.shape == (1000, 100)
    assert float(u.min()) > 0 and float(u.max()) < 1
    from scipy import stats  # noqa: PLC0415 (2-3 s to import: only where used)

    assert stats.kstest(u.flatten().numpy(), "uniform").pvalue > 1e-4


def test_pure_function_of_seed_position_stream_index():
    seeds = torch.tensor([3, 2**62 + 5, 0, 77], dtype=torch.int64)
    pos = torch.tensor([[10, 11], [2**40, 3], [0, 1], [10, 11]], dtype=torch.int64)
    u = uniform(seeds, pos, Stream.DRAFT)
    for b in range(4):  # each row alone, and in another order: same bits
        alone = uniform(seeds[b:b + 1], pos[b:b + 1], Stream.DRAFT)
        assert torch.equal(alone[0], u[b])
    perm = torch.tensor([2, 0, 3, 1])
    assert torch.equal(uniform(seeds[perm], pos[perm], Stream.DRAFT), u[perm])
    assert torch.equal(uniform(seeds, pos, Stream.DRAFT), u)


def test_streams_seeds_positions_and_index_differ_and_are_uncorrelated():
    seeds = torch.arange(20000, dtype=torch.int64)
    pos = torch.full((20000,), 7, dtype=torch.int64)
    draws = {s: uniform(seeds, pos, s) for s in Stream}
    draws["next_pos"] = uniform(seeds, pos + 1, Stream.DRAFT)
    draws["index1"] = uniform(seeds, pos, Stream.DRAFT, index=1)
    draws["next_seed"] = uniform(seeds + 1, pos, Stream.DRAFT)[:-1]
    base = draws[Stream.DRAFT]
    for name, u in draws.items():
        if name is Stream.DRAFT:
            continue
        b = base[:u.shape[0]]
        assert not torch.equal(u, b), name
        corr = torch.corrcoef(torch.stack([u, b]))[0, 1]
        assert abs(float(corr)) < 0.03, (name, float(corr))


def test_dtype_and_shape_errors():
    import pytest
    with pytest.raises(ValueError, match="int64"):
        uniform(torch.tensor([1], dtype=torch.int32), torch.tensor([1]), Stream.BONUS)
    with pytest.raises(ValueError, match="positions"):
        uniform(torch.tensor([1, 2]), torch.tensor([1]), Stream.BONUS)


def test_derive_seed():
    seeds = {derive_seed(42, i) for i in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(42, 5) == derive_seed(42, 5) != derive_seed(43, 5)
