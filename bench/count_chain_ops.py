"""Torch ops an iteration runs outside the captured graphs, fixed K against adaptive K held
at the same K, on the CPU (no model: bench_chain_host's frozen replays, a tiny random
target and eagle3 head, the chain forced on, as on one GPU rank).

On the H200 at batch 1 adaptive K <= 3 ran ~5 % faster than fixed K = 3 at the same AL
while drafting K = 3 in 221 of 235 iterations (docs/performance-history.md, "Adaptive K in
closed rounds"): if the two paths launched different device work per iteration (copies
into the graphs' inputs, glue ops), it would show here as a different op count.

    python bench/count_chain_ops.py [--batches 1,8] [--iterations 200] [--k 3]
        [--mix 3,3,3,3,2,2,2,2]

``--mix``: adaptive K drafting that cycle of K (its rule answers it, choice by choice)
against fixed K at each K of the cycle, weighted as the cycle weighs them: what the
switches add (copies into the draft graph's inputs when K rises, glue) shows as ops an
iteration above the mix's.

Per batch: iterations, chained steps taken, event-loop thread CPU per iteration, adaptive
K's choices, aten ops per iteration; then every op whose count differs by > 0.05 an
iteration between the two.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

import anyio
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(__file__))
from _common import quiet_logs  # noqa: E402
from bench_chain_host import config, force_chain, start_endless, until  # noqa: E402


class OpCount(TorchDispatchMode):
    """Counts aten ops while ``on``."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.on = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


async def run(cfg, loaded, batch, iterations, mode):
    from specloop.engine import AsyncEngine  # noqa: PLC0415
    async with AsyncEngine(cfg, model=loaded) as engine:
        worker = engine.worker
        # Adaptive K's one-rank path (its next K queued early, as on one GPU rank).
        force_chain(worker, adaptive_at=-1 if worker.adaptive is not None else None)
        async with anyio.create_task_group() as tg:
            start_endless(tg, engine, batch)
            await until(engine, 40)
            first, taken = engine.stats.num_iterations, worker.chain.taken_steps
            mode.counts.clear()
            mode.on, start = True, time.thread_time()
            await until(engine, first + iterations)
            mode.on, cpu = False, time.thread_time() - start
            done = engine.stats.num_iterations - first
            chosen = dict(worker.adaptive.chosen) if worker.adaptive is not None else None
            tg.cancel_scope.cancel()
    return done, worker.chain.taken_steps - taken, cpu / done * 1e6, chosen


def main() -> None:
    import attrs  # noqa: PLC0415

    import specloop.engine._adaptive as adaptive  # noqa: PLC0415
    from specloop.models import load_model  # noqa: PLC0415
    from specloop.models.testing import write_tiny_checkpoint  # noqa: PLC0415
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--mix", default="", help="a cycle of K for adaptive K to draft")
    args = ap.parse_args()
    quiet_logs()
    torch.set_num_threads(1)
    cycle = [int(k) for k in args.mix.split(",")] if args.mix else [args.k]
    # Adaptive K held to the cycle: its rule answers it (the path, not the choice, is
    # compared); a fixed engine runs each K of it.
    adaptive.AdaptiveK._rule = lambda self, rows, bucket, calls: cycle[calls % len(cycle)]
    ks = sorted(set(cycle))
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_checkpoint(tmp, vocab_size=384, num_layers=2, hidden=64, seed=1)
        loaded = load_model(path, dtype=torch.float32)
        for batch in map(int, args.batches.split(",")):
            per = {}
            runs = [(f"fixed {k}", k, False) for k in ks] + [("adaptive", max(ks), True)]
            for name, k, on in runs:
                cfg = config(path, "eagle3", k, batch)
                cfg = attrs.evolve(cfg, speculative=attrs.evolve(cfg.speculative, adaptive=on))
                mode = OpCount()
                with mode:
                    done, taken, us, chosen = anyio.run(run, cfg, loaded, batch,
                                                        args.iterations, mode)
                per[name] = {op: n / done for op, n in mode.counts.items()}
                print(f"batch {batch} {name}: {done} iterations, {taken} chained steps taken, "
                      f"thread CPU {us:.0f} us an iteration, K chosen {chosen}, "
                      f"{sum(per[name].values()):.1f} aten ops an iteration", flush=True)
            # The fixed engines' ops weighted as the cycle weighs each K.
            fixed = collections.Counter()
            for k in cycle:
                for op, n in per[f"fixed {k}"].items():
                    fixed[op] += n / len(cycle)
            print(f"batch {batch} the fixed mix: {sum(fixed.values()):.1f} aten ops an iteration")
            for op in sorted(set(fixed) | set(per["adaptive"])):
                a, b = fixed.get(op, 0.0), per["adaptive"].get(op, 0.0)
                if abs(a - b) > 0.05:
                    print(f"  {op:48s} fixed {a:6.2f}  adaptive {b:6.2f}")


if __name__ == "__main__":
    main()
