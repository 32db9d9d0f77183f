"""Adaptive K: how many tokens to draft this iteration (docs/configuration.md, "Adaptive K").

The rule: among the K values the engine captured (0 .. num_draft_tokens), pick the one with
the most expected tokens per unit of time at batch b (its power-of-two class),

    E(k) / T(b, k),   E(k) = 1 + sum_{j=1..k} a_1 * ... * a_j,

a_j being the acceptance of draft j given drafts 1..j-1 were accepted (decayed counts of
recent iterations, pooled over the group's ranks). A drafter that tells its rows apart
before drafting (``Drafter.draft_classes``: n-gram, the length of the match it would
draft from) has counts per class, and E(k) is then the mean over the batch's rows of
their class's E(k): a batch of rows without a match drafts nothing, one whose rows
continue a long match drafts K (rows the drafter does not class, or past
CLASSED_ROWS, take the counts of all classes pooled). A drafter without classes (the
heads) takes E(k) from the batch's tail instead: the rows with the most tokens left,
which a batch whose rows all end waits on longest (engine/_adaptive_tail.py). T(b, k) the
iteration's time: VERIFY and DRAFT as timed at warm-up (``calibrate``) plus the rest of
the iteration (host work) until iterations at (b, k) have been measured (whole iterations, start to start, less
prefill, on a GPU as long as its kernels ran, and waits: the worker's clock), then the
median of the last RECENT (each K runs FIRST_SAMPLES times in a row at the first bucket
before the rule decides there, later buckets borrow its times, each K's moved by the
change in its own warm-up time and all scaled to the bucket's own measured one, and
EXPLORE_RUN choices in EXPLORE_EVERY try the K values in turn, and EXPLORE_RUN in
EXPLORE_NEAR the contender, the K within NEAR_RATE of the rule's; a K not WELL_MEASURED
at a bucket is priced from the K measured most there, and a K not running from the K
running, by their ratio learned in pairs once PAIRED_MIN have come, at most by their
warm-up times' difference before; a head's K kept at a settled
bucket is held HOLD - 1 more choices without the rule). The iterations on either
side of a switch of K teach that K's switch cost instead, which the rule pays before it
leaves the last K (``_stay``); an engine's first BURN_IN iterations teach nothing. An
iteration that admitted requests, or whose next one did, is disturbed and learned only where no undisturbed one was (its extra cost
is the same at any K, and at a round's start it would all fall on K = 0). What the tail
of the times above their medians costs an iteration at any K is added to every K's
T(b, k): X(b), the mean of the bucket's recent undisturbed iterations' time with their
prefill less their K's T (OVERHEAD_WINDOW); a cost paid per iteration favours the K that
makes more tokens an iteration. What an admission costs (the disturbed iterations' extra,
the prefill) is paid per token at any K and left out (ADMISSIONS_PER_TOKEN). On one GPU
rank ``next_k`` takes the next choice early and ``commit`` holds the next iteration to
it, so the worker can queue that step ahead (K = 0: as without speculation; K > 0: DRAFT
+ VERIFY chained on the device). Ties go to the smaller K. Every input is agreed by the
group: the counts and the measured time (negative when disturbed) ride SCHEDULE's
all-gather as integer columns, the warm-up table is agreed once before the first
iteration; so every rank picks the same K.
"""

from __future__ import annotations

import collections
import math
import os
import time
from typing import Any, Callable, Hashable, Iterable, Sequence, TypeVar

import attrs
import torch

from specloop.graphs import bucket_for

from ._adaptive_tail import TAIL_PRIOR_ROWS, BatchTail
from ._stats import accepted_at_least

# Counts travel as integers in 1/SCALE units (the exchange is an int64 tensor).
SCALE = 16
# Per-iteration decay of the counts (an iteration with drafts only): ~50 iterations' memory.
DECAY = 0.98
# Prior: PRIOR_ROWS pseudo-rows at acceptance PRIOR_ACCEPT for every position, so a
# position never drafted yet looks worth a try, and one lucky row does not decide.
PRIOR_ROWS, PRIOR_ACCEPT = 2.0, 0.5
PRIOR_ACCEPTED = PRIOR_ACCEPT * PRIOR_ROWS     # the prior's accepted pseudo-rows
# Weight of a new measurement of an iteration's host work beyond warm-up's time (``rest``,
# an exponential average; it stands in for T(b, k) where (b, k) has no samples yet).
REST_WEIGHT = 0.2
# EXPLORE_RUN choices in every EXPLORE_EVERY take the next K in turn instead of the rule's,
# so every K gets measured again and every position's acceptance learned, whatever the
# first measurements said. 3 iterations in 256, and a drafting one after a long K = 0
# stretch catches the head up eagerly (3-4 ms at batch 1 on the H200, a K = 0 iteration
# ~0.5-1 ms): ~3 % at worst. A K whose
# expected rate is below EXPLORE_RATE of the best's is tried at one of its turns in
# EXPLORE_RARELY only: on the H200 a drafting iteration at batch >= 64 costs 3-4x a
# K = 0 one.
EXPLORE_EVERY = 256
EXPLORE_RATE, EXPLORE_RARELY = 0.6, 8
# An explored K runs EXPLORE_RUN iterations in a row (EXPLORE_RUN + the rule's
# ``settling``): the first after another K and the last before the next are switches
# (learned as its switch cost), the ``settling`` after the first are learned as nothing,
# the one left between them is its own time.
EXPLORE_RUN = 3
# The default ``settling`` (``speculative.adaptive_settling``): iterations after a switch's
# first that are learned as nothing, where a run's second iteration still pays for the
# switch (a step queued ahead: the first one's extra work spills into it). On this
# repository's CPU chained path at batch 64 (fifty-first session,
# bench/adaptive_samples_host.py) K = 3's own samples at a run's second place took 0.706
# ms against 0.600 from the fifth on, and a K measured only in explore runs of three was
# priced 1.025-1.139x the running one where every K costs the same there (1.002-1.083
# with one settling iteration); the fifty-first session's H100 at batch 256 priced T(2)
# 1.15x T(3) where fixed K = 2 iterated 25 % cheaper (the fifty-second's paired T(2) /
# T(3) there, 0.91-0.96 mostly, matched warm-up's 0.918 and the fixed engines'
# 0.916-0.945). Not the default: in bench/adaptive_sim.py one settling
# iteration read ~1 % less of the best fixed K than none, at batch 32 and at a batch-256
# model, with a spill modelled (--spill) or not (24 seeds each); untimed on a GPU.
SETTLING = 0
# Iterations each K runs at the first bucket before the rule decides there (later buckets
# borrow its times until each K has as many of its own); their median is T until then
# (the first drafting iteration after a K = 0 stretch catches the head up eagerly; a host
# pause or a kernel's first launch can take 100 ms on the H200).
FIRST_SAMPLES = 3
# An engine's first BURN_IN iterations are not learned (the worker's AdaptiveK; K = 0
# runs them, the first K to try): on the H200 they ran slower than any later one (K = 0's
# first samples 0.6-0.86 ms at batch 1, 0.48 later: clocks and caches warming after the
# warm-up's idle), and a K the rule then never picks again is never measured again.
BURN_IN = 16
# Disturbed iterations (``AdaptiveK.disturb``: they or the next one admitted requests) are
# learned only where no undisturbed one was: their extra cost (the prefill's device time
# that VERIFY waits behind, no step queued ahead) is the same at any K, and at a round's
# start it would all fall on K = 0's first samples (the H200 at batch 128 learned T(128, 0)
# = 3 ms, and drafted where no speculation was faster). A K whose iterations are all
# disturbed (steady load at a large batch: a request arrives every iteration) is settled
# after FIRST_DISTURBED of them.
FIRST_DISTURBED = 4 * FIRST_SAMPLES
# Once settled, the rule leaves the last K only for one whose rate is SWITCH_MARGIN better
# after the switch's cost (``CostTable.switch``: the new K's first iteration's extra time,
# and the last K's when the rule comes back to it) is spread over SWITCH_HORIZON
# iterations of the new K. On the H200 at batch 1 an n-gram K = 0 iteration right after a
# K = 4 one took ~0.75 ms against ~0.48 in a stretch of K = 0; an eagle3 K = 3 one after
# K = 0 catches the head up, 3-4 ms.
SWITCH_MARGIN = 0.03
SWITCH_HORIZON = 8
# Once a K has its first samples, T(b, k) (and its switch cost) is the median of its last
# RECENT measurements: iteration times are heavy-tailed on a busy host (on the H200 at
# batch 1 their 90th percentile was 1.3-2x the median), and the exponential average used
# before (each sample capped at twice it) ended runs 20-60 % above the median, K = 0's
# most (n-gram then drafted where K = 0 was faster). A real change moves the median
# within RECENT / 2 iterations at that K; one pause does not move it.
RECENT = 15
# A K with fewer learned samples than this at a bucket is not well measured there: its
# first samples (FIRST_SAMPLES, run once at the first bucket, the first of them right
# after another K's stretch, or catching the head up after K = 0) ran 15-35 % above what
# a stretch of it costs on the H200 (batch 32 in-process: T(32, 1) learned 1.413 ms from
# them, 1.23 in a stretch), and a K the rule does not pick is measured again only at its
# turns to explore (EXPLORE_EVERY). Its T is then at most the time of the K measured most
# there moved by the difference of their warm-up times (``CostTable.times``): optimistic,
# so the rule tries it, and its own samples from that stretch decide from then on. The
# first samples leave a K's window once FIRST_SAMPLES more have come.
WELL_MEASURED = 2 * FIRST_SAMPLES
# Paired pricing: a K the rule does not run is priced from the K running now, by the
# difference between them learned from the iterations. Each own sample of a K taken while
# another K's window is fresh (all RECENT of its samples among the bucket's last
# FRESH_SPAN own samples: it is running), right after that K's own sample (``_pair``), is
# evidence of their ratio, log(x) - log(that window's median); the median of a pair's
# last PAIR_WINDOW such values prices the K not running once PAIRED_MIN have come:
# T(k) = T(running) * exp(D(k, running)). On the H200 at batch 1 a K's window of 15 swung
# 0.66-0.81 ms within a steady run, and a K the rule left kept the median it was left with
# for thousands of choices (its own samples come one per explored run): the rule then
# chose between a fresh median and a stale one. A ratio learned over many pairs neither
# drifts with the host nor goes stale. Before PAIRED_MIN, such a K is priced at most at
# the running K's time moved by their warm-up times' difference (``moved``): a host that
# sped up while K = 0 ran (an explore turn) otherwise left every drafting K at its slow
# median, and K = 0 won for as long as it ran (bench/adaptive_sim.py, batch 8, host phases
# 1.8x apart: 1,580 of 3,000 iterations on one seed). Warm-up's difference flatters a
# dearer K: the rule tries it, and the switches bring the pair's evidence.
FRESH_SPAN = 2 * RECENT
PAIR_WINDOW = 63
PAIRED_MIN = 8
# A K whose expected rate, with the switch there and back spread over EXPLORE_RUN, is
# within NEAR_RATE of the rule's K's is a contender: besides the turns of EXPLORE_EVERY,
# one run of EXPLORE_RUN in every EXPLORE_NEAR choices tries the best contender
# (``_contender``), so the pair that decides gets its evidence (at a few % apart, a run
# costs a few % of 3 iterations in EXPLORE_NEAR).
NEAR_RATE = 0.9
EXPLORE_NEAR = 32
# Once settled at a bucket, a drafter without draft classes holds the K the rule chose
# again (the same as the last iteration's) for the next HOLD - 1 choices at that bucket,
# without computing E(k) or T(b, k): on this repository's CPU the rule took ~25 of
# adaptive K's ~37 us an iteration (bench_adaptive_host.py --tail-batch 8), and from
# batch ~2 a speculative iteration on the H200 is host-bound (adaptive ran 0.955-0.960 of
# fixed K = 3 at batch 8 while drafting K = 3 in 99 % of its iterations). Not in the
# EXPLORE_NEAR choices' first EXPLORE_RUN + 1 (near runs, explore turns, the choice after
# them); not for a drafter with classes (n-gram: a row's class changes iteration to
# iteration, and with it the best K).
HOLD = 4
# At a bucket not settled (a K there has no first samples yet), what the rule prices from
# the nearest settled bucket's times (``_borrowed``): "all" (the default) every K, each
# moved by its warm-up difference and all scaled by the bucket's most-sampled K; "untried"
# only the K values not WELL_MEASURED there, the others at their own price
# (``CostTable.times``). Under a server's load at batch >= 64 most iterations admit, and a
# K the rule runs only at its explore turns (K = 0 or 1 there) gets its first undisturbed
# samples after thousands of choices: the bucket stays unsettled. On the H100
# (fifty-ninth session) one batch-64 run drafted K = 0 ~1,100 times: K = 0, then the
# bucket's most-sampled K, scaled bucket 8's times into K = 2 at 1.39 ms against its own
# 1.15 and K = 3 within SWITCH_MARGIN of K = 0, which was kept; K = 2's own price made it
# 23 % faster (test_unsettled_bucket_borrows_only_for_untried_ks). Not the default until
# timed on a GPU (SPECLOOP_ADAPTIVE_BORROW=untried for an A/B): in
# bench/adaptive_sim.py's closed rounds at batch 64 (--closed 128 --lengths 0.5 --ahead
# 0.8, 16 seeds) it read 0.982 of the best fixed K against 0.988, 11 seeds of 16 lower;
# there every K's time scales with the bucket by one factor, as borrowing assumes, and a
# drain's own medians are few and noisy.
ADAPTIVE_BORROW = os.environ.get("SPECLOOP_ADAPTIVE_BORROW", "all")
# Rows a batch's classes are asked for (``Drafter.draft_classes`` runs on the host each
# iteration, ~3 us a row for n-gram); a larger batch's rows are unclassed.
CLASSED_ROWS = 64
# What an iteration costs beyond its K's T(b, k), the same at any K (``CostTable.overhead``):
# how far the mean lies above T(b, k), a median (and, until the fifty-first session, the
# prefill its clock leaves out and the disturbed iterations' extra: ADMISSIONS_PER_TOKEN).
# On the H200 under a server's load (steady arrival, eagle3) the fixed engines' wall per
# iteration exceeded the rule's T(b, k) by the same ~0.35 ms at K = 1, 2 and 3 at batch 32
# (0.46-0.52 at 64, ~0.75 at 128), read then as a per-iteration cost, which favours the K
# that makes more tokens an iteration: without it the rule chose K = 1 where fixed K = 3
# made 2.5 % more tokens/s (twenty-sixth session). X(b) is the mean of the bucket's last
# OVERHEAD_WINDOW samples (undisturbed iterations that neither switched K nor were the
# first samples of theirs), each at most OVERHEAD_CAP times its T(b, k) (one 100 ms pause
# moves it by 1 %), once OVERHEAD_MIN have come (the nearest bucket's before).
OVERHEAD_WINDOW = 256
OVERHEAD_MIN = 16
OVERHEAD_CAP = 3.0
# ADMISSIONS_PER_TOKEN: X(b) learns from undisturbed iterations only. What a disturbed
# one costs beyond them (the prefill, no step queued ahead) is paid per admission, and
# requests finish, so are admitted, in proportion to the tokens an iteration makes: per
# token at any K, a cost that leaves the ranking of E(k) / T(b, k) as it is, where X(b)
# charged it to every iteration and so favoured the K making more tokens an iteration.
# On an H100 at batch 32 under a server's load (fifty-first session) the undisturbed
# iterations' x was 0.03-0.05 ms, the disturbed ones' 0.76 (a third to two fifths of
# them): X(b) 0.28-0.39 ms lifted T(32, 2) by more than T(32, 3) in proportion, and the
# rule drafted K = 3 in 70 % of its iterations where its own T(32, 3) / T(32, 2) (1.139)
# and E(3) / E(2) (1.10) gave K = 2, as did fixed K = 2's 8 % more tokens/s.


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """E(k): tokens one row gains in an iteration drafting k (the bonus/correction token
    plus each accepted draft), with ``acceptance`` the conditional a_1, a_2, ..."""
    total, chain = 1.0, 1.0
    for a in acceptance[:k]:
        chain *= a
        total += chain
    return total


