"""Paged KV cache: pages never leak or get shared, and paged attention equals a dense one.

The dense reference is the same decoder over a cache with one page per slot (the layout
before paging) on the whole sequence at once; the paged side grows, rewinds across page
boundaries, finishes and reuses pages like the engine does.
"""

import copy
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specloop.models import CacheFullError, PageTable

NUM_SLOTS, MAX_LEN = 3, 40


@st.composite
def _ops(draw):
    page_size = draw(st.sampled_from([1, 3, 4, 16]))
    ops = draw(st.lists(st.tuples(st.sampled_from(["resize", "release"]),
                                  st.integers(0, NUM_SLOTS - 1), st.integers(0, MAX_LEN + 8)),
                        max_size=40))
    return page_size, ops


@settings(max_examples=150, deadline=None)
@given(_ops())
def test_pages_never_leak_or_get_shared(case):
    """After any mix of grow / rewind / finish, owned + free pages == the total, no page is
    owned twice, and the device table maps exactly the owned pages (a copy of its own, as
    on a GPU, where only ``sync``'s scatter of the changed entries brings it up to date)."""
    page_size, ops = case
    table = PageTable(NUM_SLOTS, MAX_LEN, page_size, num_pages=NUM_SLOTS * 6)
    table.table = table.host.clone()
    for op, slot, length in ops:
        try:
            if op == "resize":
                table.resize(slot, length)
            else:
                table.release(slot)
        except CacheFullError:
            pass
        owned = [p for s in range(NUM_SLOTS) for p in table.pages_of(s)]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert sorted(owned + table._free) == list(range(table.num_pages)), "a page leaked"
        table.sync()
        for s in range(NUM_SLOTS + 1):
            pages = table.pages_of(s) if s < NUM_SLOTS else ()
            row = table.table[s].tolist()
            assert row[:len(pages)] == list(pages)
            assert set(row[len(pages):]) <= {table.scratch_page}
    for s in range(NUM_SLOTS):
        table.release(s)
    assert table.num_free == table.num_pages


def test_cache_full_names_the_fix():
    table = PageTable(2, 32, 4, num_pages=5)
    table.resize(0, 16)
    with pytest.raises(CacheFullError, match="max_batch_size"):
        table.resize(1, 8)
    assert table.pages_of(1) == () and table.num_free == 1


def _dense_logits(model, seq):
    """Reference: the whole sequence in one forward over a one-page-per-slot cache."""
    cache = model.make_cache(1, MAX_LEN * 2, page_size=MAX_LEN * 2)
    ids = torch.tensor([seq])
    return model.logits(model(ids, torch.tensor([0]), torch.tensor([0]), cache))[0]


def _random_ids(rng, n, vocab):
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_paged_equals_dense_through_growth_rewind_and_reuse(tiny_llama, seed):
    """Engine-like use in float64: chunked prefill, VERIFY steps of K+1 tokens in ragged
    batches, rejected drafts rewound across page boundaries (pages given back), requests
    finishing and their pages reused by new ones; every logit row equals the dense
    reference's for the same sequence."""
    model = copy.deepcopy(tiny_llama.model).to(torch.float64)
    rng = random.Random(seed)
    V, k = tiny_llama.args.vocab_size, rng.choice([1, 3, 4])
    page_size = rng.choice([1, 2, 3, 5, 8])
    pages = PageTable(NUM_SLOTS, MAX_LEN * 2, page_size)
    cache = model.make_cache(NUM_SLOTS, MAX_LEN * 2, pages=pages)
    seqs: dict[int, list[int]] = {}
    for _ in range(14):
        for slot in range(NUM_SLOTS):
            if slot not in seqs or (len(seqs[slot]) > MAX_LEN - k - 2):
                pages.release(slot)  # finish; the next request reuses pages
                seqs[slot] = _random_ids(rng, rng.randrange(2, 12), V)
                prompt = seqs[slot]
                pages.resize(slot, len(prompt))
                start = 0
                while start < len(prompt) - 1:  # chunked prefill, all but the last token
                    end = min(len(prompt) - 1, start + rng.randrange(1, 6))
                    model(torch.tensor([prompt[start:end]]), torch.tensor([start]),
                          torch.tensor([slot]), cache)
                    start = end
        slots = list(seqs)
        for s in slots:
            pages.resize(s, len(seqs[s]) + k)
        drafts = {s: _random_ids(rng, k, V) for s in slots}
        tokens = torch.tensor([[seqs[s][-1]] + drafts[s] for s in slots])
        starts = torch.tensor([len(seqs[s]) - 1 for s in slots])
        got = model.logits(model(tokens, starts, torch.tensor(slots), cache))
        for row, s in enumerate(slots):
            ref = _dense_logits(model, seqs[s] + drafts[s])[len(seqs[s]) - 1:]
            torch.testing.assert_close(got[row], ref, rtol=1e-9, atol=1e-9)
            accepted = rng.randrange(0, k + 1)
            seqs[s] = seqs[s] + drafts[s][:accepted] + _random_ids(rng, 1, V)
            pages.resize(s, len(seqs[s]) - 1)  # rewind: pages past the committed K/V go back
    for slot in range(NUM_SLOTS):
        pages.release(slot)
    assert pages.num_free == pages.num_pages


def test_sync_inside_and_outside_inference_mode():
    """The staging ring made by a sync under inference mode (a forward's) serves a sync
    outside it (RESCAN's trims, the next step's reservations), and the other way round."""
    table = PageTable(4, 64, 4)
    table.table = table.host.clone()    # a copy of its own, as on a GPU
    with torch.inference_mode():
        table.resize(0, 10)
        table.sync()
    table.resize(1, 10)
    table.sync()
    with torch.inference_mode():
        table.resize(2, 10)
        table.sync()
    assert torch.equal(table.table, table.host)
