"""Adaptive K at a git revision against the working tree's, on the same random sequences:
every choice, E(k), learned time, X(b) and SYNC column equal (exactly: the floats too).
For host-time work on engine/_adaptive.py and engine/_adaptive_tail.py that must not
change what the rule does (floats summed in another order can round an iteration's time
to the next whole us: a check against a revision before such a change may fail on one
such iteration). Three kinds of sequence:

- one rank, n-gram-like draft classes (0-2) or none: batch sizes, classes, acceptance,
  measured times, disturbances, choices taken early (``next_k``) and committed;
- one rank, a head's tail (``BatchTail`` over request-like rows), its time handed over by
  ``IterationClock.tick`` on a simulated clock with fake CUDA events: prefills, a
  prefill's kernels not done at the tick, iterations not timed, empty batches;
- a group of two ranks (classes, or a tail): every rank's ``facts`` equal, and each
  rank's ``choose`` on the gathered rows;

    python bench/check_adaptive_equal.py [REV]      (default HEAD)
"""
import pathlib
import random
import sys


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_adaptive_host import load_revision, make_clock, tail_rows_of  # noqa: E402

from specloop.engine import _adaptive as new  # noqa: E402

SEQUENCES = 20
ITERATIONS = 3000


def build(mod, classes, tail=False):
    device = {(b, k): 0.5e-3 + 1e-5 * b * (k + 1)
              for b in (1, 2, 4, 8, 16, 32, 64) for k in range(4)}
    return mod.AdaptiveK([0, 1, 2, 3], mod.CostTable(device=dict(device)), classes=classes,
                         burn_in=mod.BURN_IN, tail=tail)


def same_tables(a, b, where):
    """The two rules' learned state equal."""
    for attr in ("measured", "switch", "rest", "samples", "device", "overhead", "paired",
                 "ignored"):
        assert getattr(a.cost, attr) == getattr(b.cost, attr), (where, attr)
    assert a.reached == b.reached and a.accepted == b.accepted and a.chosen == b.chosen, where
    assert a._tail_reached == b._tail_reached and a._tail_accepted == b._tail_accepted, where
    assert a.switches == b.switches and a.choices == b.choices, where
    assert a._view == b._view, where     # the last rule's bucket, E(k) and T(b, k)
    assert a.summary() == b.summary(), where


def one_rank(ref, seed):
    classes = seed % 3
    rng = random.Random(seed)
    a, b = build(ref, classes), build(new, classes)
    k = 0
    for i in range(ITERATIONS):
        batch = rng.choice([1, 2, 3, 5, 8, 13, 32, 64])
        cls = None if not classes or rng.random() < 0.3 else \
            [rng.randrange(classes + 1) for _ in range(batch)]
        if a.committed:
            ka, kb = a.choose_committed(batch), b.choose_committed(batch)
        else:
            fa, fb = a.facts(cls), b.facts(cls)
            assert fa == fb, (seed, i)
            ka, kb = a.choose([fa], batch), b.choose([fb], batch)
        assert ka == kb, (seed, i, ka, kb)
        k = ka
        acc = [min(rng.randrange(5), k) for _ in range(batch)]
        a.record(k, acc, cls)
        b.record(k, acc, cls)
        t = 1e-3 * (1 + 0.2 * k) * (1 + rng.random() * 0.3)
        a.measured(t)
        b.measured(t)
        if rng.random() < 0.05:
            a.disturb()
            b.disturb()
        if rng.random() < 0.8:      # the next choice taken early, committed mostly
            stay = rng.random() < 0.1
            na = a.next_k(batch, k, stay=stay, classes=cls)
            nb = b.next_k(batch, k, stay=stay, classes=cls)
            assert na == nb, (seed, i, na, nb)
            if rng.random() < 0.9:
                a.commit(na)
                b.commit(nb)
        assert a._expected_here(cls) == b._expected_here(cls), (seed, i)
        assert a._view == b._view, (seed, i)
    same_tables(a, b, seed)


