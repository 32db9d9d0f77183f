"""Host time of adaptive K's per-iteration calls at batch 1 (one GPU rank's path), on the
CPU: ``next_k`` + ``commit``, ``measured``, ``choose_committed``, ``record``, for a rule
with n-gram's 4 draft classes and K = 0 .. 4, each row's class drawn at random. Two
tables: fixed at warm-up's times (nothing learned) and learning. ``--tail-batch N``: a
head's rule instead (no classes, K = 0 .. 3, the batch's tail: ``tail.rows`` before the
choice, ``tail.accepted`` into ``record``) over N rows under a server's load (a row ends
and another joins about every other iteration). µs an iteration, 3 runs
each of ``--iterations``.

    python bench/bench_adaptive_host.py [--iterations 20000] [--tail-batch 64]
        [--module /tmp/old_adaptive.py]   (another version of engine/_adaptive.py, e.g.
                                           ``git show <commit>:engine/_adaptive.py``)
        [--against /tmp/old_adaptive.py]  (with --tail-batch: this tree's module and that
                                           one taking turns, --runs each, µs per call)
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import time


def load(path: str):
    if not path:
        from specloop.engine import _adaptive  # noqa: PLC0415
        return _adaptive
    spec = importlib.util.spec_from_file_location("specloop.engine._adaptive_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make(module, learn: bool):
    candidates = [0, 1, 2, 3, 4]
    cost = module.CostTable({(1, k): 0.0004 + 0.00005 * k for k in candidates}, learn=learn)
    adaptive = module.AdaptiveK(candidates, cost, classes=4, burn_in=0)
    rng = random.Random(0)
    for _ in range(300):       # some acceptance counts in every class
        k = rng.choice(candidates[1:])
        adaptive.record(k, [rng.randrange(k + 1)], [rng.randrange(4)])
    return adaptive


def loop(adaptive, n: int) -> float:
    """µs an iteration of the one-rank path's calls."""
    rng = random.Random(1)
    k = 0
    start = time.perf_counter()
    for _ in range(n):
        c = rng.randrange(4)
        adaptive.commit(adaptive.next_k(1, k, classes=[c]))
        adaptive.measured(0.00045 + rng.random() * 1e-5)
        k = adaptive.choose_committed(1)
        adaptive.record(k, [rng.randrange(k + 1) if k else 0], [c])
    return (time.perf_counter() - start) / n * 1e6


class _Row:
    """What the tail reads of a request: its limit and its tokens so far."""

    def __init__(self, rng: random.Random) -> None:
        self.stop_length = rng.randrange(64, 256)
        self.token_ids = [0] * rng.randrange(1, 32)


def make_tail(module, learn: bool):
    candidates = [0, 1, 2, 3]
    cost = module.CostTable({(64, k): 0.0015 + 0.0001 * k for k in candidates}, learn=learn)
    adaptive = module.AdaptiveK(candidates, cost, burn_in=0, tail=True)
    rng = random.Random(0)
    for _ in range(300):
        k = rng.choice(candidates[1:])
        adaptive.record(k, [rng.randrange(k + 1) for _ in range(8)], None,
                        [rng.randrange(k + 1) for _ in range(2)])
    return adaptive


CALLS = ("tail.rows", "next_k", "measured", "choose_committed", "tail.accepted", "record")


def loop_tail(adaptive, n: int, batch_size: int, calls: dict | None = None) -> float:
    """µs an iteration in the one-rank path's calls for a head over ``batch_size`` rows
    (only theirs: the loop's own row bookkeeping is not timed); ``calls``: each call's
    (CALLS) µs an iteration added to it."""
    rng = random.Random(1)
    batch = [_Row(rng) for _ in range(batch_size)]
    tail, k, clock, spent = adaptive.tail, 0, time.perf_counter, 0.0
    split = [0.0] * len(CALLS)
    for _ in range(n):
        t0 = clock()
        tail_rows = tail.rows(batch)
        t1 = clock()
        adaptive.commit(adaptive.next_k(batch_size, k, tail_rows=tail_rows))
        t2 = clock()
        adaptive.measured(0.0015 + rng.random() * 1e-5)
        t3 = clock()
        k = adaptive.choose_committed(batch_size)
        t4 = clock()
        accepted = [rng.randrange(k + 1) if k else 0 for _ in batch]
        t5 = clock()
        tail_accepted = tail.accepted(batch, accepted)
        t6 = clock()
        adaptive.record(k, accepted, None, tail_accepted)
        t7 = clock()
        for i, took in enumerate((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t6 - t5, t7 - t6)):
            split[i] += took
        spent += t4 - t0 + t7 - t5
        for row, m in zip(batch, accepted):
            row.token_ids += [0] * (m + 1)
        if rng.random() < 0.5:      # one ends, another joins
            batch[rng.randrange(batch_size)] = _Row(rng)
    if calls is not None:
        for name, took in zip(CALLS, split):
            calls[name] = calls.get(name, 0.0) + took / n * 1e6
    return spent / n * 1e6


def against(modules: dict, batch_size: int, iterations: int, runs: int) -> dict:
    """Each module's learning head rule over ``batch_size`` rows, the modules taking turns
    ``runs`` times (a fresh rule each run, 500 iterations to warm): -> {name: {"total":
    sorted µs an iteration, call: sorted µs}} (a shared box's drift hits all alike)."""
    found: dict = {name: {} for name in modules}
    for _ in range(runs):
        for name, module in modules.items():
            adaptive = make_tail(module, True)
            loop_tail(adaptive, 500, batch_size)
            calls: dict = {}
            total = loop_tail(adaptive, iterations, batch_size, calls)
            for key, value in (("total", total), *calls.items()):
                found[name].setdefault(key, []).append(round(value, 1))
    return {name: {key: sorted(v) for key, v in per.items()} for name, per in found.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=20000)
    ap.add_argument("--module", default="", help="another engine/_adaptive.py to time")
    ap.add_argument("--tail-batch", type=int, default=0,
                    help="a head's rule with the batch's tail over this many rows")
    ap.add_argument("--against", default="",
                    help="with --tail-batch: another engine/_adaptive.py taking turns with "
                         "this tree's, µs per call")
    ap.add_argument("--runs", type=int, default=4, help="--against: runs of each")
    args = ap.parse_args(argv)
    module = load(args.module)
    if args.against:
        if not args.tail_batch:
            ap.error("--against times the head's rule: give --tail-batch")
        found = against({"this": module, "other": load(args.against)}, args.tail_batch,
                        args.iterations // 4, args.runs)
        for name, per in found.items():
            print(f"tail, batch {args.tail_batch}, {name}: " +
                  "; ".join(f"{key} {values}" for key, values in per.items()))
        return
    if args.tail_batch:
        for learn in (False, True):
            adaptive = make_tail(module, learn)
            loop_tail(adaptive, 500, args.tail_batch)
            runs = [round(loop_tail(adaptive, args.iterations // 4, args.tail_batch), 1)
                    for _ in range(3)]
            print(f"tail, batch {args.tail_batch}, "
                  f"{'learning' if learn else 'warm-up times'}: {runs} us an iteration "
                  f"(K chosen: {dict(sorted(adaptive.chosen.items()))})")
        return
    for learn in (False, True):
        adaptive = make(module, learn)
        loop(adaptive, 2000)        # warm
        runs = [round(loop(adaptive, args.iterations), 1) for _ in range(3)]
        print(f"{'learning' if learn else 'warm-up times'}: {runs} us an iteration "
              f"(K chosen: {dict(sorted(adaptive.chosen.items()))})")


if __name__ == "__main__":
    main()
