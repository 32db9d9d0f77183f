import math

import pytest
import torch

from specloop.samplers import SamplingBatch, SamplingParams, SamplingParamsError

BAD = [
    ("temperature", -0.5), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "1"), ("top_k", -1), ("top_k", 1.5), ("top_k", True),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan), ("min_p", -0.1), ("min_p", 1.1),
    ("seed", -1), ("seed", 2**63), ("seed", 1.0), ("max_tokens", 0), ("max_tokens", -3),
    ("stop_token_ids", (1, -2)), ("stop_token_ids", "ab"), ("ignore_eos", 1),
]


@pytest.mark.parametrize("field,value", BAD)
def test_invalid_values_name_field_value_and_fix(field, value):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**{field: value})
    msg = str(err.value)
    assert field in msg and repr(value)[:6] in msg and ";" in msg
    assert isinstance(err.value, ValueError)


def test_defaults_and_is_greedy():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed, p.max_tokens,
            p.stop_token_ids, p.ignore_eos) == (1.0, 0, 1.0, 0.0, None, 16, (), False)
    assert not p.is_greedy
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert SamplingParams(stop_token_ids=[2, 3]).stop_token_ids == (2, 3)
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # frozen


def test_batch_tensors_padding_and_flags():
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1),
              SamplingParams(temperature=0)]
    b = SamplingBatch.from_params(params, [11, 22], pad_to=4)
    assert b.size == 4 and b.num_real == 2 and not b.all_greedy
    assert b.temperature.dtype == torch.float32 and b.top_k.dtype == torch.int64
    assert b.is_greedy.tolist() == [False, True, True, True]
    assert b.seeds.tolist() == [11, 22, 0, 0]
    # greedy and padding rows carry neutral sentinel params
    assert b.temperature.tolist()[1:] == [1.0, 1.0, 1.0] and b.top_k.tolist()[1:] == [0, 0, 0]
    assert b.needs_sort and b.needs_min_p


def test_all_greedy_over_real_rows():
    assert SamplingBatch.from_params([], []).all_greedy
    assert SamplingBatch.from_params([], [], pad_to=3).all_greedy
    assert SamplingBatch.from_params([SamplingParams(top_k=1)], [1], pad_to=2).all_greedy
    assert not SamplingBatch.from_params([SamplingParams()], [1]).all_greedy


def test_batch_errors():
    with pytest.raises(ValueError, match="seeds"):
        SamplingBatch.from_params([SamplingParams()], [])
    with pytest.raises(ValueError, match="pad_to"):
        SamplingBatch.from_params([SamplingParams()] * 2, [1, 2], pad_to=1)
    with pytest.raises(ValueError, match="seed"):
        SamplingBatch.from_params([SamplingParams()], [-1])


def test_columns_packed_into_one_copy_keep_dtype_and_values():
    """On a GPU the batch's columns go over in one copy (samplers/_params.py
    ``packed_to_device``): each comes back with its dtype and values, at a 16-byte aligned
    offset, empty columns included (here packed on the CPU, as on the GPU but unpinned)."""
    from specloop.samplers._params import packed_to_device
    hosts = [torch.tensor([0.5, 2.0, 1e-6]), torch.tensor([3, 2**62], dtype=torch.int64),
             torch.tensor([True, False, True]), torch.zeros(0, dtype=torch.float32),
             torch.tensor([7], dtype=torch.int64), torch.arange(6.0).view(2, 3)]
    out = packed_to_device(hosts, "cpu", pin=False)
    base = out[0].data_ptr()
    for h, o in zip(hosts, out):
        assert o.dtype == h.dtype and o.shape == h.shape and torch.equal(o, h)
        assert (o.data_ptr() - base) % 16 == 0


