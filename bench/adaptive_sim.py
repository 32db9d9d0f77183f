"""Adaptive K's rule (engine/_adaptive.py, the real ``AdaptiveK`` and ``CostTable``) on a
simulated iteration clock, against every fixed K under the same noise: how much of the
rule's loss on the H200 do noisy, drifting iteration times explain?

The simulation: one rank, a steady batch of ``--batch`` rows (no admissions, no drain),
one bucket. An iteration at K takes T(K) (``--times``, ms: the fixed engines' mean
iterations) x a lognormal factor (``--sigma``, per iteration) x the host's speed factor,
which switches between 1 and ``--slow`` with a mean dwell of ``--dwell`` iterations (the
lent H200's host ran at two speeds ~2x apart, changing between runs of one process). Each
row accepts draft j given 1..j-1 with probability ``--accept`` (conditional, per
position). Fixed K runs on the same noise; the rule starts cold (warm-up's table
``--warmup``, ms, default T) and runs ``--iterations``. Prints tokens per ms for each
fixed K and the rule, the rule over the best fixed K, and what it chose, for ``--seeds``
seeds. The seventeenth session's steady batch-8 figures are the defaults (in-process,
slow host: ``bench/results/h200_1202q_adaptive_diag_steady.jsonl``).

    python bench/adaptive_sim.py [--batch 8] [--times 0.709,0.883,0.960,0.949]
        [--accept 0.50,0.51,0.59] [--sigma 0.2] [--slow 1.8] [--dwell 400]
        [--iterations 3000] [--seeds 5] [--set RECENT=45 --set SWITCH_MARGIN=0]
        [--closed 128 | --refill 128] [--spread 0.5] [--row-cost 0.5] [--pooled]
        [--first-bias 1.3] [--drain-objective] [--lengths 0.5] [--disturbed 0.8]
        [--unseen 0.35] [--ahead 0.9]
        [--module /tmp/old_adaptive.py]    (another version of engine/_adaptive.py, e.g.
                                            ``git show <commit>:engine/_adaptive.py``)

``--closed``: rounds of rows that end after their tokens; ``--refill``: each row replaced
as it ends (steady load); ``--pooled``: the rule without the batch's tail;
``--first-bias``: each K's first samples dearer; ``--drain-objective``: the closed-round
model as the rule's objective (an oracle that knows the batch drains). The H200's
ProcessEngine closed rounds at batch 32 are best matched by ``--spread 0.3 --row-cost 0``
(docs/performance-history.md, "The batch's tail, and a K not well measured").

``--rise R``: a row's acceptance rises through its answer (the batch's tail, the rows
with most tokens left, then accepts less than the batch: under a server's load those are
the rows that joined last).

``--unseen MS``: every iteration takes MS more than the rule's clock says, at any K (the
prefill, disturbed iterations' extra, the mean over the median: the H200's steady load at
batch 32, 0.35 ms), told to the rule only as the iteration's time with its prefill
(``measured``'s ``full``, which X(b) learns from). The H200's batch 32 under a server's
load (twenty-sixth session): ``--batch 32 --refill 128 --lengths 0.5 --times
0.71,0.93,1.14,1.20 --accept 0.53,0.47,0.52 --sigma 0.1 --slow 1 --dwell 0 --unseen
0.35`` (the rule's learned T, fixed walls less 0.35 ms; docs/performance-history.md,
"What every iteration pays").

``--spill S``: a switch of K costs the run's first iteration 2 S more and its second S
more (x T(k)): the extra work of a switch spilling into the next iteration where a step
is queued ahead (``speculative.adaptive_settling``; ``--set SETTLING=1`` leaves the second
out of what the rule learns).

``--ahead Q``: one GPU rank's path (engine/_ahead.py): the next iteration's K taken early
(``next_k``; ``stay`` after an iteration that took no step queued ahead) and committed
where its step can be queued (K = 0 after K = 0, a drafting K after a drafting K: the
chain), the step taken by the next iteration with probability Q (else dropped: that
iteration is not timed, as the worker's clock), a committed choice made by
``choose_committed``. Rows also get ``k0_run``, the longest stretch of K = 0 choices.

``--set NAME=VALUE`` changes one of engine/_adaptive.py's constants for the run (a
variant of the rule to compare); several may be given.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import math
import random
import statistics
import sys
from typing import Iterator

from bench_adaptive_host import tail_rows_of


def _load(path: str):
    """Another version of engine/_adaptive.py, as a module (it imports ``._adaptive_tail``
    relatively: loaded under the engine package's name)."""
    spec = importlib.util.spec_from_file_location("specloop.engine._adaptive", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


class Clock:
    """The simulated machine: T(K) x a per-iteration lognormal x the host's speed, which
    flips between fast (1) and slow (``slow``) with a mean dwell of ``dwell`` iterations."""

    def __init__(self, times_ms: list[float], sigma: float, slow: float, dwell: float,
                 rng: random.Random) -> None:
        self.times, self.sigma, self.slow, self.dwell, self.rng = times_ms, sigma, slow, dwell, rng
        self.factor = 1.0

    def iteration(self, k: int) -> float:
        """-> seconds for an iteration drafting k."""
        if self.dwell and self.rng.random() < 1.0 / self.dwell:
            self.factor = self.slow if self.factor == 1.0 else 1.0
        noise = math.exp(self.rng.gauss(-self.sigma ** 2 / 2, self.sigma)) if self.sigma else 1.0
        return self.times[k] * noise * self.factor / 1e3


def accepted(k: int, rows: int, accept: list[float], rng: random.Random) -> list[int]:
    """Each row's accepted drafts of k (the chain stops at the first rejection)."""
    out = []
    for _ in range(rows):
        n = 0
        while n < k and rng.random() < accept[n]:
            n += 1
        out.append(n)
    return out


def bucket_of(rows: int) -> int:
    """The power-of-two bucket a batch of ``rows`` runs at."""
    return 1 << max(rows - 1, 0).bit_length()


class Row:
    """A row: its tokens ``left``, read by adaptive K's tail as a request's
    (``_adaptive_tail._left``: its limit, ``stop_length``, less ``len(token_ids)``)."""

    def __init__(self, tokens: int) -> None:
        self.stop_length = self.left = tokens
        self.token_ids = self

    def __len__(self) -> int:
        return self.stop_length - self.left


class Rows:
    """The batch. Steady (default): ``--batch`` rows that never end, every row accepting
    with ``--accept``. ``--closed TOKENS``: rounds of ``--batch`` rows, each done after
    TOKENS tokens (a round's last iteration's extra tokens are not counted), each row's
    conditional acceptance ``--accept`` x its own factor, uniform in 1 +- ``--spread``
    (drawn per row, capped at 0.98); a new round starts when the last row ends.
    ``--refill TOKENS``: the same rows, each replaced by a new one as it ends (a server's
    steady load). ``requests``: the rows as the engine's requests."""

    def __init__(self, args, rng: random.Random) -> None:
        self.args, self.rng = args, rng
        # The rows' acceptance factors from a stream of their own: every policy (each fixed
        # K, the rule) sees the same requests in the same order, whatever it drafts.
        self.factors = random.Random(rng.getrandbits(32))
        self.tokens = args.closed or args.refill
        self.refilled = 0       # --refill: rows replaced by the last step (new requests)
        self.admitted = 0       # rows that ever joined (the scheduler's ``admitted``)
        self.accept: list[list[float]] = []
        self.rows: list[Row] = []
        self._refill()

    def _tokens(self) -> int:
        """A new row's tokens: TOKENS, or uniform in TOKENS x (1 +- ``--lengths``) (the
        H200's steady load asks 128 +- 50 %: rows of equal length refilled together stay
        in step, one admission for all)."""
        spread = self.args.lengths
        if not spread:
            return self.tokens
        return max(1, round(self.tokens * (1 + self.factors.uniform(-spread, spread))))

    def _row(self) -> list[float]:
        factor = 1 + self.factors.uniform(-self.args.spread, self.args.spread)
        return [min(a * factor, 0.98) for a in self.args.accept]

    def _refill(self) -> None:
        args = self.args
        self.rows = [Row(self._tokens() if self.tokens else 1 << 30)
                     for _ in range(args.batch)]
        self.admitted += args.batch
        self.accept = [self._row() for _ in self.rows] if self.tokens else \
            [args.accept] * args.batch

    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def left(self) -> list[int]:
        return [row.left for row in self.rows]

    def requests(self) -> list[Row]:
        return list(self.rows)

    def _now(self, row: Row, accept: list[float]) -> list[float]:
        """``--rise R``: the row's acceptance x (1 + R (2 f - 1)), f the share of its tokens
        done (R = 0: as drawn)."""
        rise = self.args.rise
        if not rise or not self.tokens:
            return accept
        factor = 1 + rise * (2 * (row.stop_length - row.left) / row.stop_length - 1)
        return [min(a * factor, 0.98) for a in accept]

    def step(self, k: int) -> tuple[int, list[int]]:
        """-> (tokens that count, each row's accepted drafts) for an iteration drafting k."""
        counts = [accepted(k, 1, self._now(row, accept), self.rng)[0]
                  for row, accept in zip(self.rows, self.accept)]
        if not self.tokens:
            return sum(n + 1 for n in counts), counts
        useful = [min(n + 1, row.left) for n, row in zip(counts, self.rows)]
        for row, u in zip(self.rows, useful):
            row.left -= u
        if self.args.refill:
            self.refilled = 0
            for i, row in enumerate(self.rows):
                if row.left <= 0:
                    self.rows[i], self.accept[i] = Row(self._tokens()), self._row()
                    self.refilled += 1
            self.admitted += self.refilled
            return sum(useful), counts
        kept = [i for i, row in enumerate(self.rows) if row.left > 0]
        self.accept = [self.accept[i] for i in kept]
        self.rows = [self.rows[i] for i in kept]
        if not self.rows:
            self._refill()
        return sum(useful), counts


def scaled(times: list[float], rows: int, args) -> list[float]:
    """The iteration times at ``rows`` rows' bucket: ``--row-cost`` of T scales with the
    bucket over the full batch's (closed rounds' last rows run at smaller buckets)."""
    if not args.closed or args.refill:
        return times
    share = bucket_of(rows) / bucket_of(args.batch)
    return [t * (1 - args.row_cost + args.row_cost * share) for t in times]


def run_fixed(k: int, args, seed: int) -> float:
    """Tokens per ms of a fixed K over the run (the same noise stream as the rule's)."""
    rng, noise = random.Random(seed), random.Random(seed + 10_000)
    clock = Clock(args.times, args.sigma, args.slow, args.dwell, noise)
    rows = Rows(args, rng)
    tokens = seconds = 0.0
    admits = False
    for _ in range(args.iterations):
        clock.times = scaled(args.times, rows.active, args)
        seconds += clock.iteration(k) + (args.disturbed / 1e3 if admits else 0.0) + \
            args.unseen / 1e3
        tokens += rows.step(k)[0]
        admits = rows.refilled > 0
    return tokens / (seconds * 1e3)


def expected_max(rows: int) -> float:
    """E[max of ``rows`` standard normals], the Gumbel approximation (0 for one row)."""
    if rows < 2:
        return 0.0
    s = math.sqrt(2 * math.log(rows))
    return max(s - (math.log(math.log(rows)) + math.log(4 * math.pi)) / (2 * s), 0.0)


def drain_expected(expected: dict[int, float], left: float, rows: int) -> dict[int, float]:
    """``--drain-objective``: E(k) made the tokens an iteration that would end a draining
    batch soonest. A row needs left / E iterations give or take sigma * sqrt(left / E) /
    E (sigma: one iteration's tokens' spread, from P(n >= j) = E(j) - E(j - 1)), and the
    slowest of ``rows`` about ``expected_max(rows)`` of those more; the value returned is
    left over that (docs/performance-history.md, "A model of a closed round's length")."""
    z, out = expected_max(rows), {}
    for k, e in expected.items():
        reach = [expected[j] - expected[j - 1] for j in range(1, k + 1)]   # P(n >= j)
        var = sum((2 * j - 1) * p for j, p in enumerate(reach, 1)) - (e - 1) ** 2
        iterations = left / e + z * math.sqrt(max(var, 0.0) * left / e) / e
        out[k] = left / iterations if iterations > 0 else e
    return out


def run_rule(args, seed: int) -> tuple[float, dict[int, int], int]:
    """Tokens per ms of the rule, how often it chose each K, its longest K = 0 stretch."""
    from specloop.engine import _adaptive  # noqa: PLC0415

    rng, noise = random.Random(seed), random.Random(seed + 10_000)
    clock = Clock(args.times, args.sigma, args.slow, args.dwell, noise)
    rows = Rows(args, rng)
    ks = list(range(len(args.times)))
    warm = args.warmup or args.times
    # Warm-up's table keyed by each bucket up to the batch's (its times ``scaled``).
    buckets = {bucket_of(n) for n in range(1, args.batch + 1)}
    cost = _adaptive.CostTable({(b, k): t / 1e3 for b in buckets
                                for k, t in enumerate(scaled(warm, b, args))})
    # The batch's tail (the engine's, for a drafter without classes) unless --pooled.
    if args.admissions_per_iteration:
        cost.admissions_in_overhead = True      # the rule before the fifty-first session
    rule = _adaptive.AdaptiveK(ks, cost, burn_in=_adaptive.BURN_IN, tail=not args.pooled)
    if args.drain_objective and args.closed:
        # An oracle for "the batch drains" (closed rounds: always): the rule's E(k) as
        # the tokens an iteration that end the round soonest, at the rows' mean tokens left.
        rule_of = rule._rule

        def drained(expected, bucket, calls):
            left = sum(rows.left) / max(len(rows.left), 1)
            return rule_of(drain_expected(expected, left, rows.active), bucket, calls)
        rule._rule = drained
    # A rule whose ``measured`` takes the time with the prefill (X(b)); older ones do not.
    full = "full" in inspect.signature(rule.measured).parameters
    tokens = seconds = 0.0
    admits = False      # --disturbed: this iteration admits the rows the last one refilled
    # --spill: the last iteration's K, this one's place in its run of one K, and whether
    # that run began with a switch
    last_k, place, switched = None, 0, False
    # --ahead: whether this iteration took the step the last one queued, and whether one
    # was queued for it (a step queued and not taken is dropped: the iteration untimed).
    taken = queued = False
    rng_ahead = random.Random(seed + 20_000)
    run_k0 = k0_run = 0      # the K = 0 stretch now, and the longest
    for _ in range(args.iterations):
        active, batch = rows.active, rows.requests()
        tail_rows = tail_rows_of(rule.tail, batch, rows.admitted)
        if rule.committed:
            k = rule.choose_committed(active)
        else:
            k = rule.choose([rule.facts(None, tail_rows)], active)
        timed = True
        if args.ahead is not None:
            nxt = rule.next_k(active, k, stay=not taken, tail_rows=tail_rows if taken else 0)
            dropped = queued and not taken
            queued = (nxt == 0) == (k == 0)
            if queued:
                rule.commit(nxt)
            timed = not dropped and (taken or not queued)
            taken = queued and rng_ahead.random() < args.ahead
        clock.times = scaled(args.times, active, args)
        took = clock.iteration(k)
        if args.first_bias != 1 and not rule.cost.tried(rule.cost.bucket(active), k):
            took *= args.first_bias     # a K's first samples, as the H200's ran
        if k == last_k:
            place += 1
        else:
            place, switched = 1, last_k is not None
        if args.spill and switched and place <= 2:
            # A switch's extra work (a step queued ahead): 2 x spill on the run's first
            # iteration, spill on its second.
            took *= 1 + args.spill * (3 - place)
        last_k = k
        if admits:
            took += args.disturbed / 1e3
        seconds += took + args.unseen / 1e3
        useful, counts = rows.step(k)
        tokens += useful
        rule.record(k, counts, None,
                    rule.tail.accepted(batch, counts) if rule.tail is not None else None)
        if timed:
            if full:
                rule.measured(took, took + args.unseen / 1e3)
            else:
                rule.measured(took)
            # As the engine's clock: an iteration that admitted requests, and the one
            # before it, are disturbed (IterationClock.tick, prefill_done).
            if args.disturbed and (admits or rows.refilled):
                rule.disturb()
        admits = bool(args.disturbed) and rows.refilled > 0
        run_k0 = run_k0 + 1 if k == 0 else 0
        k0_run = max(k0_run, run_k0)
    return tokens / (seconds * 1e3), dict(sorted(rule.chosen.items())), k0_run


def parser() -> argparse.ArgumentParser:
    """The command line (tests parse their arguments with it)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--times", type=parse_floats, default=[0.709, 0.883, 0.960, 0.949])
    ap.add_argument("--warmup", type=parse_floats, default=None)
    ap.add_argument("--accept", type=parse_floats, default=[0.50, 0.51, 0.59])
    ap.add_argument("--sigma", type=float, default=0.2)
    ap.add_argument("--slow", type=float, default=1.8)
    ap.add_argument("--dwell", type=float, default=400)
    ap.add_argument("--iterations", type=int, default=3000)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--closed", type=int, default=0, metavar="TOKENS",
                    help="closed rounds of --batch rows of TOKENS tokens each (default: "
                         "steady, rows that never end)")
    ap.add_argument("--refill", type=int, default=0, metavar="TOKENS",
                    help="steady load of --batch rows of TOKENS tokens each, each "
                         "replaced by a new row as it ends")
    ap.add_argument("--spread", type=float, default=0.5,
                    help="--closed, --refill: each row's acceptance x a factor in 1 +- this")
    ap.add_argument("--first-bias", type=float, default=1.0,
                    help="each K's first samples at a bucket take this many times its "
                         "time (on the H200 they ran 15-35 %% above a stretch's)")
    ap.add_argument("--drain-objective", action="store_true",
                    help="--closed: the rule's E(k) made a draining batch's (the slowest "
                         "row's expected iterations; performance-history.md, 'A model of "
                         "a closed round's length'), knowing the batch drains")
    ap.add_argument("--pooled", action="store_true",
                    help="the rule without per-row counts (E(k) from the pooled ones)")
    ap.add_argument("--module", default="",
                    help="run the rule of another engine/_adaptive.py (e.g. a commit's, "
                         "from git show) in place of this tree's")
    ap.add_argument("--lengths", type=float, default=0.0, metavar="SPREAD",
                    help="--closed, --refill: each row's tokens uniform in TOKENS x (1 +- "
                         "SPREAD) (the H200's steady load: 0.5)")
    ap.add_argument("--disturbed", type=float, default=0.0, metavar="MS",
                    help="--refill: an iteration that admits new rows (those the last one "
                         "refilled) takes MS more at any K, and it and the one before it "
                         "are disturbed to the rule, as the engine's clock flags them (the "
                         "H200's steady load: a prefill's host work, no step queued ahead)")
    ap.add_argument("--spill", type=float, default=0.0, metavar="S",
                    help="the rule's switches of K cost its run's first iteration "
                         "x (1 + 2 S) and its second x (1 + S) (a step queued ahead: the "
                         "switch's extra work spills into the next iteration; "
                         "speculative.adaptive_settling leaves the second out)")
    ap.add_argument("--admissions-per-iteration", action="store_true",
                    help="X(b) learns from disturbed iterations too (speculative."
                         "adaptive_admissions = 'per_iteration', the rule before the "
                         "fifty-first session); default: admissions per token")
    ap.add_argument("--unseen", type=float, default=0.0, metavar="MS",
                    help="every iteration takes MS more at any K than the rule's clock "
                         "times, seen only in its time with the prefill (X(b); the H200's "
                         "steady load at batch 32: 0.35)")
    ap.add_argument("--rise", type=float, default=0.0, metavar="R",
                    help="--closed, --refill: a row's acceptance rises through its answer, "
                         "x (1 - R) at its first token to x (1 + R) at its last (the shipped "
                         "eagle3 head on held-out prompts: E(3) 1.93 over answer positions "
                         "0-15, 3.0 from 192 on; bench/acceptance_by_position.py)")
    ap.add_argument("--ahead", type=float, default=None, metavar="Q",
                    help="one GPU rank's path: the next K taken early and committed where "
                         "its step can be queued, the step taken with probability Q (else "
                         "dropped, the iteration untimed)")
    ap.add_argument("--row-cost", type=float, default=0.5,
                    help="--closed: the share of an iteration's time that scales with "
                         "its bucket")
    return ap


@contextlib.contextmanager
def rule_constants(items: list[str], adaptive=None) -> Iterator[None]:
    """While open, each "NAME=VALUE" of ``items`` sets that constant of
    engine/_adaptive.py (``adaptive``: that module or another version of it) or of
    engine/_adaptive_tail.py, in the constant's own type; the values before are back after."""
    from specloop.engine import _adaptive_tail  # noqa: PLC0415
    if adaptive is None:
        from specloop.engine import _adaptive as adaptive  # noqa: PLC0415
    saved = {}
    try:
        for item in items:
            name, value = item.split("=", 1)
            module = adaptive if hasattr(adaptive, name) else _adaptive_tail
            saved[name] = (module, getattr(module, name))
            setattr(module, name, type(saved[name][1])(value))
        yield
    finally:
        for name, (module, value) in saved.items():
            setattr(module, name, value)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(argv)
    import specloop.engine  # noqa: PLC0415
    from specloop.engine import _adaptive, _adaptive_tail  # noqa: PLC0415

    tree = _adaptive
    if args.module:     # run_rule imports the module in its place
        _adaptive = _load(args.module)
        sys.modules["specloop.engine._adaptive"] = specloop.engine._adaptive = _adaptive
    rows = []
    try:
        with rule_constants(args.set, _adaptive):
            for seed in range(args.seeds):
                fixed = {k: run_fixed(k, args, seed) for k in range(len(args.times))}
                rate, chosen, k0_run = run_rule(args, seed)
                best = max(fixed, key=fixed.get)
                rows.append({"seed": seed, "fixed": {k: round(v, 3) for k, v in fixed.items()},
                             "rule": round(rate, 3), "vs_best": round(rate / fixed[best], 3),
                             "best_k": best, "chosen": chosen, "k0_run": k0_run})
                print(rows[-1], flush=True)
    finally:
        sys.modules["specloop.engine._adaptive"] = specloop.engine._adaptive = tree
    ratios = [r["vs_best"] for r in rows]
    print(f"rule / best fixed K: median {statistics.median(ratios):.3f} "
          f"({min(ratios):.3f}-{max(ratios):.3f}) over {len(rows)} seeds"
          + (f"; variant {' '.join(args.set)}" if args.set else ""), flush=True)
    return rows


if __name__ == "__main__":
    main()
