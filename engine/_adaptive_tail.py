"""Adaptive K's tail of the batch: the rows it waits on longest (docs/configuration.md,
"Adaptive K").

A head's acceptance differs from prompt to prompt, and the rows that accept least stay in
the batch longest. Pooled counts see the mean row. A batch whose rows all end (closed
rounds, a burst of requests) lasts as long as its slowest rows, for which a smaller K is
faster: on the H200 at batch 32, K = 1 ended rounds 1.10x faster than no speculation and
K = 3 0.96x, at the same mean rate per iteration, and the rule with pooled counts drafted
K = 3 (docs/performance-history.md, "Newcomers in the chained step").

So for a drafter without draft classes, the rule's E(k) is the tail's: the TAIL_SHARE of
the batch's rows (at least TAIL_MIN_ROWS; none in a batch no larger) with the most tokens
left to their limit keep acceptance counts of their own (decayed as the pooled ones), and
E(k) comes from those, with TAIL_PRIOR_ROWS pseudo-rows at the pooled acceptance. In a
closed round the rows with most left are the slowest; under steady load they are the
newest, early in their answers, where a head accepts least: so the tail decides only
while the batch drains (no request joined for TAIL_QUIET iterations), the pooled counts
otherwise. ``bench/adaptive_sim.py`` (``--closed``,
``--refill``; ``--pooled`` for the rule without the tail) gives the rule 0.97-1.00 of the
best fixed K in closed rounds at batch 32 with the tail, 0.92-0.97 without, and the same
under steady load. On the H200 it did not move the closed rounds: there the tail quarter
accepted ~0.9x the mean row (the simulation's spread gives ~0.6x), and K = 1 and K = 3
came out level for it (docs/performance-history.md, "The batch's tail, and a K not well
measured").

Host work per iteration: an integer compare (the scheduler's admissions against the last
seen); while the batch is quiet, also a set lookup a row at RESCAN (the tail's rows'
acceptance) and the tail itself (a sort of the batch by tokens left) when the batch's size
moved by a quarter or every TAIL_EVERY iterations. Under a server's load the batch is
never quiet for long, and the tail costs the compare alone (a superset test of the batch
against its requests at the last join before, and that set rebuilt at each join: ~7 us at
batch 256 on this repository's CPU, nearly every iteration under load).
"""

from __future__ import annotations

from itertools import compress
from typing import Sequence

from ._request import Request

# The share of the batch's rows whose acceptance the rule takes: those with the most
# tokens left. bench/adaptive_sim.py --closed 128 at batch 32: 1/4 ends closed rounds as
# fast as the best fixed K.
TAIL_SHARE = 0.25
# A tail is at least this many rows, and a batch of no more rows has none (its E(k) the
# pooled counts'): a tail of 1-2 rows, whose counts hold a few iterations each, lost 1-2 %
# to the pooled counts at batch 1 and 8 in the simulation.
TAIL_MIN_ROWS = 4
# The tail's acceptance at draft j: (its accepted + TAIL_PRIOR_ROWS * pooled a_j) / (its
# reached + TAIL_PRIOR_ROWS): a tail that has drafted little looks like the pooled rows.
TAIL_PRIOR_ROWS = 4.0
# The tail is chosen again after this many iterations (steady load: rows come and go at
# one size), when the batch's size moved by more than a quarter since the last choice (a
# draining batch: the tail's share of it), and when the batch no longer has a tail. Not at
# every change of size: under a server's load the size moves by a row nearly every
# iteration, and sorting 64 rows each time cost ~9 us an iteration on the H200's host
# (bench_process_gpu.py --timers; the rows with most tokens left stay the tail while
# others end, so a choice ages slowly).
TAIL_EVERY = 8
# The tail decides E(k) only once no request has joined the batch for this many
# iterations (the batch drains: a closed round, the end of a burst); before, ``rows`` says
# none and E(k) is the pooled counts', and the tail is neither chosen nor counted (its
# counts are the drains' own, held from one drain to the next). Under a
# server's load a request joins every few iterations, and the tail, the rows with most
# tokens left, is then the newest rows, early in their answers, where a head accepts
# least: the shipped eagle3 head's E(3) is 1.93 over answer positions 0-15 and 3.0 from
# 192 on, E(3) / E(2) 1.08 against 1.16 over whole answers (held-out prompts, CPU;
# bench/acceptance_by_position.py). Priced from them, the rule drafted less than the batch
# pays for: bench/adaptive_sim.py at batch 128 under steady load, acceptance rising
# through an answer (--rise 0.25; 6 seeds, medians): 0.970 of the best fixed K with the
# tail at every iteration, 0.986 with it only while the batch drains, 0.988 with the
# pooled counts; batch 32: 0.993, 0.998, 0.998. Closed rounds at batch 32, the tail's
# case: 0.992 at every iteration, 0.988 once quiet for 8 (16: 0.989), 0.967 pooled.
TAIL_QUIET = 8


def _left(request: Request) -> int:
    """Tokens left to the request's limit (-1 before its first commit sets the limit)."""
    limit = request.stop_length
    return limit - len(request.token_ids) if limit else -1


_NONE: frozenset[Request] = frozenset()


class BatchTail:
    """One rank's tail: which rows of its batch are in it (``rows`` before the choice of
    K, ``accepted`` of them after VERIFY)."""

    def __init__(self) -> None:
        self.members = _NONE
        self._size = -1
        self._age = 0
        # The scheduler's admissions as of the last ``rows`` (``Scheduler.admitted``: a
        # request joins the batch only through an admission), and the iterations since
        # one.
        self._admitted = 0
        self._quiet = 0

    def rows(self, batch: Sequence[Request], admitted: int) -> int:
        """The tail's rows in ``batch`` (the next iteration's), ``admitted`` the requests
        its rank's scheduler has admitted so far (``Scheduler.admitted``): 0 where the
        batch has no tail, or has had a request admitted within TAIL_QUIET iterations
        (then it has no members either: none is counted, and it is chosen afresh once the
        batch is quiet)."""
        if admitted == self._admitted:
            self._quiet += 1
        else:
            self._admitted, self._quiet = admitted, 0
        if self._quiet < TAIL_QUIET:
            self.members, self._size = _NONE, -1
            return 0
        self._age += 1
        n, size = len(batch), self._size
        if self._age >= TAIL_EVERY or abs(n - size) * 4 > size or \
                (n <= TAIL_MIN_ROWS and self.members):
            self._size, self._age = n, 0
            take = max(TAIL_MIN_ROWS, round(n * TAIL_SHARE))
            self.members = _NONE if take >= n else \
                frozenset(sorted(batch, key=_left, reverse=True)[:take])
        return len(self.members)

    def accepted(self, batch: Sequence[Request], num_accepted: Sequence[int]
                 ) -> list[int] | None:
        """The accepted drafts of ``batch``'s rows in the tail (None: no tail)."""
        members = self.members
        if not members:
            return None
        # (a comprehension's per-row test costs 2-3x at batch 64-256)
        return list(compress(num_accepted, map(members.__contains__, batch)))
