"""Adaptive K's tail of the batch (engine/_adaptive_tail.py): the rows the batch waits on
longest, their own acceptance counts, and the group's agreement on K from them."""

import random
import weakref

import pytest
import torch

from specloop.comm import LocalGroup
from specloop.engine import AsyncEngine
from specloop.engine._adaptive import (SCALE, AdaptiveK, CostTable, acceptance_from_counts,
                                       choose_by_rate, expected_by_k,
                                       tail_expected_from_counts)
from specloop.engine._adaptive_tail import (TAIL_EVERY, TAIL_MIN_ROWS, TAIL_PRIOR_ROWS,
                                            TAIL_QUIET, TAIL_SHARE, BatchTail)
from specloop.samplers import SamplingParams

from .conftest import make_config, serve_staggered
from .test_adaptive import KLog, check_greedy

KS = (0, 1, 2, 3)


class Row:
    """A request as the tail reads it: its token limit and its tokens so far."""

    def __init__(self, limit: int, length: int) -> None:
        self.stop_length, self.token_ids = limit, [0] * length


def quiet(tail: BatchTail, batch: list, admitted: int | None = None) -> int:
    """``tail.rows(batch)`` once the batch has had no join for TAIL_QUIET iterations
    (``admitted``: the scheduler's admissions so far, the batch's rows by default)."""
    admitted = len(batch) if admitted is None else admitted
    for _ in range(TAIL_QUIET):
        tail.rows(batch, admitted)
    return tail.rows(batch, admitted)


def test_the_tail_is_the_rows_with_most_tokens_left():
    rng = random.Random(5)
    for _ in range(30):
        n = rng.randint(1, 40)
        batch = [Row(300, length) for length in rng.sample(range(10, 290), n)]
        tail = BatchTail()
        rows = quiet(tail, batch)
        take = max(TAIL_MIN_ROWS, round(n * TAIL_SHARE))
        if take >= n:
            assert rows == 0 and tail.accepted(batch, [1] * n) is None
            continue
        assert rows == take
        shortest = sorted(batch, key=lambda r: len(r.token_ids))[:take]
        assert tail.members == frozenset(shortest)
        accepted = [rng.randint(0, 3) for _ in batch]
        assert tail.accepted(batch, accepted) == \
            [a for r, a in zip(batch, accepted) if r in tail.members]


def test_the_tail_is_chosen_again_when_the_batch_changes_size_by_a_quarter_or_ages():
    batch = [Row(100, length) for length in range(10, 30)]        # 20 rows: a tail of 5
    tail, admitted = BatchTail(), 20
    quiet(tail, batch)
    first = tail.members
    assert first == frozenset(batch[:5])
    for row in batch[:5]:
        row.token_ids = [0] * 99           # the tail's rows nearly done
    for _ in range(TAIL_EVERY - 1):
        tail.rows(batch, admitted)
        assert tail.members == first       # held between choices
    tail.rows(batch, admitted)
    assert tail.members == frozenset(batch[5:10])     # aged: chosen again
    for row in batch[5:10]:
        row.token_ids = [0] * 99           # these nearly done too
    del batch[12]
    tail.rows(batch, admitted)             # a row ended (19): held (a server's load)
    assert tail.members == frozenset(batch[5:10])
    del batch[:6]                          # 13 rows: moved by more than a quarter
    tail.rows(batch, admitted)
    assert tail.members == frozenset(batch[4:8])
    fresh = Row(0, 5)                      # not committed yet: no limit known, last
    batch.append(fresh)                    # a request joined: no tail until quiet again
    admitted += 1
    assert tail.rows(batch, admitted) == 0 and not tail.members
    assert quiet(tail, batch, admitted) == TAIL_MIN_ROWS
    assert fresh not in tail.members and tail.members == frozenset(batch[4:8])
    del batch[4:]                          # 4 rows: no tail, at once
    assert tail.rows(batch, admitted) == 0 and tail.accepted(batch, [1] * 4) is None