def expected_by_k(acceptance: Sequence[float], candidates: Sequence[int]) -> dict[int, float]:
    """{k: expected_tokens(acceptance, k)} for each of ``candidates`` in one pass (the same
    operations in the same order: the same floats)."""
    totals, total, chain = [1.0], 1.0, 1.0      # E(0), E(1), ...
    for a in acceptance[:max(candidates)]:
        chain *= a
        total += chain
        totals.append(total)
    last = len(totals) - 1      # a K past the acceptances known: all of them
    return {k: totals[k] if k <= last else total for k in candidates}


def choose_k(candidates: Sequence[int], acceptance: Sequence[float],
             times: dict[int, float]) -> int:
    """The rule: the candidate with the largest E(k) / T(k); the smaller K on a tie."""
    ks = sorted(candidates)
    return choose_by_rate(ks, expected_by_k(acceptance, ks), times)


def choose_by_rate(candidates: Sequence[int], expected: dict[int, float],
                   times: dict[int, float]) -> int:
    """The candidate with the largest ``expected[k]`` / T(k); the smaller K on a tie
    (``candidates`` in ascending order: AdaptiveK's are)."""
    best, best_rate = candidates[0], -1.0
    for k in candidates:
        t = times[k]
        # max(t, 1e-9) written out (the same value): the builtin's calls were 60 % of
        # this loop's host time, and it runs every iteration
        rate = expected[k] / (1e-9 if t < 1e-9 else t)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best


def acceptance_from_counts(reached: Sequence[float], accepted: Sequence[float]
                           ) -> list[float]:
    return [(a + PRIOR_ACCEPTED) / (r + PRIOR_ROWS) for r, a in zip(reached, accepted)]


def expected_from_counts(reached: Iterable[float], accepted: Iterable[float],
                         candidates: Sequence[int], *, scale: int = 0) -> dict[int, float]:
    """``expected_by_k(acceptance_from_counts(reached, accepted), candidates)`` in one pass
    without the acceptance list (every choice runs it): the same operations in the same
    order, so the same floats. ``scale``: each count taken in fixed point first,
    round(x * scale) / scale (as a SYNC row carries it), without a list of them."""
    totals, total, chain = [1.0], 1.0, 1.0      # E(0), E(1), ...
    for r, a in zip(reached, accepted):
        if scale:
            r, a = round(r * scale) / scale, round(a * scale) / scale
        chain *= (a + PRIOR_ACCEPTED) / (r + PRIOR_ROWS)
        total += chain
        totals.append(total)
    last = len(totals) - 1      # a K past the counts known: all of them
    return {k: totals[k] if k <= last else total for k in candidates}


def tail_expected_from_counts(reached: Iterable[float], accepted: Iterable[float],
                              tail_reached: Iterable[float], tail_accepted: Iterable[float],
                              candidates: Sequence[int], *, scale: int = 0
                              ) -> dict[int, float]:
    """E(k) per candidate from the tail's counts, with TAIL_PRIOR_ROWS pseudo-rows at the
    pooled acceptance (``reached``, ``accepted``: all rows' counts):
    ``expected_by_k`` of the tail's acceptances, each (tail accepted + TAIL_PRIOR_ROWS *
    ``acceptance_from_counts``) / (tail reached + TAIL_PRIOR_ROWS), in one pass without
    their lists (one GPU rank runs it at most choices the rule makes): the same operations
    in the same order, so the same floats. ``scale``: as ``expected_from_counts``'s."""
    totals, total, chain = [1.0], 1.0, 1.0      # E(0), E(1), ...
    for r, a, tr, ta in zip(reached, accepted, tail_reached, tail_accepted):
        if scale:
            r, a = round(r * scale) / scale, round(a * scale) / scale
            tr, ta = round(tr * scale) / scale, round(ta * scale) / scale
        pooled = (a + PRIOR_ACCEPTED) / (r + PRIOR_ROWS)
        chain *= (ta + TAIL_PRIOR_ROWS * pooled) / (tr + TAIL_PRIOR_ROWS)
        total += chain
        totals.append(total)
    last = len(totals) - 1      # a K past the counts known: all of them
    return {k: totals[k] if k <= last else total for k in candidates}