@pytest.mark.gpu
def test_batch_on_cuda_equals_batch_on_cpu():
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=3),
              SamplingParams(temperature=0)]
    cpu = SamplingBatch.from_params(params, [11, 22], pad_to=5)
    gpu = SamplingBatch.from_params(params, [11, 22], pad_to=5, device="cuda")
    for name in SamplingBatch.COLUMNS:
        a, b = getattr(cpu, name), getattr(gpu, name)
        assert b.device.type == "cuda" and b.dtype == a.dtype and torch.equal(a, b.cpu())
    other = SamplingBatch.from_params(params, [12, 22], pad_to=5, device="cuda", like=gpu)
    assert all(getattr(other, n) is getattr(gpu, n) for n in SamplingBatch.COLUMNS[:-1])
    assert other.seeds.device.type == "cuda" and other.seeds.tolist() == [12, 22, 0, 0, 0]
    empty = SamplingBatch.from_params([], [], device="cuda")    # an idle rank's rows
    assert empty.size == 0 and empty.seeds.device.type == "cuda"


def _reference(params, seeds, pad_to):
    """SamplingBatch's columns and flags by their definition, a column at a time."""
    size = len(params) if pad_to is None else pad_to
    sentinel = SamplingParams(temperature=1.0)
    rows = [sentinel if p.is_greedy else p for p in params] + [sentinel] * (size - len(params))
    greedy = [p.is_greedy for p in params] + [True] * (size - len(params))
    columns = {"temperature": torch.tensor([p.temperature for p in rows], dtype=torch.float32),
               "top_k": torch.tensor([p.top_k for p in rows], dtype=torch.int64),
               "top_p": torch.tensor([p.top_p for p in rows], dtype=torch.float32),
               "min_p": torch.tensor([p.min_p for p in rows], dtype=torch.float32),
               "is_greedy": torch.tensor(greedy, dtype=torch.bool),
               "seeds": torch.tensor(list(seeds) + [0] * (size - len(params)),
                                     dtype=torch.int64)}
    flags = {"all_greedy": all(p.is_greedy for p in params), "num_real": len(params),
             "needs_sort": any(p.top_k > 0 or p.top_p < 1 for p in rows),
             "needs_min_p": any(p.min_p > 0 for p in rows), "any_greedy": any(greedy)}
    return columns, flags


@pytest.mark.parametrize("seed", range(4))
def test_batch_columns_and_flags_equal_their_definition(seed):
    """from_params packs the columns through ``array`` buffers (not a tensor per column)
    and reads the flags off the sampled rows only: random batches, padded or not, give
    the columns (dtype and every value, float32 rounding included) and flags the
    definition gives."""
    import random
    rng = random.Random(seed)
    for _ in range(20):
        n = rng.randrange(0, 6)
        params = [SamplingParams(
            temperature=rng.choice([0, 0.0, 1, 0.7, 1e-6, 1e6, 1 / 3]),
            top_k=rng.choice([0, 1, 5, 2**62]), top_p=rng.choice([1.0, 0.9, 1 / 7]),
            min_p=rng.choice([0.0, 0.05, 1.0])) for _ in range(n)]
        seeds = [rng.choice([0, 7, 2**63 - 1, rng.randrange(2**40)]) for _ in range(n)]
        pad_to = rng.choice([None, n, n + rng.randrange(1, 4)])
        batch = SamplingBatch.from_params(params, seeds, pad_to=pad_to)
        columns, flags = _reference(params, seeds, pad_to)
        for name, want in columns.items():
            got = getattr(batch, name)
            assert got.dtype == want.dtype and torch.equal(got, want), name
        for name, want in flags.items():
            assert getattr(batch, name) == want, name


def test_seeds_of_an_int_subclass_pass_and_bad_ones_are_named():
    import enum

    class Seed(enum.IntEnum):
        A = 5
    b = SamplingBatch.from_params([SamplingParams()], [Seed.A])
    assert b.seeds.tolist() == [5]
    for bad in (-1, 2**63, 1.0, True):
        with pytest.raises(ValueError, match=f"seed {bad!r} is not an int"):
            SamplingBatch.from_params([SamplingParams()], [bad])