def test_the_tail_decides_only_once_the_batch_drains():
    """A batch that a request joined within TAIL_QUIET iterations (the scheduler admitted
    one: ``Scheduler.admitted`` moved) has no tail for the rule (``rows`` 0: E(k) the
    pooled counts'; under a server's load the rows with most left are the newest, early
    in their answers, where a head accepts least), and none is chosen or counted then
    (under that load the tail would cost its sort and a lookup a row every iteration for
    nothing); once quiet it is chosen and counted, and rows that leave keep it on. The
    biased twin, TAIL_QUIET 0: the tail decides while requests join."""
    batch = [Row(100, length) for length in range(10, 30)]        # 20 rows: a tail of 5
    tail, admitted = BatchTail(), 20
    assert [tail.rows(batch, admitted) for _ in range(TAIL_QUIET)] == [0] * TAIL_QUIET
    assert not tail.members and tail.accepted(batch, [1] * 20) is None  # nor counted
    assert tail.rows(batch, admitted) == 5                          # quiet: it decides
    assert tail.members == frozenset(batch[:5])
    assert tail.accepted(batch, [1] * 20) == [1] * 5                # and is counted
    del batch[7]
    assert tail.rows(batch, admitted) == 5                          # a row left: still
    batch.append(Row(100, 0))                                       # a request joined
    admitted += 1
    assert [tail.rows(batch, admitted) for _ in range(TAIL_QUIET)] == [0] * TAIL_QUIET
    assert tail.accepted(batch, [1] * len(batch)) is None
    assert tail.rows(batch, admitted) == 5
    # A request admitted and gone before the tail's next call is a join all the same (the
    # batch did not drain meanwhile).
    assert tail.rows(batch, admitted + 1) == 0
    admitted += 1
    assert quiet(tail, batch, admitted) == 5
    # Requests that left are not kept alive by the tail (an idle engine's last batch).
    gone = weakref.ref(batch[0])
    del batch[:11]
    assert tail.rows(batch, admitted) == TAIL_MIN_ROWS       # 9 rows: chosen again
    assert gone() is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("specloop.engine._adaptive_tail.TAIL_QUIET", 0)
        batch.append(Row(100, 0))
        assert tail.rows(batch, admitted + 1) > 0


def draining(tail: bool):
    """A batch of 16 rows after 60 iterations at K = 3, as one rank's AdaptiveK (with the
    tail or without) has seen it: rows 0-7 accepted every draft, rows 8-15 none, and the
    tail (the slow rows: most tokens left) has been rows 8-15. T(k) makes K = 3 the best
    for the mean row and K = 0 for a row that accepts nothing."""
    cost = CostTable({(16, k): 1.0 + 0.2 * k for k in KS}, learn=False)
    adaptive = AdaptiveK(KS, cost, tail=tail)
    for _ in range(60):
        adaptive.record(3, [3] * 8 + [0] * 8, None, [0] * 8 if tail else None)
    return adaptive


def test_a_draining_batch_drafts_for_the_rows_it_waits_on():
    """The batch lasts as long as its slow rows: their counts decide K (0), where the
    mean row's pooled counts draft 3. The biased twin, pooled counts alone, drafts 3; both
    on one rank (``next_k``) and through the SYNC row (``choose``)."""
    slow = draining(tail=True)
    assert slow.next_k(16, 3, tail_rows=4) == 0
    assert slow.choose([slow.facts(None, 4)], 16) == 0
    # Without tail rows this iteration (a batch as small as its tail): the pooled counts.
    assert slow.next_k(16, 3) == 3 and draining(tail=True).choose([slow.facts()], 16) == 3
    pooled = draining(tail=False)
    assert pooled.tail is None
    assert pooled.next_k(16, 3) == 3
    assert pooled.choose([pooled.facts()], 16) == 3


def test_the_tails_acceptance_leans_on_the_pooled_one_until_it_has_drafted():
    adaptive = AdaptiveK(KS, CostTable({(1, k): 1.0 for k in KS}, learn=False), tail=True)
    adaptive.record(3, [3, 3, 3, 0], None, [0])
    reached, accepted = adaptive._reached[0], adaptive._accepted[0]
    pooled = acceptance_from_counts(reached, accepted)
    tail = [(a + TAIL_PRIOR_ROWS * p) / (r + TAIL_PRIOR_ROWS)
            for r, a, p in zip([1, 0, 0], [0, 0, 0], pooled)]
    assert adaptive._tail_here() == pytest.approx(expected_by_k(tail, KS))
    assert pooled[0] > tail[0] > 0       # one rejected row moves it only part of the way