@attrs.define
class CostTable:
    """T(b, k) in seconds, b a batch class (``bucket``: the batch rounded up to a power of
    two, at most the largest graph bucket): the measured iterations at (b, k)
    (``measured``: the median of the first samples, then of the last RECENT) once there
    are some; before that ``device`` (VERIFY + DRAFT at warm-up, per graph bucket) plus
    ``rest`` (what the iterations measured so far at this class took beyond their warm-up
    time). Once a K has its first samples, an iteration that switched to it from another K,
    and one after which the rule leaves it, teach its switch cost (``switch``) and not its
    time: a K run in stretches costs its own pace, and a K tried one iteration at a time
    would otherwise look as dear as a switch (on the H200, n-gram K = 0 learned 0.75 ms
    that way, 0.48 in stretches, and was never chosen). ``learn``
    False keeps the table fixed and turns exploration off (tests force K to switch with a
    table of their own)."""

    device: dict[tuple[int, int], float]
    rest: dict[int, float] = attrs.Factory(dict)
    learn: bool = True
    measured: dict[tuple[int, int], float] = attrs.Factory(dict)
    samples: dict[tuple[int, int], int] = attrs.Factory(dict)   # learned measurements
    # Per (bucket, K): what its first iteration after another K and its last one before
    # another took beyond its time (each the median of its last RECENT), summed.
    switch: dict[tuple[int, int], float] = attrs.Factory(dict)
    # Disturbed measurements left out (where undisturbed ones were), for benches.
    ignored: int = 0
    # Per (bucket, K), for the ``adaptive_k`` event only (the rule does not read it): the
    # undisturbed iterations of a stretch (not a switch's first or last) over the engine's
    # life, [count, seconds]. Their mean is what a stretch at K costs (tokens/s pays the
    # mean), where ``measured`` is a median: on the H200 at batch 256 (fifty-fourth
    # session) the rule's T(3) / T(2) read 1.09 while its K = 3 iterations averaged 1.18x
    # its K = 2 ones in the same runs.
    lived: dict[tuple[int, int], list[float]] = attrs.Factory(dict)
    # The same for the disturbed iterations of a stretch (the rule learns none of them once
    # an undisturbed one came; the clock leaves out the prefill's device time): against
    # ``lived``, what admitting costs an iteration at each K beyond the prefill (its step
    # not queued ahead, joiners). Under a server's load at batch 256 nearly every iteration
    # admits; on the H100 (fifty-ninth session) the rule's T(3) / T(2) read ~1.07 there
    # while fixed K = 3 iterated 1.09x fixed K = 2, and the rule drafted K = 3 where K = 2
    # made 2 % more tokens/s: whether that cost grows with K is what this tells.
    lived_disturbed: dict[tuple[int, int], list[float]] = attrs.Factory(dict)
    # Per bucket: X(b), the iteration's cost beyond T(b, k) at any K (OVERHEAD_WINDOW;
    # undisturbed iterations, ADMISSIONS_PER_TOKEN),
    # added to every K's T there (``times``).
    overhead: dict[int, float] = attrs.Factory(dict)
    # Per bucket, what X(b)'s samples hold (``summary``'s ``overhead_split_ms``; the rule
    # does not read it): [samples, disturbed ones, sum of x over the undisturbed, over
    # the disturbed, sum of the prefill (full less the clock's time)]; the disturbed ones
    # are not X(b)'s (ADMISSIONS_PER_TOKEN).
    overhead_parts: dict[int, list[float]] = attrs.Factory(dict)
    # Whether X(b) learns from disturbed iterations too (``speculative.adaptive_admissions
    # = "per_iteration"``, the rule before the fifty-first session): ADMISSIONS_PER_TOKEN.
    admissions_in_overhead: bool = False
    _over: dict[int, _RecentMean] = attrs.field(factory=dict, init=False, repr=False)
    # Per (bucket, K): its first measurements, undisturbed ones and disturbed ones.
    _first: dict[tuple[int, int], tuple[list[float], list[float]]] = attrs.field(
        factory=dict, init=False, repr=False)
    # Per (bucket, K): its last RECENT learned times, and switch costs.
    _recent: dict[tuple[int, int], collections.deque[float]] = attrs.field(
        factory=dict, init=False, repr=False)
    _recent_switch: dict[tuple[tuple[int, int], bool], collections.deque[float]] = attrs.field(
        factory=dict, init=False, repr=False)
    _bucket_of: dict[int, int] = attrs.field(factory=dict, init=False, repr=False)
    _graph_of: dict[int, int] = attrs.field(factory=dict, init=False, repr=False)
    # Per bucket: the K with the most learned samples, once it has WELL_MEASURED.
    _anchor: dict[int, int] = attrs.field(factory=dict, init=False, repr=False)
    # Per (bucket, K) whose first samples are still in its window: [how many, samples
    # learned since]; FIRST_SAMPLES later they leave it.
    _provisional: dict[tuple[int, int], list[int]] = attrs.field(factory=dict, init=False,
                                                                 repr=False)
    # Paired pricing (FRESH_SPAN): per bucket, its own samples so far, per K the index of
    # each sample in its window, and the K whose window is fresh (``running``); per
    # (bucket, lo K, hi K), the evidence of log T(hi) - log T(lo), and its median once
    # PAIRED_MIN have come.
    _clock: dict[int, int] = attrs.field(factory=dict, init=False, repr=False)
    _stamps: dict[int, dict[int, collections.deque[int]]] = attrs.field(
        factory=dict, init=False, repr=False)
    _running: dict[int, int] = attrs.field(factory=dict, init=False, repr=False)
    # Per bucket: the K values whose windows are fresh, and each K priced from the running
    # one ({K: ratio}: a K not fresh, with its ratio once PAIRED_MIN pairs have come, else
    # None: at most the running K's time moved by warm-up's), kept by ``_stamp``
    # (``times`` runs every iteration, and a K's freshness changes only at an own sample).
    _fresh_ks: dict[int, set[int]] = attrs.field(factory=dict, init=False, repr=False)
    _priced: dict[int, dict[int, float | None]] = attrs.field(factory=dict, init=False,
                                                              repr=False)
    _pairs: dict[tuple[int, int, int], collections.deque[float]] = attrs.field(
        factory=dict, init=False, repr=False)
    paired: dict[tuple[int, int, int], float] = attrs.field(factory=dict, init=False,
                                                            repr=False)

    @property
    def buckets(self) -> list[int]:
        return sorted({b for b, _ in self.device})

    def bucket(self, batch_size: int) -> int:
        """The class an iteration of ``batch_size`` rows is learned in: host work grows
        with the rows whatever graph bucket pads them (with one bucket per engine, the
        last rows of a round would otherwise count as a full batch)."""
        # Once per iteration: remembered per batch size (the table's keys never change
        # after warm-up agreement).
        found = self._bucket_of.get(batch_size)
        if found is None:
            found = min(1 << max(batch_size - 1, 0).bit_length(), self.buckets[-1])
            self._bucket_of[batch_size] = found
        return found

    def _device(self, bucket: int, k: int) -> float | None:
        """Warm-up's time of the graph bucket that serves class ``bucket``."""
        return self.device.get((self._graph(bucket), k))

    def _graph(self, bucket: int) -> int:
        """The graph bucket that serves class ``bucket``."""
        graph = self._graph_of.get(bucket)
        if graph is None:
            buckets = self.buckets
            graph = self._graph_of[bucket] = bucket_for(bucket, buckets) or buckets[-1]
        return graph

    def own_device(self, bucket: int, k: int) -> float | None:
        """Warm-up's time for class ``bucket`` where a graph bucket of that size was timed
        (None where the class borrows a larger bucket's)."""
        device = self._device(bucket, k)
        return device if self._graph_of.get(bucket) == bucket else None

    def time(self, bucket: int, k: int) -> float:
        return self.times(bucket, (k,))[k]

    def times(self, bucket: int, ks: Iterable[int]) -> dict[int, float]:
        """{k: T(bucket, k)} for each of ``ks`` (every choice asks for all its candidates:
        one call, ``rest`` looked up once): measured, else warm-up's plus ``rest``; a K
        not WELL_MEASURED at a bucket whose anchor is takes at most the anchor's time
        moved by their warm-up times' difference (``moved``)."""
        measured, samples, found, rest = self.measured, self.samples, {}, None
        # Every K in one pass, warm-up's times looked up here, not through ``moved``
        # (the rule runs this at most of its choices, and prices most K values from
        # another): the same operations on each K as one step after another would do.
        graph, device = self._graph(bucket), self.device
        anchor = self._anchor.get(bucket)
        if anchor is not None:      # (measured: it has WELL_MEASURED samples)
            at_anchor, there_anchor = measured[(bucket, anchor)], device.get((graph, anchor))
        # A K not running, priced from the one running (``_stamp``).
        by_ratio = self._priced.get(bucket) if self._priced else None
        if by_ratio:
            running = self._running[bucket]
            base, there = measured[(bucket, running)], device.get((graph, running))
        x = self.overhead_at(bucket) if self.overhead else None
        for k in ks:
            key = (bucket, k)
            seen = measured.get(key)
            here = device.get((graph, k))
            if seen is None:
                assert here is not None, f"no warm-up time for K = {k}"
                if rest is None:
                    rest = self._rest(bucket)
                seen = here + rest
            if anchor is not None and k != anchor and samples.get(key, 0) < WELL_MEASURED:
                priced = moved(at_anchor, there_anchor, here)
                if priced < seen:
                    seen = priced
            if by_ratio and k in by_ratio:
                ratio = by_ratio[k]
                if ratio is not None:
                    seen = base * ratio
                # Not paired yet: at most the running K's time moved (done just above
                # where the running K is the anchor and this K is not well measured).
                elif running != anchor or samples.get(key, 0) >= WELL_MEASURED:
                    priced = moved(base, there, here)
                    if priced < seen:
                        seen = priced
            found[k] = seen if x is None else seen + x
        return found

    def overhead_at(self, bucket: int) -> float:
        """X(b) (OVERHEAD_WINDOW): the bucket's, else the nearest bucket's, else 0."""
        over = self.overhead
        x = over.get(bucket)
        if x is None:
            return over[_nearest_class(over, bucket)] if over else 0.0
        return x

    def iteration_overhead(self, bucket: int, k: int, full: float, seconds: float = 0.0,
                           disturbed: bool = False) -> None:
        """An iteration at (bucket, k) that kept its K took ``full`` seconds with its
        prefill (``seconds`` without; ``disturbed``: it or the next admitted requests):
        one sample of X(b), ``full`` less T(bucket, k) as learned (at most OVERHEAD_CAP
        times it), unless disturbed (ADMISSIONS_PER_TOKEN; ``admissions_in_overhead``:
        disturbed too); ``overhead_parts`` counts it in any case."""
        t = self.measured.get((bucket, k))
        if t is None:
            return
        x = full - t
        if x > OVERHEAD_CAP * t:
            x = OVERHEAD_CAP * t
        parts = self.overhead_parts.get(bucket)
        if parts is None:
            parts = self.overhead_parts[bucket] = [0, 0, 0.0, 0.0, 0.0]
        parts[0] += 1
        parts[1] += disturbed
        parts[3 if disturbed else 2] += x
        if seconds:
            parts[4] += full - seconds
        if disturbed and not self.admissions_in_overhead:
            return      # an admission's cost: per token at any K (ADMISSIONS_PER_TOKEN)
        recent = self._over.get(bucket)
        if recent is None:
            recent = self._over[bucket] = _RecentMean(OVERHEAD_WINDOW)
        mean = recent.add(x)
        if len(recent.window) >= OVERHEAD_MIN:
            self.overhead[bucket] = mean if mean > 0.0 else 0.0

    def running(self, bucket: int) -> int | None:
        """The K whose window is fresh at ``bucket`` (FRESH_SPAN; the latest sampled where
        more than one is), or None."""
        return self._running.get(bucket)

    def _fresh(self, bucket: int, k: int) -> bool:
        stamps = self._stamps.get(bucket, {}).get(k)
        return stamps is not None and \
            _fresh_window(stamps, self._clock.get(bucket, 0) - FRESH_SPAN)

    def _stamp(self, bucket: int, k: int, paired: bool) -> None:
        """An own sample of K = k joined its window: its index, and the running K
        (``paired``: the sample changed a pair's ratio)."""
        clock = self._clock[bucket] = self._clock.get(bucket, 0) + 1
        at = self._stamps.get(bucket)
        if at is None:
            at = self._stamps[bucket] = {}
        stamps = at.get(k)
        changed = paired or stamps is None      # a K new here is priced from now on
        if stamps is None:
            stamps = at[k] = collections.deque(maxlen=RECENT)
        stamps.append(clock)
        fresh = self._fresh_ks.get(bucket)
        if fresh is None:
            fresh = self._fresh_ks[bucket] = set()
        limit = clock - FRESH_SPAN
        if _fresh_window(stamps, limit) != (k in fresh):
            fresh.symmetric_difference_update((k,))     # k's own window may have shrunk
            changed = True
        for j in fresh:
            # Another K's window changes only at its own samples: only age ends it here,
            # and at one K a sample at most (each sample's index is the bucket's own).
            if j != k and at[j][0] <= limit:
                fresh.discard(j)
                changed = True
                break
        running = self._running.get(bucket)
        if k in fresh:
            changed = changed or running != k
            self._running[bucket] = running = k
        elif running is not None and running not in fresh:
            # The running K's window aged out: the fresh K sampled last runs now, if any
            # is (another K's window can outlive it: it was sampled last before).
            changed = True
            if fresh:
                running = self._running[bucket] = max(fresh, key=lambda j: at[j][-1])
            else:
                del self._running[bucket]
                running = None
        if changed:
            self._priced[bucket] = {} if running is None else {
                j: self.ratio(bucket, j, running) for j in at
                if j != running and j not in fresh}

    def ratio(self, bucket: int, k: int, base: int) -> float | None:
        """T(bucket, k) / T(bucket, base) as learned from pairs (PAIRED_MIN), or None."""
        lo, hi = (k, base) if k < base else (base, k)
        d = self.paired.get((bucket, lo, hi))
        if d is None:
            return None
        return math.exp(d if k == hi else -d)

    def _pair(self, bucket: int, k: int, seconds: float) -> bool:
        """An own sample of K = k: evidence against the running K (its window fresh) if
        that gave one of the bucket's last two own samples. Not against a K left longer
        ago: the rule leaves a K when its median runs high, and each sample of the new K
        against that window would make the new K look cheaper (a near run's own sample
        comes right after the running K's last). -> whether a pair's ratio changed."""
        j = self._running.get(bucket)
        if j is None or j == k or seconds <= 0 or \
                self._stamps[bucket][j][-1] < self._clock[bucket] - 1:
            return False
        e = math.log(seconds) - math.log(self.measured[(bucket, j)])
        lo, hi = (k, j) if k < j else (j, k)
        window = self._pairs.get((bucket, lo, hi))
        if window is None:
            window = self._pairs[(bucket, lo, hi)] = collections.deque(maxlen=PAIR_WINDOW)
        window.append(e if k == hi else -e)
        if len(window) < PAIRED_MIN:
            return False
        self.paired[(bucket, lo, hi)] = _median_low(window)
        return True

    def moved(self, bucket: int, anchor: int, k: int) -> float:
        """T(bucket, anchor) moved to K = k by their warm-up times (``moved``)."""
        return moved(self.measured[(bucket, anchor)], self._device(bucket, anchor),
                     self._device(bucket, k))

    def _rest(self, bucket: int) -> float:
        if bucket in self.rest:
            return self.rest[bucket]
        if not self.rest:
            return 0.0
        # A bucket not run yet: the nearest one measured (host work grows with rows).
        nearest = min(self.rest, key=lambda b: (abs(b - bucket), b))
        return self.rest[nearest]

    def tried(self, bucket: int, k: int) -> bool:
        """Whether K = k has its first measurements at ``bucket``: FIRST_SAMPLES
        undisturbed ones, or FIRST_DISTURBED disturbed ones."""
        first = self._first.get((bucket, k))
        return first is not None and _has_first(first)

    def learns_disturbed(self, bucket: int, k: int) -> bool:
        """Whether the seconds of a disturbed iteration at (bucket, k) can change the table
        (``observe``): not once an undisturbed one was learned there (it then only counts
        toward ``tried``), nor where nothing is learned."""
        first = self._first.get((bucket, k))
        if first is not None and first[0]:
            return False
        return self.learn and self._device(bucket, k) is not None

    def observe(self, bucket: int, k: int, seconds: float, disturbed: bool = False,
                switched: bool = False, leaving: bool = False) -> None:
        """An iteration at (bucket, k) took ``seconds``; ``disturbed``: it or the next one
        admitted requests (learned only where no undisturbed one was: FIRST_DISTURBED);
        ``switched``: the iteration before it ran another K, ``leaving``: the one after
        it does (once K = k has its first samples, either is learned as its switch cost
        only: on one GPU rank the iteration before a switch queues the next K's step,
        the one after it does without a step queued ahead)."""
        device = self._device(bucket, k)
        if not self.learn or device is None:
            return
        key = (bucket, k)
        if not (switched or leaving):
            kept = self.lived_disturbed if disturbed else self.lived
            lived = kept.get(key)
            if lived is None:
                lived = kept[key] = [0, 0.0]
            lived[0] += 1
            lived[1] += seconds
        first = self._first.get(key)
        if first is None:
            first = self._first[key] = ([], [])
        trying = not _has_first(first)
        if (switched or leaving) and not trying:
            if disturbed:
                self.ignored += 1
            else:
                extra = max(seconds - self.measured[key], 0.0)
                # A one-iteration run's extra time holds both sides' costs.
                for side in (True, False) if switched and leaving else (switched,):
                    _median_of_recent(self._recent_switch, (key, side),
                                      extra / (1 + (switched and leaving)))
                self.switch[key] = sum(_median_low(self._recent_switch[key, side])
                                       for side in (False, True)
                                       if (key, side) in self._recent_switch)
            return
        if trying:
            first[disturbed].append(seconds)    # counts toward ``tried`` in any case
        if disturbed and first[0]:
            self.ignored += 1
            return      # measured undisturbed: the admission's cost is not K's
        if not disturbed and len(first[0]) == (1 if trying else 0):
            # The first undisturbed sample (appended above while trying): the disturbed
            # ones before it leave the window.
            self._recent.pop(key, None)
            self._stamps.get(bucket, {}).pop(k, None)
        paired = not trying and self._pair(bucket, k, seconds)
        recent = _median_of_recent(self._recent, key, seconds)
        self._stamp(bucket, k, paired)
        if trying:
            self.measured[key] = _median_low(first[0] or first[1])
            if _has_first(first):   # the last first sample: they stay provisional
                self._provisional[key] = [len(self._recent[key]), 0]
        else:
            provisional = self._provisional.get(key)
            if provisional is not None:
                provisional[1] += 1
                if provisional[1] == FIRST_SAMPLES:
                    # As many samples since: the first ones leave the window (WELL_MEASURED).
                    window, stamps = self._recent[key], self._stamps[bucket][k]
                    for _ in range(min(provisional[0], len(window) - FIRST_SAMPLES)):
                        window.popleft()
                        stamps.popleft()
                    del self._provisional[key]
                    recent = _median_low(window)
            self.measured[key] = recent
            if not disturbed and not first[0]:
                first[0].append(seconds)    # from now on, disturbed ones are not learned
        count = self.samples[key] = self.samples.get(key, 0) + 1
        anchor = self._anchor.get(bucket)
        if count >= WELL_MEASURED and anchor != k and \
                (anchor is None or count > self.samples[(bucket, anchor)]):
            self._anchor[bucket] = k
        # ``rest``: an exponential average of the time beyond warm-up's (max(beyond, 0.0)
        # written out).
        beyond = seconds - device
        beyond = 0.0 if beyond < 0.0 else beyond
        old = self.rest.get(bucket)
        self.rest[bucket] = beyond if old is None else old + REST_WEIGHT * (beyond - old)

    def switch_cost(self, bucket: int, k: int) -> float:
        """K = k's switch cost at ``bucket`` (seconds; the nearest bucket's where this one
        has none yet, 0 before any)."""
        found = self.switch.get((bucket, k))
        if found is not None:
            return found
        there = [b for b, c in self.switch if c == k]
        if not there:
            return 0.0
        return self.switch[(min(there, key=lambda b: (abs(b - bucket), b)), k)]

    def as_tensor(self, keys: list[tuple[int, int]]) -> torch.Tensor:
        return torch.tensor([round(self.device[key] * 1e7) for key in keys], dtype=torch.int64)


