"""The EAGLE drafters' pending target rows with on_verified's deferred stores.

on_verified records the call and makes its bookkeeping and store at the next read (a
chained step usually consumes the rows first: then nothing is stored,
models/drafters/_pending_rows.py). Whatever the order of calls, what the drafter reads
must be what storing at once would have left: checked against a twin drafter that stores
at once (its deferral undone).
"""

from types import SimpleNamespace

import pytest
import torch

from specloop.models import load_model
from specloop.models.drafters._mtp import MtpEagleDrafter
from specloop.models.drafters._protocol import DrafterDeps
from specloop.models.testing import write_tiny_checkpoint


class _AtOnce(MtpEagleDrafter):
    """The same drafter with every store made at once (the reference)."""

    def on_verified(self, *args, **kw):
        super().on_verified(*args, **kw)
        assert self.pending.deferred <= 1
        self.pending.flush()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m"))


def _drafter(cls, loaded):
    spec = SimpleNamespace(num_draft_tokens=3, adaptive=True, draft_weights=None,
                           draft_dtype="auto", mtp_weights=None, method="mtp_eagle")
    config = SimpleNamespace(speculative=spec, parallel=SimpleNamespace(lm_head_tp_in_adp=False))
    cache = loaded.model.make_cache(4, 128)
    return cls(config, DrafterDeps(loaded, cache, 4, 128))


def _rows(d, slot):
    return d.pending.buffer[slot, :d.pending.counts([slot])[0]].clone()


@pytest.mark.parametrize("seed", range(6))
def test_deferred_stores_leave_what_stores_at_once_leave(loaded, seed):
    """Random sequences of prompts, VERIFY results (accepted or not, rows continuing a
    slot's or not), chained consumptions of all or some slots and releases: the rows each
    slot holds up to its count equal the at-once twin's."""
    g = torch.Generator().manual_seed(seed)
    ours, ref = _drafter(MtpEagleDrafter, loaded), _drafter(_AtOnce, loaded)
    H = loaded.args.hidden_size
    length = [0] * 4
    for d in (ours, ref):
        for slot in range(4):
            d.pending.prompt(slot, 3, torch.full((3, H), float(slot)))
    length = [3] * 4
    for step in range(40):
        op = int(torch.randint(0, 10, (1,), generator=g))
        slots = [s for s in range(4) if torch.rand(1, generator=g) < 0.7] or [0]
        if op < 6:          # a VERIFY: rows at each slot's last position
            hidden = torch.randn(len(slots), 4, H, generator=g)
            accepted = [int(torch.randint(0, 4 if op < 5 else 1, (1,), generator=g))
                        for _ in slots]
            starts = [length[s] - 1 for s in slots]
            for d in (ours, ref):
                d.on_verified(slots, starts, hidden, accepted)
            for s, n in zip(slots, accepted):
                length[s] += n + 1
        elif op < 8:        # a chained step took these slots' rows
            for d in (ours, ref):
                d.chained_consumed(slots)
        elif op < 9:        # a request left, another took its slot
            s = slots[0]
            for d in (ours, ref):
                d.release(s)
                d.pending.prompt(s, 5, torch.full((5, H), 100.0 + step))
            length[s] = 5
        else:               # DRAFT read the rows (the graph's inputs)
            for s in slots:
                assert torch.equal(_rows(ours, s), _rows(ref, s)), (step, s)
            held = [s for s in slots if ours.pending.counts([s])[0]]   # else start unused
            assert ours.pending.starts(held) == ref.pending.starts(held), step
    for s in range(4):
        assert torch.equal(_rows(ours, s), _rows(ref, s)), s


def test_chained_consumption_drops_the_store(loaded):
    """Rows a chained step consumed are never stored (no work), rows of a slot it did not
    consume are."""
    d = _drafter(MtpEagleDrafter, loaded)
    H = loaded.args.hidden_size
    for slot in (0, 1):
        d.pending.prompt(slot, 4, torch.zeros(4, H))
    d.on_verified([0, 1], [3, 3], torch.ones(2, 4, H), [2, 1])
    d.chained_consumed([0, 1])
    assert d.pending.deferred == 0
    d.on_verified([0, 1], [6, 5], torch.full((2, 4, H), 2.0), [1, 2])
    d.chained_consumed([0])
    assert d.pending.deferred == 1
    assert d.pending.counts([0, 1]) == [0, 3]
    assert torch.equal(_rows(d, 1), torch.full((3, H), 2.0))
    # A released slot is dropped from the deferred call too; the call goes when empty.
    d.on_verified([0, 1], [8, 8], torch.full((2, 4, H), 3.0), [1, 1])
    d.release(1)
    d.chained_consumed([0])
    assert d.pending.deferred == 0 and d.pending.counts([0, 1]) == [0, 0]


def test_a_verify_that_accepted_nothing_is_deferred_too(loaded):
    """A VERIFY that drafted but accepted nothing (batch 1: often) is deferred as any
    other, so a chained step that consumes its rows costs no store; a K = 0 step's row
    (width 1: possibly a step queued ahead's output) is stored at once."""
    d = _drafter(MtpEagleDrafter, loaded)
    H = loaded.args.hidden_size
    for slot in (0, 1):
        d.pending.prompt(slot, 4, torch.zeros(4, H))
    d.on_verified([0, 1], [3, 3], torch.ones(2, 4, H), [0, 0])
    assert d.pending.deferred == 1
    d.chained_consumed([0, 1])
    assert d.pending.deferred == 0 and d.pending.counts([0, 1]) == [0, 0]
    d.on_verified([0, 1], [4, 4], torch.full((2, 4, H), 2.0), [0, 0])
    d.on_verified([0], [5], torch.full((1, 1, H), 3.0), [0])     # K = 0: stored now
    assert d.pending.deferred == 0
    assert torch.equal(_rows(d, 0), torch.tensor([2.0, 3.0])[:, None].expand(2, H))
    assert torch.equal(_rows(d, 1), torch.full((1, H), 2.0))


@pytest.mark.parametrize("sliced", [False, True])
def test_rows_hold_the_committed_verify_rows(loaded, sliced):
    """What a slot holds is its prompt's last row, then each VERIFY's committed rows in
    order (rows continuing the slot's positions are appended, others start over);
    ``sliced``: VERIFY's rows are a slice of wider rows (adaptive K's chained copy)."""
    d = _drafter(MtpEagleDrafter, loaded)
    H = loaded.args.hidden_size
    prompt = torch.randn(3, H)
    for slot in (0, 2):
        d.pending.prompt(slot, 3, prompt + slot)
    wide = torch.randn(2, 6, H)
    hidden = wide[:, :4] if sliced else wide[:, :4].contiguous()
    d.on_verified([2, 0], [3, 3], hidden, [1, 3])           # both continue position 2
    assert torch.equal(_rows(d, 2), torch.cat([prompt[2:] + 2, hidden[0, :2]]))
    assert torch.equal(_rows(d, 0), torch.cat([prompt[2:], hidden[1, :4]]))
    later = torch.randn(1, 4, H)
    d.on_verified([0], [9], later, [0])                      # not after slot 0's rows
    assert torch.equal(_rows(d, 0), later[0, :1])
    d.chained_consumed([2])
    d.on_verified([2], [5], later, [2])
    assert torch.equal(_rows(d, 2), later[0, :3])
