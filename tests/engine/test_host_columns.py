"""The per-iteration host work written over columns (h56) equals the row-at-a-time code it
replaced, on random cases (property-based): the step queued ahead's row match
(``subset_rows``), VERIFY's and the step ahead's input rows (``verify_inputs``,
``ahead_inputs``), and the page reservations that call ``resize`` only for rows whose page
count changes (``PageTable.resize_many``)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specloop.engine._ahead import subset_rows
from specloop.engine._request import Request
from specloop.engine._verify import ahead_inputs, verify_inputs
from specloop.models import PageTable
from specloop.models._host import int64_tensor
from specloop.samplers import SamplingBatch, SamplingParams

PARAMS = SamplingParams(temperature=0.0)


def request(i: int, length: int, slot: int) -> Request:
    ids = [(7 * i + j) % 50 for j in range(length)]
    return Request(f"r{i}", (1,), PARAMS, i, ids, slot=slot)


def subset_rows_per_row(batch, queued, seq_lens):
    """The row-at-a-time walk (before h56), as the reference."""
    if len(batch) > len(queued):
        return None
    rows, i = [], 0
    for r in batch:
        while i < len(queued) and queued[i] is not r:
            i += 1
        if i == len(queued) or r.seq_len != seq_lens[i]:
            return None
        rows.append(i)
        i += 1
    return rows


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_subset_rows_equals_the_row_walk(data):
    n = data.draw(st.integers(0, 8))
    queued = [request(i, data.draw(st.integers(1, 6)), i) for i in range(n)]
    lens = [r.seq_len + data.draw(st.sampled_from([0, 0, 0, 1])) for r in queued]
    kind = data.draw(st.sampled_from(["same", "subset", "permuted", "other"]))
    if kind == "same":
        batch = list(queued)
    elif kind == "subset":
        batch = [r for r in queued if data.draw(st.booleans())]
    elif kind == "permuted":
        batch = data.draw(st.permutations(queued))
    else:
        batch = [request(100 + i, 3, i) for i in range(data.draw(st.integers(0, n)))]
    assert subset_rows(batch, tuple(queued), lens) == subset_rows_per_row(batch, queued, lens)


def verify_inputs_per_row(batch, drafts, sampling, k, scratch):
    rows, real = sampling.size, len(batch)
    flat = []
    for r in batch:
        flat += (r.token_ids[-1], *[0] * k, len(r.token_ids) - 1, r.batch_slot)
    flat += [*[0] * k, 0, 0, scratch] * (rows - real)
    host = int64_tensor(flat).view(rows, k + 3)
    if k and real:
        host[:real, 1:k + 1] = drafts
    return host


def ahead_inputs_per_row(batch, source_rows, joining, rows, scratch):
    flat = []
    for r, row in zip(batch, source_rows):
        flat += (0, len(r.token_ids), r.batch_slot, row)
    for r in joining:
        flat += (r.token_ids[-1], len(r.token_ids) - 1, r.batch_slot, 0)
    pad = rows - len(batch) - len(joining)
    return int64_tensor(flat + [0, 0, 9, 0] * pad).view(rows, 4)


@settings(max_examples=100, deadline=None)
@given(real=st.integers(0, 6), joiners=st.integers(0, 3), pad=st.integers(0, 3),
       k=st.integers(0, 3), seed=st.integers(0, 100))
def test_input_rows_equal_the_row_at_a_time_build(real, joiners, pad, k, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (real + joiners,), generator=g).tolist()
    slots = torch.randperm(16, generator=g)[:real + joiners].tolist()
    batch = [request(i, lengths[i], slots[i]) for i in range(real)]
    joining = [request(i, lengths[i], slots[i]) for i in range(real, real + joiners)]
    rows = real + joiners + pad
    sampling = SamplingBatch.from_params([PARAMS] * (real + joiners), list(range(real + joiners)),
                                         pad_to=rows)
    drafts = torch.randint(0, 50, (real, k), generator=g)
    got = verify_inputs(batch + joining, drafts if not joiners else None, None, sampling,
                        k=k if not joiners else 0, scratch_slot=9, device="cpu")
    width = k if not joiners else 0
    want = verify_inputs_per_row(batch + joining, drafts, sampling, width, 9)
    assert torch.equal(got["tokens"], want[:, :width + 1])
    assert torch.equal(got["start_pos"], want[:, width + 1])
    assert torch.equal(got["slots"], want[:, width + 2])
    last = torch.randint(0, 50, (real + 2, 1), generator=g)
    source = torch.randperm(real + 2, generator=g)[:real].tolist()
    got = ahead_inputs(batch, last, source, sampling, scratch_slot=9, device="cpu",
                       joining=joining)
    want = ahead_inputs_per_row(batch, source, joining, rows, 9)
    want[:real, 0] = last[source, 0] if real else want[:real, 0]
    assert torch.equal(got["tokens"][:, 0], want[:, 0])
    assert torch.equal(got["start_pos"], want[:, 1])
    assert torch.equal(got["slots"], want[:, 2])


@settings(max_examples=100, deadline=None)
@given(page=st.integers(1, 5), ops=st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 30), st.booleans()), min_size=1,
    max_size=40))
def test_growing_never_gives_pages_back(page, ops):
    """Any mix of reservations (``resize_many(shrink=False)``) and trims: a reservation
    leaves a slot at least as many pages as it held and as its length needs, adds pages
    only where the length needs more, and every page is owned once or free."""
    pages = PageTable(4, 24, page)
    for slot, length, grow in ops:
        before = pages.pages_of(slot)
        if grow:
            pages.resize_many([(slot, length)], shrink=False)
            need = min(-(-length // page), pages.pages_per_slot)
            after = pages.pages_of(slot)
            assert after[:len(before)] == before
            assert len(after) == max(len(before), need)
        else:
            pages.resize_many([(slot, length)])
        owned = [p for s in range(4) for p in pages.pages_of(s)]
        assert len(set(owned)) == len(owned)
        assert len(owned) + pages.num_free == pages.num_pages


@settings(max_examples=100, deadline=None)
@given(page=st.integers(1, 5), ops=st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 30)), min_size=1, max_size=40))
def test_resizing_only_rows_that_change_leaves_the_table_of_resizing_all(page, ops):
    """Any (slot, length) sequence: the same pages, page table and free list as calling
    ``resize`` for every row."""
    every = PageTable(4, 24, page)
    pages = PageTable(4, 24, page)
    for i in range(0, len(ops), 3):
        chunk = ops[i:i + 3]
        pages.resize_many(chunk)
        for slot, length in chunk:
            every.resize(slot, length)
        assert [pages.pages_of(s) for s in range(4)] == [every.pages_of(s) for s in range(4)]
        assert torch.equal(pages.host, every.host)
        assert pages.num_free == every.num_free


def resize_many_by_count(pages, lengths, shrink=True):
    """``resize_many`` comparing page counts (before the slots' bounds), the reference."""
    size, most = pages.page_size, pages.pages_per_slot
    for slot, length in lengths:
        want = min(-(-length // size) if length > 0 else 0, most)
        have = len(pages.pages_of(slot))
        if have < want or shrink and have > want:
            pages.resize(slot, length)


@settings(max_examples=150, deadline=None)
@given(page=st.integers(1, 5), max_len=st.integers(1, 26), ops=st.lists(
    st.tuples(st.integers(0, 3), st.integers(-2, 30), st.integers(0, 3)), min_size=1,
    max_size=40))
def test_runner_reserve_and_trim_through_slot_bounds_equal_page_counts(page, max_len, ops):
    """``ModelRunner.reserve`` / ``trim_many`` and ``resize_many`` (both skipping rows
    through ``grow_at`` / ``shrink_at``) against the page-count comparison: the same
    ``resize`` calls in the same order (pages, table, free list, changed rows), and each
    slot's bounds are exactly the lengths its page count holds."""
    from specloop.engine._runner import ModelRunner

    class Stub:
        keep_ahead = 1

    def runner_for(table):
        stub = Stub()
        stub.pages = table
        return stub

    got, want = PageTable(4, max_len, page), PageTable(4, max_len, page)
    calls, want_calls = [], []
    resize, want_resize = got.resize, want.resize
    got.resize = lambda slot, length: (calls.append((slot, length)), resize(slot, length))
    want.resize = lambda slot, length: (want_calls.append((slot, length)),
                                        want_resize(slot, length))
    runner = runner_for(got)
    for i in range(0, len(ops), 3):
        chunk = ops[i:i + 3]
        kind = chunk[0][2]
        calls.clear()
        want_calls.clear()
        if kind == 0:       # reserve: len(token_ids) + extra, pages only added
            extra = chunk[0][1] % 4
            batch = [request(j, max(length, 0), slot) for j, (slot, length, _) in
                     enumerate(chunk)]
            ModelRunner.reserve(runner, batch, extra)
            lengths = [(r.slot, len(r.token_ids) + extra) for r in batch]
            resize_many_by_count(want, lengths, shrink=False)
            want.sync()
        elif kind == 1:     # trim_many: num_cached + keep_ahead, both ways
            runner.keep_ahead = chunk[0][1] % 4
            batch = [request(j, 1, slot) for j, (slot, _, _) in enumerate(chunk)]
            for r, (_, length, _) in zip(batch, chunk):
                r.num_cached = max(length, 0)
            ModelRunner.trim_many(runner, batch)
            lengths = [(r.slot, r.num_cached + runner.keep_ahead) for r in batch]
            resize_many_by_count(want, lengths)
        else:
            lengths = [(slot, length) for slot, length, _ in chunk]
            got.resize_many(lengths, shrink=kind == 2)
            resize_many_by_count(want, lengths, shrink=kind == 2)
        assert calls == want_calls
        assert [got.pages_of(s) for s in range(4)] == [want.pages_of(s) for s in range(4)]
        assert torch.equal(got.host, want.host)
        assert got._free == want._free
        assert got._dirty == want._dirty
        for s in range(5):
            have = len(got.pages_of(s))
            for length in range(-2, 32):
                holds = min(-(-length // page) if length > 0 else 0, got.pages_per_slot)
                assert (holds == have) == (got.shrink_at[s] < length <= got.grow_at[s])


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_sampling_rows_equal_from_params_but_greedy_batches_seeds(data):
    """``RankWorker._sampling_batch`` over random batch changes (greedy and sampled
    requests, padded and not): the flags and every column from_params gives, except
    that an all-greedy batch may keep the last all-greedy batch's seeds (no row reads
    them), and then its columns are the same tensors (nothing built or copied)."""
    from types import SimpleNamespace


    from specloop.engine._worker import RankWorker

    sampled = SamplingParams(temperature=0.8, top_p=0.9)
    pool = [Request(f"q{i}", (1,), sampled if data.draw(st.booleans()) else PARAMS, 1000 + i,
                    [1, 2], slot=i) for i in range(6)]
    worker = SimpleNamespace(_sampling_cache={}, runner=SimpleNamespace(device="cpu"))
    worker._sampling_batch = lambda b, p: RankWorker._sampling_batch(worker, b, p)
    for _ in range(data.draw(st.integers(1, 8))):
        batch = data.draw(st.lists(st.sampled_from(pool), unique=True, max_size=6))
        pad = data.draw(st.sampled_from([None, 6, 8]))
        before = worker._sampling_cache.get(None if pad == len(batch) else pad)
        got = worker._sampling_batch(batch, pad)
        want = SamplingBatch.from_params([r.params for r in batch], [r.seed for r in batch],
                                         pad_to=pad)
        flags = ("all_greedy", "num_real", "needs_sort", "needs_min_p", "any_greedy")
        assert [getattr(got, f) for f in flags] == [getattr(want, f) for f in flags]
        greedy = all(r.params.is_greedy for r in batch)
        for name in SamplingBatch.COLUMNS:
            if name != "seeds" or not greedy:
                assert torch.equal(getattr(got, name), getattr(want, name)), name
        if greedy and pad is not None and pad != len(batch) and before is not None \
                and before[0] != tuple(batch) and before[1].all_greedy:
            assert all(getattr(got, n) is getattr(before[1], n) for n in got.COLUMNS)


@given(sizes=st.lists(st.lists(st.integers(1, 700), min_size=1, max_size=3),
                      min_size=1, max_size=20))
@settings(max_examples=40, deadline=None)
def test_staging_ring_copies_each_buffer_into_its_destinations_in_order(sizes):
    """``StagingRing.copy_into``: a buffer's leading elements land in the destinations one
    after another (each flattened), whatever the buffer's turn in the ring and however
    large a take grows the buffers."""
    from specloop.models._host import StagingRing

    ring = StagingRing(torch.device("cpu"), torch.int64)
    for call, parts in enumerate(sizes):
        host, i = ring.take(sum(parts))
        host[:sum(parts)] = [1000 * call + j for j in range(sum(parts))]
        dsts = [torch.full((n,), -1, dtype=torch.int64).view(1, n) for n in parts]
        ring.copy_into(i, dsts)
        got = torch.cat([d.view(-1) for d in dsts]).tolist()
        assert got == [1000 * call + j for j in range(sum(parts))]
