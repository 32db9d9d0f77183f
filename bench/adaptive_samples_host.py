"""What adaptive K learns each K's time from, on the CPU without a model's device work:
every ``CostTable.observe`` of the rule running free on one rank's chained path
(bench_chain_host.py ``--adaptive-at -1``, the GPU's part taken away: each iteration is the
host's work), grouped by K, by the kind of sample (``own``: learned as T(b, k); ``switch``:
the first after another K; ``leave``: the last before one), by its place in its run of that
K (1, 2, ... ``--runs-cap`` and beyond) and by whether it was disturbed (it or the next
iteration admitted requests): how many, and their median ms. Then the rule's view at the
end (``AdaptiveK.summary``).

Why: on an H100 at batch 256 under a server's load (fifty-first session) the rule priced
K = 2, which it samples only in short explore runs, 15 % above the K = 3 it ran, where
fixed K = 2 iterated 25 % cheaper. Here, where every K's iteration costs the same host
work (the stand-in graphs accept one draft a row at any K), a K priced above the running
one says which samples make it so.

    python bench/adaptive_samples_host.py [--batch 64] [--iterations 1500] [--closed]
        [--runs-cap 5] [--set EXPLORE_RUN=4]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import tempfile
from typing import Iterator

import anyio
import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_chain_host as chain  # noqa: E402
from adaptive_sim import rule_constants  # noqa: E402


@contextlib.contextmanager
def recorded_samples() -> Iterator[list[tuple[int, int, float, bool, bool, bool]]]:
    """While open, every ``CostTable.observe`` call also appends (bucket, K, seconds,
    disturbed, switched, leaving) to the list yielded; the original method is back after."""
    from specloop.engine import _adaptive  # noqa: PLC0415
    samples: list[tuple[int, int, float, bool, bool, bool]] = []
    original = _adaptive.CostTable.observe

    def observe(self, bucket, k, seconds, disturbed=False, switched=False, leaving=False):
        samples.append((bucket, k, seconds, disturbed, switched, leaving))
        return original(self, bucket, k, seconds, disturbed, switched, leaving)
    _adaptive.CostTable.observe = observe
    try:
        yield samples
    finally:
        _adaptive.CostTable.observe = original


def group(samples, bucket: int, cap: int) -> dict[tuple[int, str, int, bool], list[float]]:
    """{(K, kind, place in its run (at most ``cap``), disturbed): [ms, ...]} at ``bucket``;
    a run is consecutive samples of one K (samples of other buckets end none)."""
    out: dict[tuple[int, str, int, bool], list[float]] = collections.defaultdict(list)
    last_k, place = None, 0
    for b, k, seconds, disturbed, switched, leaving in samples:
        if b != bucket:
            continue
        place = place + 1 if k == last_k else 1
        last_k = k
        kind = "switch" if switched else "leave" if leaving else "own"
        out[(k, kind, min(place, cap), disturbed)].append(seconds * 1e3)
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iterations", type=int, default=1500)
    ap.add_argument("--closed", action="store_true",
                    help="endless requests instead of a server's load (nothing disturbed)")
    ap.add_argument("--runs-cap", type=int, default=5)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="one of engine/_adaptive.py's constants for the run, e.g. "
                         "--set EXPLORE_RUN=4 (adaptive_sim.rule_constants)")
    args = ap.parse_args()
    chain.quiet_logs()
    torch.set_num_threads(1)
    from specloop.models import load_model  # noqa: PLC0415
    from specloop.models.testing import write_tiny_checkpoint  # noqa: PLC0415
    with rule_constants(args.set), recorded_samples() as samples, \
            tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_checkpoint(tmp, vocab_size=384, num_layers=2, hidden=64, seed=1)
        loaded = load_model(path, dtype=torch.float32)
        cfg = chain.config(path, "eagle3", 3, args.batch, True, None)
        # measure prints the rule's view at its end (--adaptive-at -1)
        anyio.run(chain.measure, cfg, loaded, args.batch, args.iterations, None, -1,
                  not args.closed)
    bucket = max(b for b, *_ in samples)
    for (k, kind, place, disturbed), ms in sorted(group(samples, bucket,
                                                         args.runs_cap).items()):
        print(f"  K {k} {kind:6s} place {place}{'+' if place == args.runs_cap else ' '} "
              f"{'disturbed' if disturbed else 'quiet    '} n {len(ms):5d} "
              f"median {statistics.median(ms):.3f} ms")


if __name__ == "__main__":
    main()