def test_group_pools_the_tails_counts():
    """Ranks send their tails' counts and rows; every rank takes E(k) from the tails'
    counts summed over the ranks and the prior from everyone's pooled counts; a rank
    without a tail this iteration adds its pooled counts only."""
    a, b, c = draining(True), draining(True), draining(True)
    b.record(3, [3] * 8, None, [3] * 8)          # b's tail accepts too
    columns = torch.tensor([a.facts(None, 4), b.facts(None, 4), c.facts(None, 0)])
    rows = columns.tolist()
    per, n = 2 * 3, 3
    at = per + 1                                  # after the counts and the class rows
    summed = [sum(row[j] for row in rows) / SCALE for j in range(per)]
    tail = [sum(row[at + j] for row in rows) / SCALE for j in range(per)]
    assert tail[:n] == pytest.approx([sum(x._tail_reached[j] for x in (a, b, c))
                                      for j in range(n)], abs=3 / SCALE)
    expected = tail_expected_from_counts(summed[:n], summed[n:], tail[:n], tail[n:],
                                         a.candidates)
    assert a._expected(rows) == b._expected(rows) == c._expected(rows) == expected
    times = {k: 1.0 + 0.2 * k for k in KS}
    choice = choose_by_rate(KS, expected, times)
    assert a.choose(columns, 16) == b.choose(columns, 16) == c.choose(columns, 16) == choice


def test_one_ranks_early_choice_is_its_sync_rows():
    """next_k's E(k) from the tail, kept between records, equals the one ``choose``
    computes from this rank's SYNC row, bit for bit, as counts change."""
    rng = random.Random(11)
    adaptive = AdaptiveK(KS, CostTable({(1, k): 1.0 for k in KS}), tail=True)
    for _ in range(200):
        k = rng.randint(0, 3)
        accepted = [rng.randint(0, k) for _ in range(rng.randint(1, 8))]
        adaptive.record(k, accepted, None, accepted[:rng.randint(0, len(accepted))])
        assert adaptive._tail_here() == adaptive._expected([adaptive._row(None, 4)])