Key = TypeVar("Key", bound=Hashable)
T = TypeVar("T")


def moved(measured: float, there: float | None, here: float | None) -> float:
    """A time ``measured`` where warm-up timed ``there``, moved to where it timed ``here``:
    by their difference, and no lower than shrunk in their proportion (measured iterations
    can run below warm-up's times, so the difference alone could reach zero); unmoved
    without both warm-up times."""
    if there is None or here is None or there <= 0:
        return measured
    # max(by_difference, shrunk) and min(ratio, 1.0) written out, as the builtins pick
    # (the rule prices most K values through this at most of its choices).
    ratio = here / there
    shrunk = measured * (1.0 if 1.0 < ratio else ratio)
    by_difference = measured + here - there
    return shrunk if shrunk > by_difference else by_difference


def fixed_point(values: Iterable[float]) -> list[float]:
    """Counts as a SYNC row carries them: round(x * SCALE) / SCALE."""
    return [round(x * SCALE) / SCALE for x in values]


def _nearest_class(buckets: Iterable[int], bucket: int) -> int:
    """The batch class among ``buckets`` nearest ``bucket`` in powers of two (the smaller
    on a tie)."""
    return min(buckets, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))


class _RecentMean:
    """The mean of the last ``size`` values added, kept as a running sum (once an
    iteration), summed afresh once a window so no rounding error piles up."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.window: collections.deque[float] = collections.deque(maxlen=size)
        self._total = 0.0
        self._added = 0

    def add(self, x: float) -> float:
        """Add ``x``; -> the mean of the window."""
        window = self.window
        if len(window) == self.size:
            self._total -= window[0]
        window.append(x)
        self._added += 1
        if self._added % self.size:
            self._total += x
        else:
            self._total = math.fsum(window)
        return self._total / len(window)


def _has_first(first: tuple[list[float], list[float]]) -> bool:
    """``CostTable.tried`` of a (bucket, K)'s first (undisturbed, disturbed) measurements."""
    return len(first[0]) >= FIRST_SAMPLES or len(first[1]) >= FIRST_DISTURBED


