"""Host time of adaptive K's per-iteration calls at batch 1 (one GPU rank's path), on the
CPU: ``next_k`` + ``commit``, ``measured``, ``choose_committed``, ``record``, for a rule
with n-gram's 4 draft classes and K = 0 .. 4, each row's class drawn at random. Two
tables: fixed at warm-up's times (nothing learned) and learning. µs an iteration, 3 runs
each of ``--iterations``.

    python bench/bench_adaptive_host.py [--iterations 20000]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=20000)
    ap.add_argument("--module", default="", help="another engine/_adaptive.py to time")
    args = ap.parse_args()
    module = load(args.module)
    for learn in (False, True):
        adaptive = make(module, learn)
        loop(adaptive, 2000)        # warm
        runs = [round(loop(adaptive, args.iterations), 1) for _ in range(3)]
        print(f"{'learning' if learn else 'warm-up times'}: {runs} us an iteration "
              f"(K chosen: {dict(sorted(adaptive.chosen.items()))})")


if __name__ == "__main__":
    main()