def test_a_batch_like_another_keeps_its_unchanged_columns():
    """``like``: the columns whose values did not change are the earlier batch's tensors
    (a graph replay given the same tensor copies nothing), the others new; a batch of
    another size, or one not built here (``with_columns``), lends nothing."""
    g, s = SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.9)
    a = SamplingBatch.from_params([g, g, g], [1, 2, 3], pad_to=4)
    b = SamplingBatch.from_params([g, g], [1, 3], pad_to=4, like=a)  # a request left
    same = {n for n in SamplingBatch.COLUMNS if getattr(b, n) is getattr(a, n)}
    assert same == set(SamplingBatch.COLUMNS) - {"seeds"}
    assert b.seeds.tolist() == [1, 3, 0, 0] and b.num_real == 2
    c = SamplingBatch.from_params([g, s], [1, 3], pad_to=4, like=b)  # a sampled one joined
    assert {n for n in SamplingBatch.COLUMNS if getattr(c, n) is getattr(b, n)} == {
        "top_k", "min_p", "seeds"}
    columns, flags = _reference([g, s], [1, 3], 4)
    for name, want in columns.items():
        assert torch.equal(getattr(c, name), want), name
    assert not c.all_greedy and c.needs_sort
    d = SamplingBatch.from_params([g, s], [1, 3], pad_to=4, like=c)
    assert all(getattr(d, n) is getattr(c, n) for n in SamplingBatch.COLUMNS)
    e = SamplingBatch.from_params([g, s], [1, 3], pad_to=5, like=d)
    assert not any(getattr(e, n) is getattr(d, n) for n in SamplingBatch.COLUMNS)
    statics = d.with_columns({n: getattr(d, n).clone() for n in SamplingBatch.COLUMNS})
    f = SamplingBatch.from_params([g, s], [1, 3], pad_to=4, like=statics)
    assert statics.host is None
    assert not any(getattr(f, n) is getattr(statics, n) for n in SamplingBatch.COLUMNS)


def test_real_rows_are_views_with_the_real_rows_flags():
    g, s = SamplingParams(temperature=0), SamplingParams(temperature=0.7, min_p=0.1)
    padded = SamplingBatch.from_params([s], [9], pad_to=3)
    real = padded.real_rows()
    columns, flags = _reference([s], [9], None)
    for name, want in columns.items():
        got = getattr(real, name)
        assert torch.equal(got, want) and got.data_ptr() == getattr(padded, name).data_ptr()
    for name, want in flags.items():
        assert getattr(real, name) == want, name
    assert padded.any_greedy and not real.any_greedy
    # Its host values and flags are the real rows' own (``changed`` slices them).
    assert dict(real.host) == dict(SamplingBatch.from_params([s], [9]).host)
    assert real.row_flags == padded.row_flags
    whole = SamplingBatch.from_params([g, s], [1, 2])
    assert whole.real_rows() is whole
    statics = padded.with_columns(padded.columns())
    with pytest.raises(ValueError, match="not built by from_params"):
        statics.real_rows()


def test_first_rows_of_an_all_greedy_batch_only_past_its_real_rows():
    """Any number of an all-greedy batch's rows (padding rows are greedy); fewer rows of a
    mixed batch would keep its flags, which are its real rows', so they are refused."""
    g, s = SamplingParams(temperature=0), SamplingParams(temperature=0.7)
    greedy = SamplingBatch.from_params([g, g], [1, 2], pad_to=4)
    three = greedy.first_rows(3)
    assert three.size == 3 and three.num_real == 3 and three.all_greedy
    assert three.is_greedy.data_ptr() == greedy.is_greedy.data_ptr()
    assert three.row_flags is None      # past the real rows: not their own
    mixed = SamplingBatch.from_params([g, s], [1, 2])
    with pytest.raises(ValueError, match="not all greedy"):
        mixed.first_rows(1)