class Row:
    """A request as the tail reads it: its token limit and its tokens so far."""

    def __init__(self, rng):
        self.stop_length = rng.randrange(32, 400)
        self.token_ids = [0] * rng.randrange(1, 48)


class FakeEvent:
    """A CUDA timing event: ``done`` and ``ms`` set by the sequence before each tick (the
    rule may call them or not; the sequence's random numbers do not depend on it)."""

    done, ms = True, 0.0

    def record(self, stream):
        pass

    def query(self):
        return FakeEvent.done

    def elapsed_time(self, end):
        return FakeEvent.ms


class Joins:
    """A rank's admissions as the tail is told them (``Scheduler.admitted``), counted where
    a tail before the fifty-third session told a join itself: a row of the batch it had not
    seen at its last call (a superset test). Both versions are then told the same joins
    (a row admitted and gone before the tail's next call is none for either)."""

    def __init__(self) -> None:
        self.seen: set = set()
        self.admitted = 0

    def __call__(self, rows) -> int:
        if not self.seen.issuperset(rows):
            self.seen, self.admitted = set(rows), self.admitted + 1
        return self.admitted


def tails_of(a, b, rows, joins: Joins) -> tuple[int, int]:
    """``tail.rows`` of both versions' rules, told the same joins."""
    admitted = joins(rows)
    return tail_rows_of(a.tail, rows, admitted), tail_rows_of(b.tail, rows, admitted)


def one_rank_tail(ref, seed):
    """A head's rule on one rank as the worker runs it (engine/_worker.py, _ahead.py):
    SCHEDULE's tick and prefill, SYNC's choice (committed, else from the facts), RESCAN's
    record with the tail's rows, the next K taken early and committed when queued."""
    rng = random.Random(1000 + seed)
    a, b = build(ref, 0, tail=True), build(new, 0, tail=True)
    now = [100.0]
    clocks = make_clock(ref, a, now, FakeEvent), make_clock(new, b, now, FakeEvent)
    # Steady load at one size, or batches that grow and drain.
    size = rng.choice([8, 32, 64]) if seed % 2 else rng.randrange(1, 64)
    rows = [Row(rng) for _ in range(size)]
    joins = Joins()
    k = 0
    for i in range(ITERATIONS):
        FakeEvent.done = rng.random() < 0.9
        FakeEvent.ms = rng.choice([0.0, 0.05, 0.2, 0.7])
        for clock in clocks:
            clock.tick()
        if rng.random() < 0.1:      # newcomers joined the step it takes
            a.disturb()
            b.disturb()
        if rng.random() < (0.9 if seed % 4 < 2 else 0.2):     # it admits
            marks = [clock.prefill_started() for clock in clocks]
            for clock in clocks:
                clock.on_device(lambda: None)()
            now[0] += rng.random() * 2e-4
            for clock, mark in zip(clocks, marks):
                clock.prefill_done(mark)
            if len(rows) < size:
                rows.append(Row(rng))
        if seed % 2 == 0 and rng.random() < 0.02:
            del rows[rng.randrange(len(rows) + 1):]         # a round drains
        if rows and rng.random() < 0.97:
            batch = len(rows)
            if a.committed:
                ka, kb = a.choose_committed(batch), b.choose_committed(batch)
            else:
                ta, tb = tails_of(a, b, rows, joins)
                fa, fb = a.facts(None, ta), b.facts(None, tb)
                assert fa == fb, (seed, i)
                ka, kb = a.choose([fa], batch), b.choose([fb], batch)
            assert ka == kb, (seed, i, ka, kb)
            k = ka
            for clock in clocks:
                clock.timed = True
            acc = [min(rng.randrange(5), k) for _ in rows]
            ta, tb = a.tail.accepted(rows, acc), b.tail.accepted(rows, acc)
            assert ta == tb and a.tail.members == b.tail.members, (seed, i)
            a.record(k, acc, None, ta)
            b.record(k, acc, None, tb)
            for row, n in zip(rows, acc):
                row.token_ids += [0] * (n + 1)
            if rng.random() < 0.85:     # VERIFY: the next K taken early
                taken = rng.random() < 0.9
                ta, tb = tails_of(a, b, rows, joins) if taken else (0, 0)
                na = a.next_k(batch, k, stay=not taken, tail_rows=ta)
                nb = b.next_k(batch, k, stay=not taken, tail_rows=tb)
                assert na == nb, (seed, i, na, nb)
                assert a._view == b._view, (seed, i)
                assert a._tail_here() == b._tail_here(), (seed, i)
                if rng.random() < 0.9:  # its step queued
                    a.commit(na)
                    b.commit(nb)
                if rng.random() < 0.05:     # a step dropped: not timed
                    for clock in clocks:
                        clock.timed = False
            rows = [r for r in rows if len(r.token_ids) < r.stop_length]
        now[0] += 1e-3 * (1 + 0.25 * k) * (1 + rng.random() * 0.3) + \
            FakeEvent.ms / 1e3 * rng.random()
    same_tables(a, b, seed)
    assert a.cost._over.keys() == b.cost._over.keys()
    for bucket, mean in a.cost._over.items():
        assert list(mean.window) == list(b.cost._over[bucket].window), (seed, bucket)