def ragged(n=14):
    """Greedy and sampled requests of very different lengths, arriving in two waves."""
    out = []
    for i in range(n):
        prompt = [5 + i, 30 + 3 * i, 9, 70 + i, 5 + i]
        tokens = 8 + (37 * i) % 40
        params = SamplingParams(temperature=0.8, seed=7 + i, max_tokens=tokens,
                                ignore_eos=True) if i % 5 == 4 else \
            SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        out.append((prompt, params, 0.05 * (i // 7)))
    return out


@pytest.mark.parametrize("world", [1, 2])
async def test_ranks_agree_on_k_from_their_tails(tiny_dir, tiny_loaded, world, monkeypatch):
    """mtp_eagle under adaptive K with batches of up to 12 rows a rank (tails of 3-4
    rows): tails ride the SYNC row on every rank that has one, every rank runs the same K
    each iteration (LM-head TP: a K apart would enter different collectives), and greedy
    rows equal greedy without speculation. (TAIL_QUIET 0: the tail decides while requests
    join, so the staggered arrivals leave tails in most iterations.)"""
    monkeypatch.setattr("specloop.engine._adaptive_tail.TAIL_QUIET", 0)
    config = make_config(tiny_dir, method="mtp_eagle", k=3, rejection=True,
                         max_batch_size=12, speculative={"adaptive": True},
                         parallel={"world_size": world, "attention_dp": world > 1,
                                   "lm_head_tp_in_adp": world > 1})
    reqs = ragged()
    group = LocalGroup(world, timeout=5.0)

    async def rank_main(comm):
        klog, tails = KLog(), []
        async with AsyncEngine(config, communicator=comm, model=tiny_loaded,
                               observers=[klog]) as engine:
            adaptive = engine.worker.adaptive
            assert adaptive is not None and adaptive.tail is not None
            choose = adaptive.choose

            def logged(columns, batch, **kw):
                rows = columns.tolist() if isinstance(columns, torch.Tensor) else columns
                at = 2 * (2 * adaptive.k_max + 1) - 1     # the tail rows' column
                tails.append([row[at] for row in rows])
                return choose(columns, batch, **kw)
            adaptive.choose = logged
            if comm.rank == 0:
                outs = await serve_staggered(engine, reqs)
            else:
                outs = None
                await engine.wait_closed()
        return outs, klog.ks, tails

    results = await group.run(rank_main)
    check_greedy(tiny_loaded, reqs, results[0][0])
    logs = [dict(ks) for _, ks, _ in results]
    for rank in range(1, world):
        common = logs[0].keys() & logs[rank].keys()
        assert len(common) >= 10 and all(logs[0][i] == logs[rank][i] for i in common)
    tails = results[0][2]
    assert sum(1 for t in tails if any(t)) >= 5, tails
    if world > 1:   # the facts path (one rank commits its K early and sends no row)
        assert any(all(t) for t in tails), tails


async def test_the_rules_view_is_logged_at_info(tiny_dir, tiny_loaded, monkeypatch):
    """Every ADAPTIVE_LOG_EVERY choices the worker logs ``adaptive_k`` at info: the K
    chosen so far, E(k) and T(b, k) as the rule took them, each K's measured time and
    samples at that bucket, the tail's rows. Filtered out (warning), nothing."""
    import logging

    import structlog
    from structlog.testing import capture_logs

    from specloop.engine import _worker

    monkeypatch.setattr(_worker, "ADAPTIVE_LOG_EVERY", 8)
    config = make_config(tiny_dir, method="mtp_eagle", k=3, max_batch_size=12,
                         speculative={"adaptive": True})
    seen, choices, costs = {}, {}, {}
    for level in (logging.INFO, logging.WARNING):
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(level))
        try:
            with capture_logs() as logs:
                async with AsyncEngine(config, model=tiny_loaded) as engine:
                    await serve_staggered(engine, ragged())
                    # Each run's own: staggered arrivals make the count timing's.
                    choices[level] = engine.worker.adaptive.choices
                    costs[level] = engine.worker.adaptive.cost
        finally:
            structlog.configure(
                wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
        seen[level] = [e for e in logs if e["event"] == "adaptive_k"]
    events = seen[logging.INFO]
    assert len(events) == choices[logging.INFO] // 8 and not seen[logging.WARNING]
    last = events[-1]
    assert last["choices"] % 8 == 0 and sum(last["chosen"].values()) == last["choices"]
    # Every K was chosen (the first samples run each in turn), so K switched at least
    # len(KS) - 1 times, and never more often than it was chosen.
    assert len(KS) - 1 <= last["switches"] < last["choices"]
    assert set(last["expected"]) == set(last["times_ms"]) == set(last["samples"]) == set(KS)
    # Warm-up's time for each K at the graph bucket serving this class: what a K not yet
    # measured starts from (the table the engine calibrated, not made up here).
    cost = costs[logging.INFO]
    assert last["warmup_ms"] == {k: round(cost._device(last["bucket"], k) * 1e3, 3)
                                 for k in KS}
    assert all(t > 0 for t in last["warmup_ms"].values())
    assert last["expected"][0] == 1.0 and last["bucket"] in (1, 2, 4, 8, 16)
    assert any(e["tail_rows"] for e in events)
    # E(k) as priced against the tokens a row made, per drafting K: each within what a
    # K can make (1 .. K + 1), and the iterations the engine's own check counted.
    checks = [e["e_check"] for e in events if e["e_check"]]
    assert checks, "no event carried e_check"
    for check in checks:
        assert set(check) <= set(KS) - {0}, check
        for k, (n, priced, made) in check.items():
            assert n > 0 and 1.0 <= priced <= k + 1 and 1.0 <= made <= k + 1, check
    # X(b)'s samples split by disturbance, where the bucket had samples.
    splits = [e["overhead_split_ms"] for e in events if e["overhead_split_ms"]]
    for split in splits:
        assert set(split) == {"undisturbed", "disturbed", "disturbed_share", "prefill"}
        assert 0.0 <= split["disturbed_share"] <= 1.0 and split["prefill"] >= 0.0
    assert cost.overhead_parts or not splits