def _median_of_recent(recent: dict[Key, collections.deque[float]], key: Key,
                      value: float) -> float:
    """The median (low) of ``key``'s last RECENT values, ``value`` the newest."""
    window = recent.get(key)
    if window is None:
        window = recent[key] = collections.deque(maxlen=RECENT)
    window.append(value)
    return _median_low(window)


def _may_hold(calls: int, run: int) -> bool:
    """Whether the ``calls``-th choice may be held (HOLD): not one of the first ``run``
    (an explored run's length) + 1 of its EXPLORE_NEAR (near runs, explore turns, the
    choice after)."""
    return calls % EXPLORE_NEAR > run


def _fresh_window(stamps: collections.deque[int], limit: int) -> bool:
    """A K's window is fresh: full (RECENT samples), its oldest after ``limit`` (the
    bucket's own-sample index FRESH_SPAN back)."""
    return len(stamps) == RECENT and stamps[0] > limit


def _overhead_split(parts: list[float] | None) -> dict[str, float]:
    """``CostTable.overhead_parts`` of a bucket as the summary gives it (ms)."""
    if not parts or not parts[0]:
        return {}
    n, disturbed = parts[0], parts[1]
    return {"undisturbed": round(parts[2] / max(n - disturbed, 1) * 1e3, 3),
            "disturbed": round(parts[3] / max(disturbed, 1) * 1e3, 3),
            "disturbed_share": round(disturbed / n, 3),
            "prefill": round(parts[4] / n * 1e3, 3)}