def group(ref, seed):
    """Two ranks per version: each rank's facts equal across versions, and every rank's
    choice on the gathered rows equal (each rank learns the group's time)."""
    rng = random.Random(2000 + seed)
    classes, tail = (seed % 3, False) if seed % 2 else (0, True)
    ranks = [(build(ref, classes, tail), build(new, classes, tail)) for _ in range(2)]
    batches = [[Row(rng) for _ in range(rng.randrange(1, 40))] for _ in ranks]
    joins = [Joins() for _ in ranks]
    for i in range(ITERATIONS):
        gathered, told = ([], []), []
        for (a, b), rows, rank_joins in zip(ranks, batches, joins):
            cls = None if not classes or rng.random() < 0.3 else \
                [rng.randrange(classes + 1) for _ in rows]
            tails = tails_of(a, b, rows, rank_joins) if tail else (0, 0)
            fa, fb = a.facts(cls, tails[0]), b.facts(cls, tails[1])
            assert fa == fb, (seed, i)
            gathered[0].append(fa)
            gathered[1].append(fb)
            told.append(cls)
        padded = max(len(rows) for rows in batches)
        chosen = {c for a, b in ranks
                  for c in (a.choose(gathered[0], padded), b.choose(gathered[1], padded))}
        assert len(chosen) == 1, (seed, i, chosen)
        assert all(a._view == b._view for a, b in ranks), (seed, i)
        k = chosen.pop()
        for (a, b), rows, cls in zip(ranks, batches, told):
            acc = [min(rng.randrange(5), k) for _ in rows]
            ta = a.tail.accepted(rows, acc) if tail else None
            tb = b.tail.accepted(rows, acc) if tail else None
            assert ta == tb, (seed, i)
            a.record(k, acc, cls, ta)
            b.record(k, acc, cls, tb)
            for row, n in zip(rows, acc):
                row.token_ids += [0] * (n + 1)
            t = 1e-3 * (1 + 0.2 * k) * (1 + rng.random() * 0.3)
            full = t + rng.random() * 4e-4
            a.measured(t, full)
            b.measured(t, full)
            if rng.random() < 0.1:
                a.disturb()
                b.disturb()
            rows[:] = [r for r in rows if len(r.token_ids) < r.stop_length]
            if not rows or rng.random() < 0.5 and len(rows) < 40:
                rows.append(Row(rng))
    for a, b in ranks:
        same_tables(a, b, seed)


def main():
    rev = sys.argv[1] if len(sys.argv) > 1 else "HEAD"
    ref = load_revision(rev, "ref")
    try:
        for check in (one_rank, one_rank_tail, group):
            for seed in range(SEQUENCES):
                check(ref, seed)
    finally:
        import time  # noqa: PLC0415
        ref.time = new.time = time
    print(f"equal to {rev} on {SEQUENCES} sequences of {ITERATIONS:,} iterations each: "
          "one rank (classes), one rank (tail, IterationClock), a group of two")


if __name__ == "__main__":
    main()
