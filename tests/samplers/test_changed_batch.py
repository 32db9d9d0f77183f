"""Incremental sampling rows at a batch change (h59): ``SamplingBatch.changed`` and
``RankWorker._sampling_batch`` over random sequences of batch changes equal
``SamplingBatch.from_params`` of the new batch, field by field, bit for bit."""

import array
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specloop.engine._request import Request
from specloop.engine._worker import RankWorker, _kept_runs
from specloop.samplers import SamplingBatch, SamplingParams

FLAGS = ("all_greedy", "num_real", "needs_sort", "needs_min_p", "any_greedy")

# Edge values too: a top-p or min-p that float32 rounds to 1 or 0 still sets the flag.
params_st = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 1e-6, 0.7, 1.0, 2.5]),
    top_k=st.sampled_from([0, 1, 5, 2**63 - 1]),
    top_p=st.sampled_from([1.0, 0.9, 1 - 2**-30]),
    min_p=st.sampled_from([0.0, 0.05, 1e-50]),
)


def assert_same(got: SamplingBatch, want: SamplingBatch) -> None:
    assert [getattr(got, f) for f in FLAGS] == [getattr(want, f) for f in FLAGS]
    for name in SamplingBatch.COLUMNS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert dict(got.host) == dict(want.host)
    assert got.row_flags == want.row_flags


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_worker_batch_changes_equal_from_params(data):
    """Random sequences of batch changes (rows end anywhere, some join at the end, now
    and then a reordered or unrelated batch; greedy and sampled rows with random params
    and seeds; padded or not): every batch equals from_params's, but for an all-greedy
    batch's seeds (h56: it keeps the last all-greedy batch's columns)."""
    pool = [Request(f"q{i}", (1,), data.draw(params_st),
                    data.draw(st.integers(0, 2**63 - 1)), [1, 2], slot=i) for i in range(12)]
    worker = SimpleNamespace(_sampling_cache={}, runner=SimpleNamespace(device="cpu"))
    worker._sampling_batch = lambda b, p: RankWorker._sampling_batch(worker, b, p)
    batch: list[Request] = []
    for _ in range(data.draw(st.integers(1, 10))):
        kind = data.draw(st.sampled_from(["change"] * 4 + ["permute", "other"]))
        if kind == "change":
            batch = [r for r in batch if data.draw(st.integers(0, 3))]
            free = [r for r in pool if r not in batch]
            batch += data.draw(st.lists(st.sampled_from(free), unique=True, max_size=4)
                               if free else st.just([]))
        elif kind == "permute":
            batch = data.draw(st.permutations(batch))
        else:
            batch = data.draw(st.lists(st.sampled_from(pool), unique=True, max_size=12))
        for pad in data.draw(st.lists(st.sampled_from([None, 12, 16]), min_size=1,
                                      max_size=2)):
            got = worker._sampling_batch(batch, pad)
            want = SamplingBatch.from_params([r.params for r in batch],
                                             [r.seed for r in batch], pad_to=pad)
            assert [getattr(got, f) for f in FLAGS] == [getattr(want, f) for f in FLAGS]
            greedy = all(r.params.is_greedy for r in batch)
            for name in SamplingBatch.COLUMNS:
                if name != "seeds" or not greedy:
                    assert torch.equal(getattr(got, name), getattr(want, name)), name
            if got.row_flags is not None:   # its host values are its rows' own
                assert_same(got, want)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_changed_equals_from_params(data):
    """``changed`` from a batch (itself from_params or changed) with random kept runs,
    joining rows and padding: from_params of the resulting rows, field by field."""
    rows = data.draw(st.lists(st.tuples(params_st, st.integers(0, 2**63 - 1)),
                              max_size=10))
    pad = data.draw(st.sampled_from([None, 10, 16]))
    base = SamplingBatch.from_params([p for p, _ in rows], [s for _, s in rows],
                                     pad_to=pad)
    for _ in range(data.draw(st.integers(1, 3))):
        cuts = sorted(data.draw(st.lists(st.integers(0, len(rows)), max_size=6)))
        keep = [(a, b) for a, b in zip(cuts[::2], cuts[1::2])]
        new = data.draw(st.lists(st.tuples(params_st, st.integers(0, 2**63 - 1)),
                                 max_size=4))
        rows = [row for a, b in keep for row in rows[a:b]] + new
        pad = data.draw(st.sampled_from([None, len(rows), len(rows) + 3, 16]))
        pad = None if pad is not None and pad < len(rows) else pad
        like = data.draw(st.sampled_from([None, base]))
        base_was = base
        base = base.changed(keep, [p for p, _ in new], [s for _, s in new], pad_to=pad,
                            like=like)
        want = SamplingBatch.from_params([p for p, _ in rows], [s for _, s in rows],
                                         pad_to=pad, like=like)
        assert_same(base, want)
        sampled = [p for p, _ in rows if not p.is_greedy]   # the flags from the params
        assert (want.all_greedy, want.needs_sort, want.needs_min_p, want.any_greedy) == (
            not sampled, any(p.top_k > 0 or p.top_p < 1 for p in sampled),
            any(p.min_p > 0 for p in sampled),
            want.size > len(rows) or len(sampled) < len(rows))
        for name in SamplingBatch.COLUMNS:  # ``like``'s tensors kept where from_params's are
            assert (getattr(base, name) is getattr(base_was, name)) \
                == (getattr(want, name) is getattr(base_was, name)), name


def test_kept_runs_removals_and_joins():
    r = [Request(f"k{i}", (1,), SamplingParams(), i, [1], slot=i) for i in range(8)]
    last = tuple(r[:6])
    assert _kept_runs(last, [r[0], r[2], r[3], r[5], r[6]]) == ([(0, 1), (2, 4), (5, 6)],
                                                                [r[6]])
    assert _kept_runs(last, r[1:5]) == ([(1, 5)], [])
    assert _kept_runs(last, [r[6], r[0]]) is None      # nothing kept at the head
    assert _kept_runs(last, [r[5], r[4], r[3], r[2], r[1], r[0]]) is None  # reordered


def test_changed_needs_its_rows_host_values():
    batch = SamplingBatch.from_params([SamplingParams()], [3], pad_to=4)
    with pytest.raises(ValueError, match="real rows"):
        batch.changed([(0, 2)], [], [])
    with pytest.raises(ValueError, match="seed"):
        batch.changed([(0, 1)], [SamplingParams()], [-1])
    with pytest.raises(ValueError, match="pad_to"):
        batch.changed([(0, 1)], [SamplingParams()] * 2, [1, 2], pad_to=2)
    with pytest.raises(ValueError, match="host values"):
        batch.with_columns(batch.columns()).changed([(0, 1)], [], [])
    # The real rows keep their host values and flags: ``changed`` slices them.
    assert_same(batch.real_rows().changed([(0, 1)], [SamplingParams(temperature=0.5)], [4]),
                SamplingBatch.from_params([SamplingParams(), SamplingParams(temperature=0.5)],
                                          [3, 4]))
    assert isinstance(batch.row_flags, array.array)