def _median_low(values: Sequence[float]) -> float:
    """``statistics.median_low`` in less host time (once an iteration on one GPU rank)."""
    return sorted(values)[(len(values) - 1) // 2]


class AdaptiveK:
    """One rank's side of the rule: its decayed per-position counts (per draft class),
    the classes of its next batch's rows and its last measured iteration time (``facts``,
    its columns of the SYNC row), and ``choose``, which every rank runs on the gathered
    columns of all ranks, so all get the same K. ``classes``: the drafter's number of
    draft classes (0: none; every row is then unclassed, class ``classes``). ``tail``:
    without classes, E(k) is the batch's tail's (engine/_adaptive_tail.py: ``tail.rows``
    of the next batch into ``facts`` / ``next_k``, ``tail.accepted`` into ``record``).
    ``tree``: a draft tree of depth ``k_max`` (``speculative.tree``) stands for K = k_max
    where the group agrees a batch may draft it (``choose(..., tree=True)``): the tree's
    iterations keep counts of their own per depth (``record(..., tree=True)``), and there
    E(k_max) is theirs (pooled, not the tail's); T(b, k_max) is what K = k_max costs at
    that batch class, a tree's at the classes where batches draft it (warm-up times the
    tree there: ``calibrate``)."""

    def __init__(self, candidates: Sequence[int], cost: CostTable, classes: int = 0,
                 burn_in: int = 0, tail: bool = False, tree: bool = False,
                 settling: int | None = None) -> None:
        self.candidates = tuple(sorted(set(candidates)))
        # Iterations after a switch's first learned as nothing (SETTLING), and the length
        # of an explored run that leaves one own sample between its switches.
        self.settling = SETTLING if settling is None else settling
        self.explore_run = EXPLORE_RUN + self.settling
        self.burn_in = burn_in      # iterations not learned (BURN_IN for an engine's)
        self.k_max = self.candidates[-1]
        self.cost = cost
        self.classes = classes
        # Per class (the last one: unclassed rows), per position.
        self._reached = [[0.0] * self.k_max for _ in range(classes + 1)]
        self._accepted = [[0.0] * self.k_max for _ in range(classes + 1)]
        # The last iteration's time, sent once in ``facts`` (negative: ``disturb``), and
        # with its prefill (X(b): CostTable.iteration_overhead).
        self._measured_us = 0
        self._full_us = 0
        self._last: tuple[int, int] | None = None   # (bucket, k) of the last iteration
        self._before: int | None = None     # the K of the iteration before it
        self._run = 0       # the last iteration's place in its run of one K (SETTLING)
        self._calls = 0             # choices so far: the same count on every rank
        self._settled: set[int] = set()     # buckets where every K has its first samples
        self._committed: int | None = None     # ``commit``: the next choice
        # Choices per K (a plain dict: a Counter's increment costs 3x, every iteration).
        self.chosen: dict[int, int] = {}
        self.switches = 0           # choices whose K is not the last one's (``summary``)
        # Choices per (way, K) (``summary``'s ``ways``; the rule does not read it): how
        # each was made: ``rule`` (the rate's best), ``kept`` (the last K, the rule's
        # within SWITCH_MARGIN of it), ``first`` (a K's first samples), ``explore``
        # (EXPLORE_EVERY's turn), ``near`` (EXPLORE_NEAR's contender), ``held`` (HOLD),
        # ``stay`` (one GPU rank: the iteration before took no step queued ahead). On the
        # H100 at batch 64 (fifty-ninth session) one run in twelve drafted K = 0 for ~1,100
        # of its choices where T and E(k) in the events priced K = 2 20 % faster: this
        # tells which way those came.
        self.ways: dict[tuple[str, int], int] = {}
        self._way = "rule"          # the way of ``_rule``'s last choice
        self._ahead_way = "rule"    # the way of ``next_k``'s last choice (``commit``)
        # E(k) per class (the last: all pooled) from this rank's counts alone
        # (``_expected_here``), each kept until ``record`` changes it: one GPU rank asks
        # every iteration (``next_k``).
        self._own_expected: list[dict[int, float] | None] = [None] * (classes + 1)
        # The batch's tail: its decayed counts per position, and its E(k) from this rank's
        # counts (kept until ``record`` changes them, as ``_own_expected``).
        self.tail = BatchTail() if tail and not classes else None
        self._tail_reached = [0.0] * self.k_max
        self._tail_accepted = [0.0] * self.k_max
        self._own_tail: dict[int, float] | None = None
        self._no_tail = [0] * (2 * self.k_max)      # the tail's columns without a tail
        # A draft tree's decayed counts per depth, and its E(k_max) from this rank's counts
        # (kept until ``record`` changes them).
        self.tree = tree
        self._tree_reached = [0.0] * self.k_max
        self._tree_accepted = [0.0] * self.k_max
        self._own_tree: float | None = None
        # HOLD: (bucket, K, the last choice held) after a choice that kept its K, or None.
        self._hold: tuple[int, int, int] | None = None
        # The near run (EXPLORE_NEAR) the rule is in and its K (None: none near enough).
        self._near: tuple[int, int | None] = (-1, None)
        # The last decision's (bucket, E(k), T(b, k) before the rule's gates): ``summary``.
        self._view: tuple[int, dict[int, float], dict[int, float]] = (0, {}, {})
        # The settled bucket the last decision's times were borrowed from (``_borrowed``),
        # or None: the view's times are then those prices, not the bucket's own.
        self._view_from: int | None = None
        # Per (bucket, K): [iterations, sum of E(k) as the rule last took it there, sum
        # of the tokens a row those iterations made] over iterations without a tail
        # (``summary``'s ``e_check``; the rule does not read it): whether E(k) is priced
        # above what the K makes where the rule picks it.
        self.e_check: dict[tuple[int, int], list[float]] = {}

    @property
    def reached(self) -> list[float]:
        """Per position: the decayed rows that looked at that draft, all classes."""
        return [sum(col) for col in zip(*self._reached)]

    @property
    def accepted(self) -> list[float]:
        """Per position: the decayed rows that had that draft accepted, all classes."""
        return [sum(col) for col in zip(*self._accepted)]

    @property
    def num_columns(self) -> int:
        return (self.classes + 2) * (2 * self.k_max + 1) + 2 + \
            (2 * self.k_max if self.tree else 0)

    def facts(self, classes: Sequence[int] | None = None, tail_rows: int = 0) -> list[int]:
        """[per class: reached_1..K, accepted_1..K (x SCALE); per class: the next batch's
        rows of that class (``classes``: one per row; None: not told); the tail's
        reached_1..K, accepted_1..K (x SCALE) and the next batch's tail rows
        (``tail_rows``: ``tail.rows``); with a tree, its reached_1..K, accepted_1..K
        (x SCALE); the measured iteration's time with its prefill in us; its time in us
        (negative when disturbed)]."""
        row = self._row(classes, tail_rows)
        row[-2], row[-1] = self._full_us, self._measured_us
        self._measured_us = self._full_us = 0
        return row

    def unclassed(self, rows: int) -> list[int]:
        """``rows`` rows' classes where the drafter gives none."""
        return [self.classes] * rows

    def record(self, k: int, num_accepted: Sequence[int],
               classes: Sequence[int] | None = None,
               tail_accepted: Sequence[int] | None = None, *, tree: bool = False,
               at_least: Sequence[int] | None = None) -> None:
        """After VERIFY: each row drafted k and had ``num_accepted`` of them accepted;
        ``classes``: each row's class as the choice of k saw it (None: unclassed);
        ``tail_accepted``: the tail's rows' (``tail.accepted``; None: no tail). A class's
        counts, and the tail's, decay at the iterations that drafted rows of them.
        ``tree``: the iteration drafted the tree (k its depth): its own counts only.
        ``at_least``: ``accepted_at_least(num_accepted, k)`` where the caller has it (RESCAN
        counts once for the stats and the rule)."""
        if k == 0 or not num_accepted:
            return
        rows = len(num_accepted)
        if tree:
            assert self.tree, "a tree's iteration is recorded where the rule knows the tree"
            self._count(self._tree_reached, self._tree_accepted, k, rows,
                        at_least or accepted_at_least(num_accepted, k))
            self._own_tree = None
            return
        self._own_tail = None       # its prior is the pooled counts
        if tail_accepted:
            self._count(self._tail_reached, self._tail_accepted, k, len(tail_accepted),
                        accepted_at_least(tail_accepted, k))
        pooled = self.classes
        if classes is None:
            # Every row unclassed (no per-row work: a host-bound batch of 32-256 rows pays
            # for each).
            at_least = at_least or accepted_at_least(num_accepted, k)
            self._count(self._reached[pooled], self._accepted[pooled], k, rows, at_least)
            made = sum(at_least)
        else:
            by_class: dict[int, list[int]] = {}
            for c, n in zip(classes, num_accepted):
                by_class.setdefault(c, []).append(n)
            made = 0
            for c, accepted_rows in by_class.items():
                class_at_least = accepted_at_least(accepted_rows, k)
                self._count(self._reached[c], self._accepted[c], k, len(accepted_rows),
                            class_at_least)
                made += sum(class_at_least)
                self._own_expected[c] = None
        self._own_expected[pooled] = None
        if not tail_accepted:
            view_bucket, view_expected = self._view[0], self._view[1]
            last = self._last
            if last is not None and last[0] == view_bucket and k in view_expected:
                check = self.e_check.get((view_bucket, k))
                if check is None:
                    check = self.e_check[(view_bucket, k)] = [0, 0.0, 0.0]
                check[0] += 1
                check[1] += view_expected[k]
                check[2] += 1 + made / rows

    def _count(self, reached_c: list[float], accepted_c: list[float], k: int, rows: int,
               at_least: Sequence[int]) -> None:
        """Decay a class's counts and add an iteration's ``rows`` rows that drafted k,
        ``at_least`` of them with each draft accepted (``accepted_at_least``)."""
        reached = rows          # draft j+1 was looked at: drafts 1..j accepted
        for j in range(k):
            now = at_least[j]
            reached_c[j] = reached_c[j] * DECAY + reached
            accepted_c[j] = accepted_c[j] * DECAY + now
            reached = now
        if k < self.k_max:      # (an empty range's loop costs ~10 % of the call)
            for j in range(k, self.k_max):
                reached_c[j] *= DECAY
                accepted_c[j] *= DECAY

    def measured(self, seconds: float, full: float | None = None) -> None:
        """The iteration just run took ``seconds`` (prefill excluded), ``full`` with its
        prefill (None: ``seconds``)."""
        us = round(seconds * 1e6)
        self._measured_us = us if us > 1 else 1    # max(1, us) without the builtin's call
        if full is not None:
            us = round(full * 1e6)
            self._full_us = us if us > self._measured_us else self._measured_us
        else:
            self._full_us = self._measured_us

    def uses_disturbed_time(self) -> bool:
        """Whether the seconds of a disturbed time ``measured`` now can change what the
        rule learns (``IterationClock.tick``): not where ``commit`` holds the next choice
        (one rank: its ``choose_committed`` alone reads them, no ``facts`` send them) and
        the table learns nothing from them at the last iteration's bucket and K
        (``CostTable.learns_disturbed``; nothing else learns from them: ``full`` is the
        overhead's). Until that choice, neither changes (only a choice learns)."""
        last = self._last
        return self._committed is None or last is None or \
            self.cost.learns_disturbed(last[0], last[1])

    def disturb(self) -> None:
        """The time ``measured`` last (not sent yet) is disturbed: that iteration, or the
        one now starting, admitted requests (CostTable.observe: the next one's prefill
        and no step queued ahead of it cost the same at any K)."""
        self._measured_us = -abs(self._measured_us)

    def next_k(self, padded_batch_size: int, k: int, *, stay: bool = False,
               classes: Sequence[int] | None = None, tail_rows: int = 0,
               tree: bool = False) -> int:
        """One rank only: the next iteration's K, decided now (by the rule on this rank's
        counts and the times learned so far: the next iteration's own choice taken early),
        so that its step can be queued before this one (at ``k``) is read back; ``classes``
        its rows' (as the host knows them now: a step earlier than ``choose`` would),
        ``tail_rows`` their tail's (``tail.rows``); ``tree``: the batch may draft the tree
        (as ``choose``'s).
        ``stay``: ``k`` again, whatever the rule says (an iteration whose step was not
        queued ahead is followed by one that is, so a K gets timed as it runs in a
        stretch). Commits nothing: ``commit`` does, once the step is queued."""
        if stay:
            self._ahead_way = "stay"
            return k
        bucket, calls = self.cost.bucket(padded_batch_size), self._calls + 1
        held = self._held(bucket, calls)
        if held is not None:
            self._ahead_way = "held"
            return held
        expected = self._tail_here() if tail_rows else self._expected_here(classes)
        if tree:
            expected = self._with_tree(expected, self._tree_here())
        k = self._rule(expected, bucket, calls)
        self._ahead_way = self._way
        return k

    def _held(self, bucket: int, calls: int) -> int | None:
        """The K held for the ``calls``-th choice at ``bucket`` (HOLD), or None."""
        hold = self._hold
        if hold is None or calls > hold[2] or hold[0] != bucket or \
                not _may_hold(calls, self.explore_run):
            return None
        return hold[1]

    def commit(self, k: int) -> None:
        """The next ``choose`` returns ``k`` without running the rule (one rank only)."""
        self._committed = k

    @property
    def committed(self) -> bool:
        """Whether the next ``choose`` is held by ``commit``."""
        return self._committed is not None

    def choose(self, rows: list[list[int]], padded_batch_size: int, *,
               tree: bool = False) -> int:
        """``rows``: every rank's ``facts`` (world lists of ``num_columns`` ints, as SYNC
        gathers them). Learn the last iteration's time (the slowest rank's), pool the
        counts, apply the rule (or take the K held by ``commit``). ``tree``: the group
        agrees this batch may draft the tree (K = k_max then drafts it)."""
        times = [row[-1] for row in rows]
        # The slowest rank's time; disturbed when any rank's was.
        return self._choose(rows, max(map(abs, times)), min(times) < 0, padded_batch_size,
                            max(row[-2] for row in rows), tree)

    def choose_committed(self, padded_batch_size: int) -> int:
        """One rank: ``choose`` where ``commit`` holds the choice (no columns to build:
        this rank's measured time is the only one)."""
        assert self._committed is not None, "choose_committed after commit only"
        measured, self._measured_us = self._measured_us, 0
        full, self._full_us = self._full_us, 0
        return self._choose(None, abs(measured), measured < 0, padded_batch_size, full)

    def _choose(self, rows: list[list[int]] | None, measured_us: int, disturbed: bool,
                padded_batch_size: int, full_us: int = 0, tree: bool = False) -> int:
        """``choose`` once the group's time is known (us, 0: none; ``full_us``: with the
        prefill; ``rows`` None: committed)."""
        # The last iteration's time is learned (at its bucket and K; ``switched``: the one
        # before it ran another K) unless nothing was measured or the engine is burning
        # in. Plain arguments to ``observe``: a tuple of them passed with * took ~8 % more
        # host time an iteration.
        cost, last, before = self.cost, self._last, self._before
        learn = last is not None and measured_us > 0 and self._calls > self.burn_in
        last_bucket, last_k = last or (0, 0)      # (0, 0): nothing to learn
        seconds, switched = measured_us / 1e6, before is not None and before != last_k
        bucket = cost.bucket(padded_batch_size)
        calls = self._calls = self._calls + 1
        k = self._committed
        if k is not None:
            self._committed = None
            way = self._ahead_way
        else:
            if learn and not cost.tried(last_bucket, last_k):
                # A first sample: the rule's next pick.
                cost.observe(last_bucket, last_k, seconds, disturbed, switched)
                learn = False
            assert rows is not None
            k, way = self._held(bucket, calls), "held"
            if k is None:
                k = self._rule(self._expected(rows, tree), bucket, calls)
                way = self._way
        ways, key = self.ways, (way, k)
        ways[key] = ways.get(key, 0) + 1
        # Learned once the K after it is known (``leaving`` its K); a run's ``settling``
        # iterations after its first (``switched``) are not, once its K has its first
        # samples at that bucket (SETTLING; before them any sample is worth more than none).
        if learn and not (1 < self._run <= 1 + self.settling and
                          cost.tried(last_bucket, last_k)):
            cost.observe(last_bucket, last_k, seconds, disturbed, switched, k != last_k)
            if not switched and k == last_k and full_us:
                cost.iteration_overhead(last_bucket, last_k, full_us / 1e6, seconds,
                                        disturbed)
        # (The engine's first K follows no switch: nothing to settle.)
        self._run = 2 + self.settling if last is None else \
            self._run + 1 if k == last_k else 1
        before = self._before = None if last is None else last_k
        self.switches += before is not None and before != k
        self._last = (bucket, k)
        chosen = self.chosen
        chosen[k] = chosen.get(k, 0) + 1
        return k

    def _row(self, classes: Sequence[int] | None, tail_rows: int = 0) -> list[int]:
        counts = [round(x * SCALE) for c in range(self.classes + 1)
                  for x in self._reached[c] + self._accepted[c]]
        rows = [0] * (self.classes + 1)
        for c in classes or ():
            rows[c] += 1
        tail = [round(x * SCALE) for x in self._tail_reached + self._tail_accepted] \
            if self.tail is not None else self._no_tail
        tree = [round(x * SCALE) for x in self._tree_reached + self._tree_accepted] \
            if self.tree else []
        return counts + rows + tail + [tail_rows] + tree + [0, 0]

    def _tree_here(self) -> float:
        """The tree's E(k_max) from this rank's counts in fixed point (as its SYNC row
        sends them), kept until ``record``."""
        found = self._own_tree
        if found is None:
            found = self._own_tree = expected_from_counts(
                self._tree_reached, self._tree_accepted, (self.k_max,),
                scale=SCALE)[self.k_max]
        return found

    def _with_tree(self, expected: dict[int, float], tree: float) -> dict[int, float]:
        """E(k) with K = k_max drafting the tree: its E in place of the chain's."""
        return {**expected, self.k_max: tree}

    def _tail_here(self) -> dict[int, float]:
        """``_expected([self._row(None, rows)])`` for a batch with a tail, from this rank's
        counts in fixed point (as its SYNC row sends them), kept until ``record``."""
        found = self._own_tail
        if found is None:
            found = self._own_tail = tail_expected_from_counts(
                self._reached[0], self._accepted[0], self._tail_reached,
                self._tail_accepted, self.candidates, scale=SCALE)
        return found

    def _expected_here(self, classes: Sequence[int] | None) -> dict[int, float]:
        """``_expected([self._row(classes)])``, from per-class E(k) kept until the next
        ``record`` (the same fixed-point counts, so the same numbers)."""
        pooled = self.classes
        if classes is None:     # no row classed: the pooled counts alone
            return self._own_class(pooled)
        if len(classes) == 1:   # one row (batch 1): n = total = 1 and 1 * e / 1 == e
            return self._own_class(classes[0])
        sizes = collections.Counter(classes)
        if not sizes or set(sizes) == {pooled}:
            return self._own_class(pooled)
        total = len(classes)
        per_class = {c: self._own_class(c) for c in sizes}
        return {k: sum(n * per_class[c][k] for c, n in sorted(sizes.items())) / total
                for k in self.candidates}

    def _own_class(self, c: int) -> dict[int, float]:
        """E(k) of class ``c`` (``classes``: all pooled) from this rank's counts, as
        ``_expected`` computes it from this rank's row."""
        found = self._own_expected[c]
        if found is None:
            # The counts in fixed point, as this rank's SYNC row sends them
            # (test_one_ranks_kept_expectation_is_the_columns_one holds the floats to
            # ``_expected``'s).
            if c < self.classes or not self.classes:
                # One class (a drafter without classes: every iteration).
                found = expected_from_counts(self._reached[c], self._accepted[c],
                                             self.candidates, scale=SCALE)
            else:   # every class's, pooled
                fixed = [(fixed_point(self._reached[m]), fixed_point(self._accepted[m]))
                         for m in range(self.classes + 1)]
                found = expected_from_counts([sum(col) for col in zip(*(r for r, _ in fixed))],
                                             [sum(col) for col in zip(*(a for _, a in fixed))],
                                             self.candidates)
            self._own_expected[c] = found
        return found

    def _expected(self, rows: list[list[int]], tree: bool = False) -> dict[int, float]:
        """E(k) per candidate from the gathered rows: the tail's where a rank sent tail
        rows (its counts pooled over the ranks, engine/_adaptive_tail.py); else the mean
        over the batches' rows of their class's E(k) (unclassed rows, and every row when
        no rank told its classes: all classes' counts pooled). ``tree``: K = k_max drafts
        the tree, whose E(k_max) comes from the tree's counts pooled over the ranks."""
        expected = self._chain_expected(rows)
        if not tree:
            return expected
        n, per = self.k_max, 2 * self.k_max
        at = (self.classes + 1) * (per + 1) + per + 1       # the tree's columns
        counts = [sum(row[at + j] for row in rows) / SCALE for j in range(per)]
        return self._with_tree(expected, expected_from_counts(counts[:n], counts[n:],
                                                              (n,))[n])

    def _chain_expected(self, rows: list[list[int]]) -> dict[int, float]:
        """``_expected`` of the chains."""
        n, per = self.k_max, 2 * self.k_max
        counts = [[sum(row[c * per + j] for row in rows) / SCALE for j in range(per)]
                  for c in range(self.classes + 1)]
        at = (self.classes + 1) * per
        sizes = [sum(row[at + c] for row in rows) for c in range(self.classes + 1)]
        reached = [sum(col) for col in zip(*(x[:n] for x in counts))]
        accepted = [sum(col) for col in zip(*(x[n:] for x in counts))]
        at += self.classes + 1      # the tail's columns
        if sum(row[at + per] for row in rows):
            tail = [sum(row[at + j] for row in rows) / SCALE for j in range(per)]
            return tail_expected_from_counts(reached, accepted, tail[:n], tail[n:],
                                             self.candidates)
        pooled = expected_from_counts(reached, accepted, self.candidates)
        if not sum(sizes[:-1]):     # no classed row: the pooled counts alone
            return pooled
        per_class = [expected_from_counts(x[:n], x[n:], self.candidates) if size else {}
                     for size, x in zip(sizes[:-1], counts[:-1])] + [pooled]
        total = sum(sizes)
        return {k: sum(size * e[k] for size, e in zip(sizes, per_class) if size) / total
                for k in self.candidates}

    def _stay(self, k: int, last: int, expected: dict[int, float], times: dict[int, float],
              bucket: int) -> int:
        """The last iteration's K, ``last``, unless ``k`` beats it by SWITCH_MARGIN once
        the switch there and back is paid (``CostTable.switch_cost`` of both, spread over
        SWITCH_HORIZON iterations of ``k``): measured rates within noise of each other
        would flip K, and the first drafting iteration after K = 0 ones pays an eager
        catch-up (the last K is agreed: every rank's is the same)."""
        paid = self.cost.switch_cost(bucket, k) + self.cost.switch_cost(bucket, last)
        rate_k = expected[k] / max(times[k] + paid / SWITCH_HORIZON, 1e-9)
        rate_last = expected[last] / max(times[last], 1e-9)
        return k if rate_k > rate_last * (1 + SWITCH_MARGIN) else last

    def _borrowed(self, bucket: int, own: dict[int, float] | None = None
                  ) -> dict[int, float]:
        """T(bucket, k) at a bucket not settled, from the nearest settled one's measured
        times: each K's moved by the change in its own warm-up device time between the
        two buckets (drafting K tokens makes VERIFY's rows K + 1 times the batch's, so its
        time grows with the rows faster than K = 0's, which one factor for every K
        ignores), then all scaled by this bucket's measured time over that estimate at the
        K measured most here (1 when none is): learning each K afresh at every power of
        two a round's rows pass through cost ~1/4 of a short round's iterations on the
        H200 (run 5). Moved only where both classes have warm-up times of their own (a
        graph bucket each; eager warm-up times only the smallest and the largest batch,
        whose growth is not this pair's), and never below the settled time shrunk in
        proportion to the warm-up times (measured iterations can run below warm-up's, so
        the difference alone could reach zero and make that K look free). ``own``
        (ADAPTIVE_BORROW "untried"): the bucket's own prices, kept for every K
        WELL_MEASURED here. The settled bucket is kept for ``summary`` (``_view_from``)."""
        cost = self.cost
        near = self._view_from = _nearest_class(self._settled, bucket)

        estimate = {c: moved(cost.measured[(near, c)], cost.own_device(near, c),
                             cost.own_device(bucket, c)) for c in self.candidates}
        here = [c for c in self.candidates if (bucket, c) in cost.measured]
        scale = 1.0
        if here:
            most = max(here, key=lambda c: (cost.samples.get((bucket, c), 0), c))
            scale = cost.measured[(bucket, most)] / max(estimate[most], 1e-9)
        x = cost.overhead_at(bucket)
        if own is None:
            return {c: t * scale + x for c, t in estimate.items()}
        samples = cost.samples
        return {c: own[c] if samples.get((bucket, c), 0) >= WELL_MEASURED else t * scale + x
                for c, t in estimate.items()}

    @property
    def choices(self) -> int:
        """Choices so far (the same count on every rank)."""
        return self._calls

    def summary(self) -> dict[str, Any]:
        """What the rule saw at its last decision and has learned at that bucket (the
        worker's ``adaptive_k`` log event): K chosen so far, E(k) and T(b, k) as the
        rule took them, each K's measured time, samples and switch cost there."""
        bucket, expected, times = self._view
        cost = self.cost
        running = cost.running(bucket)
        return {
            "choices": self._calls, "chosen": dict(sorted(self.chosen.items())),
            "switches": self.switches,
            "ways": {way: {k: n for (w, k), n in sorted(self.ways.items()) if w == way}
                     for way in sorted({w for w, _ in self.ways})},
            "bucket": bucket,
            # The settled bucket whose times ``times_ms`` were borrowed from (the bucket
            # not settled: a K without first samples there), or None.
            "borrowed_from": self._view_from,
            "expected": {k: round(e, 3) for k, e in expected.items()},
            "times_ms": {k: round(t * 1e3, 3) for k, t in times.items()},
            "measured_ms": {k: round(cost.measured[(bucket, k)] * 1e3, 3)
                            for k in self.candidates if (bucket, k) in cost.measured},
            # Warm-up's times of the graph bucket serving this class: what a K not yet
            # measured, or priced from another K (``moved``), starts from.
            "warmup_ms": {k: round(t * 1e3, 3) for k in self.candidates
                          for t in (cost._device(bucket, k),) if t is not None},
            "samples": {k: cost.samples.get((bucket, k), 0) for k in self.candidates},
            # Per K: [iterations, their mean ms] of its undisturbed stretches here over the
            # engine's life (``CostTable.lived``): against measured_ms, a median's bias.
            "lived_ms": {k: [int(n), round(t / n * 1e3, 3)] for k in self.candidates
                         for n, t in (cost.lived.get((bucket, k), (0, 0.0)),) if n},
            # The same for its disturbed stretch iterations (``CostTable.lived_disturbed``).
            "disturbed_ms": {k: [int(n), round(t / n * 1e3, 3)] for k in self.candidates
                             for n, t in (cost.lived_disturbed.get((bucket, k), (0, 0.0)),)
                             if n},
            "switch_ms": {k: round(cost.switch[(bucket, k)] * 1e3, 3)
                          for k in self.candidates if (bucket, k) in cost.switch},
            # X(b): in times_ms, beyond measured_ms (OVERHEAD_WINDOW).
            "overhead_ms": round(cost.overhead_at(bucket) * 1e3, 3),
            # What X(b)'s samples here held, over the engine's life: the mean x of the
            # undisturbed and of the disturbed iterations, the share disturbed, the mean
            # prefill in them.
            "overhead_split_ms": _overhead_split(cost.overhead_parts.get(bucket)),
            # Per K: iterations (no tail), E(k) as priced, tokens a row they made.
            "e_check": {k: [int(n), round(e / n, 3), round(r / n, 3)]
                        for (b, k), (n, e, r) in sorted(self.e_check.items())
                        if b == bucket and n},
            # Paired pricing: the K running, and each other K's T over the running one's
            # where PAIRED_MIN pairs have priced it.
            "running": running,
            "paired": {} if running is None else {
                k: round(ratio, 3) for k in self.candidates if k != running
                for ratio in (cost.ratio(bucket, k, running),) if ratio is not None},
            "tail_rows": None if self.tail is None else len(self.tail.members)}

    def _rule(self, expected: dict[int, float], bucket: int, calls: int) -> int:
        """The choice of the ``calls``-th iteration at ``bucket``, E(k) ``expected``."""
        times = self.cost.times(bucket, self.candidates)
        self._view, self._view_from = (bucket, expected, times), None
        k = choose_by_rate(self.candidates, expected, times)
        self._way = "rule"
        if self.cost.learn:
            # Host work differs by K (drafting's own), which warm-up cannot time: each K
            # runs FIRST_SAMPLES times at the first bucket before the rule decides there
            # (K = 0 first, then 1, ...: a K's iterations in a row, as it runs when
            # chosen), and again in turn; other buckets borrow the settled one's times.
            if bucket not in self._settled:
                untried = [c for c in self.candidates if not self.cost.tried(bucket, c)]
                if not untried:
                    self._settled.add(bucket)
                elif not self._settled:
                    self._way = "first"
                    return untried[0]
                else:
                    times = self._borrowed(
                        bucket, times if ADAPTIVE_BORROW == "untried" else None)
                    self._view = (bucket, expected, times)
                    k = choose_by_rate(self.candidates, expected, times)
            # An explored run just ended: an EXPLORE_EVERY turn, or the near run
            # ``_contender`` chose at this EXPLORE_NEAR's start.
            run = self.explore_run
            explored = calls > EXPLORE_EVERY and calls % EXPLORE_EVERY == run or \
                calls % EXPLORE_NEAR == run and \
                self._near[0] == calls // EXPLORE_NEAR and self._near[1] is not None
            last = None if self._last is None else self._last[1]
            # After an explored run the rule's K is back without a gate.
            if not explored and last is not None and last != k:
                k = self._stay(k, last, expected, times, bucket)
                if k == last:
                    self._way = "kept"
            if calls >= EXPLORE_EVERY and calls % EXPLORE_EVERY < run:
                turn, n_k = calls // EXPLORE_EVERY, len(self.candidates)
                explore = self.candidates[turn % n_k]
                rate = {c: expected[c] / max(times[c], 1e-9) for c in (k, explore)}
                if rate[explore] >= EXPLORE_RATE * rate[k] or \
                        (turn // n_k) % EXPLORE_RARELY == 0:
                    k, self._way = explore, "explore"
            elif calls >= EXPLORE_NEAR and calls % EXPLORE_NEAR < run and \
                    bucket in self._settled:
                near = self._contender(calls // EXPLORE_NEAR, k, expected, times, bucket)
                if near != k:
                    k, self._way = near, "near"
            if k == last and not self.classes and bucket in self._settled and \
                    _may_hold(calls, run):
                self._hold = (bucket, k, calls + HOLD - 1)
        return k

    def _contender(self, run: int, k: int, expected: dict[int, float],
                   times: dict[int, float], bucket: int) -> int:
        """The K of the ``run``-th near run (EXPLORE_NEAR), chosen at its first iteration:
        the K other than ``k`` with the best rate once the switch there and back is paid
        over the run (on the H200 at batch 1 a switch to eagle3 K = 1 cost ~0.3 ms, to
        K = 2 or 3 ~0.05), if that is within NEAR_RATE of ``k``'s; else ``k``."""
        if self._near[0] != run:
            there = self.cost.switch_cost(bucket, k)
            rate_k = expected[k] / max(times[k], 1e-9)
            best, best_rate = None, NEAR_RATE * rate_k
            for c in self.candidates:
                if c != k:
                    paid = (self.cost.switch_cost(bucket, c) + there) / self.explore_run
                    rate = expected[c] / max(times[c] + paid, 1e-9)
                    if rate >= best_rate:
                        best, best_rate = c, rate
            self._near = (run, best)
        return k if self._near[1] is None else self._near[1]


@attrs.define
class IterationClock:
    """Adaptive K's clock (the worker's): one iteration is from the start of its SCHEDULE
    to the start of the next (``tick``), less what does not depend on K (``exclude``:
    waiting for work, waiting for the group's last rank; ``prefill_started`` /
    ``prefill_done``: the prefill, on a GPU as long as the device took for it, which
    VERIFY's read-back waits behind, read where the rule can use it). ``timed``: this
    iteration chose K and its time is learned; an iteration that prefilled, and the one
    before it, are disturbed (``AdaptiveK.disturb``). Without ``adaptive`` it keeps no
    time."""

    adaptive: AdaptiveK | None = None
    # On a GPU (the rank's device): the prefill's device time from CUDA events (its
    # kernels run after the host queued them, replayed graphs in far less host time than
    # they take on the device, and this iteration's VERIFY read-back waits behind them).
    device: torch.device | None = None
    started: float = 0.0
    excluded_s: float = 0.0
    # The part of ``excluded_s`` that is this iteration's prefill (X(b) counts it).
    prefill_s: float = 0.0
    timed: bool = False
    prefilled: bool = False
    # (start event, end event, host seconds already excluded) of this iteration's prefill.
    _events: tuple[Any, Any, float] | None = attrs.field(default=None, init=False)
    # The two timing events every prefill records, and the stream it queues on, made once:
    # under a server's load a prefill runs nearly every iteration, and two new events a
    # time (created, recorded on the stream looked up again, destroyed) cost ~40 us of an
    # iteration's host time at batch 64 on the H200, the pair made once ~16
    # (bench_process_gpu.py --timers: prefill_started + prefill_done). An
    # event recorded again before it completed stands for its latest record; ``tick`` has
    # read this iteration's pair by then (or found it not done: not timed; or its time not
    # needed).
    _pair: tuple[Any, Any, Any] | None = attrs.field(default=None, init=False)
    # Whether ``on_device``'s job recorded the pair for this prefill.
    _recorded: bool = attrs.field(default=False, init=False)

    def tick(self) -> None:
        """The last iteration ends where this one starts: hand its time to the rule."""
        adaptive = self.adaptive
        if adaptive is None:
            return
        now = time.perf_counter()
        # The prefill's kernels are done when VERIFY's read-back waited behind them; not
        # when that VERIFY took a step queued before them (one GPU rank: newcomers held
        # back an iteration, RunAhead.schedule). Then the host must not wait for them
        # here, and this iteration (disturbed anyway) is not timed. Each CUDA call here
        # costs the loop thread a GIL handoff (``on_device``): asked of a timed
        # iteration only.
        events = self._events
        if self.timed and (events is None or events[1].query()):
            seconds = now - self.started - self.excluded_s
            # With its prefill (X(b)'s sample): the prefill's device time moves time from
            # ``seconds`` to the prefill's part, so ``full`` does not depend on it.
            full = seconds + self.prefill_s
            # An iteration that prefilled is disturbed, whose seconds the rule often does
            # not learn: then its device time is not read.
            if events is not None and adaptive.uses_disturbed_time():
                start, end, host = events
                seconds -= max(start.elapsed_time(end) / 1e3 - host, 0.0)
            adaptive.measured(seconds, full)
            if self.prefilled:
                adaptive.disturb()
        self.started, self.excluded_s, self.prefill_s, self.timed = now, 0.0, 0.0, False
        self.prefilled, self._events = False, None

    def exclude(self, seconds: float) -> None:
        self.excluded_s += seconds

    def prefill_started(self) -> float:
        """Before the prefill is queued: the host's time."""
        return time.perf_counter()

    def on_device(self, prefill: Callable[[], T]) -> Callable[[], T]:
        """``prefill`` with the pair of timing events recorded around it on the device's
        stream, for the compute thread to run: a CUDA call on the loop thread releases the
        GIL and waits to take it back from the compute thread (comm/_shm.py), where the
        compute thread runs its own torch calls anyway. ``prefill`` itself without
        adaptive K or off a GPU."""
        if self.adaptive is None or self.device is None or self.device.type != "cuda":
            return prefill

        def timed() -> T:
            pair = self._pair
            if pair is None:
                # The engine queues all its work on the device's current stream (only
                # graph capture, at warm-up, uses a side stream).
                pair = self._pair = (torch.cuda.Event(enable_timing=True),
                                     torch.cuda.Event(enable_timing=True),
                                     torch.cuda.current_stream(self.device))
            pair[0].record(pair[2])
            out = prefill()
            pair[1].record(pair[2])
            self._recorded = True
            return out
        return timed

    def prefill_done(self, mark: float) -> None:
        """After it is queued (``mark``: ``prefill_started``'s): excluded, and this
        iteration and the last disturbed."""
        if self.adaptive is None:
            return
        host = time.perf_counter() - mark
        self.excluded_s += host
        self.prefill_s += host
        self.prefilled = True
        self.adaptive.disturb()
        if self._recorded:
            assert self._pair is not None, "on_device's job made the pair"
            self._recorded = False
            self._events = (self._pair[0], self._pair[1], host)
