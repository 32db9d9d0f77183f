"""The target rows an EAGLE head has not been fed yet, per slot (mtp_eagle, eagle3).

After each VERIFY the rows the target committed wait here until the next DRAFT's catch-up
feeds them to the head: slot s holds ``count[s]`` rows for positions ``start[s]..``. Rows
of adaptive K's K = 0 iterations pile up (the buffer is deeper then); when it is full the
older ones are dropped (the head drafts with a gap in its cache: weaker drafts, never
wrong outputs).

``verified`` of a VERIFY that drafted (K > 0, drafts accepted or not) is deferred: it
records the call and nothing else. The next read (DRAFT's inputs, a prompt's first row, a
K = 0 row) makes the deferred stores, in order; a chained step that fed a slot's rows on
the device (``zero``, engine/_chain.py) takes the slot out of every deferred call, and a
call with no slot left is dropped. So a taken chained step costs neither host nor GPU work
here. ``hidden`` of a deferred call is
a fresh eager output, or a static tensor that only a replay of its graph overwrites, and
that replay comes after DRAFT's read (which makes the stores first) or after DRAFT dropped
the call: a captured VERIFY's output (the next replay of that VERIFY graph is queued by
DRAFT's successor), or, chained, the draft graph's static copy of VERIFY's rows (every
slot of the call is then consumed by the chained step, or released, or read by the
drafter's own DRAFT before its replay).
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from .._host import int64_tensor, to_device


@attrs.define(eq=False)
class _Verified:
    """A deferred ``verified`` call; ``live``: its slots not zeroed since."""

    slots: Sequence[int]
    start_pos: Sequence[int]
    hidden: torch.Tensor
    num_accepted: Sequence[int]
    live: set[int]


class PendingRows:
    """``buffer`` [num_slots + 1, depth, width]: slot s's rows 0..count-1 are the target
    rows at positions start.. (``counts``/``starts`` read them; both make deferred stores
    first). Callers never modify the lists they hand over."""

    def __init__(self, num_slots: int, depth: int, width: int, *, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.buffer = torch.zeros(num_slots + 1, depth, width, dtype=dtype, device=device)
        self._start = [0] * (num_slots + 1)
        self._count = [0] * (num_slots + 1)
        self._deferred: list[_Verified] = []

    @property
    def depth(self) -> int:
        """Rows a slot can hold (older ones are dropped past it)."""
        return int(self.buffer.shape[1])

    @property
    def deferred(self) -> int:
        """Calls not stored yet (tests)."""
        return len(self._deferred)

    def counts(self, slots: Sequence[int]) -> list[int]:
        self.flush()
        count = self._count
        return [count[s] for s in slots]

    def starts(self, slots: Sequence[int]) -> list[int]:
        self.flush()
        start = self._start
        return [start[s] for s in slots]

    def rows(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        """[len(slots), width, F]: each slot's first ``width`` rows (gathered)."""
        self.flush()
        return self.buffer[slots, :width]

    def prompt(self, slot: int, n: int, hidden: torch.Tensor) -> None:
        """A new request's n-token prompt: its last target row (position n - 1) waits."""
        self.zero([slot])
        if n >= 1:
            self.buffer[slot, 0] = hidden[n - 1]
        else:
            # A 1-token prompt has no target row: the head starts from zeros, never from
            # what the slot's previous user left here.
            self.buffer[slot].zero_()
        self._start[slot] = max(n - 1, 0)
        self._count[slot] = 1 if n else 0

    def prompt_rows(self, slots: Sequence[int]) -> torch.Tensor:
        """[len(slots), F]: each slot's one pending row, its prompt's last target row
        (``prompt``; no deferred call stores into a slot after it). Raises where a slot
        holds another count (a 1-token prompt holds none; a slot drafted from since)."""
        count = self._count
        wrong = [s for s in slots if count[s] != 1]
        if wrong:
            raise ValueError(f"slots {wrong} hold {[count[s] for s in wrong]} pending rows; "
                             f"a newly prefilled prompt's slot holds 1")
        index = self._to_device(int64_tensor(slots))
        return self.buffer[:, 0].index_select(0, index)

    def zero(self, slots: Sequence[int]) -> None:
        """These slots' rows are dead (fed to the head, or the request left): count 0,
        and no deferred call stores into them any more (the next store into an empty
        slot starts at row 0)."""
        count = self._count
        for s in slots:
            count[s] = 0
        if self._deferred:
            for call in self._deferred:
                call.live.difference_update(slots)
            self._deferred = [c for c in self._deferred if c.live]

    def verified(self, slots: Sequence[int], start_pos: Sequence[int], hidden: torch.Tensor,
                 num_accepted: Sequence[int]) -> None:
        """hidden [B, K+1, F] of VERIFY at positions start_pos..; rows 0..n are committed.
        Rows not yet fed are kept and these appended after them when they continue them.
        Deferred when VERIFY drafted (even if it accepted nothing: a chained step then
        consumes the rows, at batch 1 often); a K = 0 step's one row per request is
        stored now (its ``hidden`` may be a step queued ahead's output, which the next
        one overwrites)."""
        if hidden.shape[1] > 1 or any(num_accepted):
            self._deferred.append(_Verified(slots, start_pos, hidden, num_accepted,
                                            set(slots)))
        else:
            self._append_first_rows(slots, start_pos, hidden)

    def flush(self) -> None:
        """Make the deferred stores, oldest first."""
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        for call in deferred:
            self._store(call)

    def _store(self, call: _Verified) -> None:
        """buffer[slot, row] = hidden[batch row, i] for each committed row of a live slot:
        one gather and one scatter whatever the batch (a copy per row cost a launch per
        row on the GPU), after one host-to-device copy; over flat row indices
        (index_select / index_copy_: half the host time of two-dimensional indexing)."""
        depth, count, start = self.buffer.shape[1], self._count, self._start
        live, hidden = call.live, call.hidden
        width = hidden.shape[1]
        # buffer row slot * depth + pending row <- hidden row batch row * width + VERIFY row
        dst: list[int] = []
        src: list[int] = []
        for row, (slot, at, n) in enumerate(zip(call.slots, call.start_pos,
                                                call.num_accepted)):
            if slot not in live:
                continue
            have = count[slot]
            if have and start[slot] + have == at and have + n + 1 <= depth:
                first = have
                count[slot] = have + n + 1
            else:
                first = 0
                start[slot], count[slot] = at, n + 1
            at, fro = slot * depth + first, row * width
            dst += range(at, at + n + 1)
            src += range(fro, fro + n + 1)
        if not dst:
            return
        index = self._to_device(int64_tensor(dst + src))
        to, of = index[:len(dst)], index[len(dst):]
        features = hidden.shape[2]
        if hidden.is_contiguous():
            rows = hidden.view(-1, features).index_select(0, of)
        else:   # a slice of wider rows (adaptive K): the same rows, two-dimensional
            rows = hidden[of // width, of % width]
        self.buffer.view(-1, features).index_copy_(0, to, rows)

    def _append_first_rows(self, slots: Sequence[int], start_pos: Sequence[int],
                           hidden: torch.Tensor) -> None:
        """``verified`` of a K = 0 step (adaptive K: each batch row one row), with one
        index entry per request: the same bookkeeping, a fraction of the host time at a
        large batch. Made now: ``hidden`` may be a step queued ahead's output, which the
        next one overwrites."""
        self.flush()
        depth, count_of, start_of = self.buffer.shape[1], self._count, self._start
        rows: list[int] = []
        for slot, start in zip(slots, start_pos):
            count = count_of[slot]
            if count and start_of[slot] + count == start and count < depth:
                count_of[slot] = count + 1
            else:
                start_of[slot], count_of[slot], count = start, 1, 0
            rows.append(count)
        index = self._to_device(int64_tensor([s * depth + r for s, r in zip(slots, rows)]))
        self.buffer.view(-1, self.buffer.shape[2]).index_copy_(0, index, hidden[:len(rows), 0])

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        # Without waiting: a copy from pageable memory would wait for the DRAFT + VERIFY
        # chained behind this VERIFY (the GPU then idles while the host runs up to the next
        # chained step: ~0.3 ms an iteration at batch 1).
        return to_device(host, self.buffer.device)
