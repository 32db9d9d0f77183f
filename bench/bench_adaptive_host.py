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


def loop_tail(adaptive, n: int, batch_size: int) -> float:
    """µs an iteration in the one-rank path's calls for a head over ``batch_size`` rows
    (only theirs: the loop's own row bookkeeping is not timed)."""
    rng = random.Random(1)
    batch = [_Row(rng) for _ in range(batch_size)]
    tail, k, clock, spent = adaptive.tail, 0, time.perf_counter, 0.0
    for _ in range(n):
        start = clock()
        adaptive.commit(adaptive.next_k(batch_size, k, tail_rows=tail.rows(batch)))
        adaptive.measured(0.0015 + rng.random() * 1e-5)
        k = adaptive.choose_committed(batch_size)
        spent += clock() - start
        accepted = [rng.randrange(k + 1) if k else 0 for _ in batch]
        start = clock()
        adaptive.record(k, accepted, None, tail.accepted(batch, accepted))
        spent += clock() - start
        for row, m in zip(batch, accepted):
            row.token_ids += [0] * (m + 1)
        if rng.random() < 0.5:      # one ends, another joins
            batch[rng.randrange(batch_size)] = _Row(rng)
    return spent / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=20000)
    ap.add_argument("--module", default="", help="another engine/_adaptive.py to time")
    ap.add_argument("--tail-batch", type=int, default=0,
                    help="a head's rule with the batch's tail over this many rows")
    args = ap.parse_args()
    module = load(args.module)
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
