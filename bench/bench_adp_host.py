"""Host CPU per iteration of each rank of an ADP group, with the trivial stand-in model
(``bench_host_overhead``): what rank 0 — the front door, which runs every rank's
consumers — spends beyond the other ranks. Under torchrun (gloo on the CPU):

    torchrun --standalone --nproc-per-node 2 bench/bench_adp_host.py [--consumer batch]
        [--shared-memory] [--profile prof0.txt]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time

import anyio
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import generate_round, quiet_logs  # noqa: E402
from bench_host_overhead import StateTimes, stand_in  # noqa: E402


async def run(args, loaded, world):
    from specloop.engine import AsyncEngine, EngineConfig
    config = EngineConfig.from_dict({
        "model": {"name": str(loaded.path), "max_seq_len": 4096, "chat_template": False},
        "scheduler": {"max_batch_size": args.batch},
        "speculative": {"method": "none"},
        "parallel": {"world_size": world, "attention_dp": world > 1},
        "components": {"communicator": "torch_distributed" if world > 1 else "single"}})
    times = StateTimes()
    engine = AsyncEngine(config, model=loaded, observers=[times])
    if args.shared_memory and hasattr(engine.comm, "shared_memory"):
        engine.comm.shared_memory = True
    profiler = cProfile.Profile() if args.profile else None
    async with engine:
        rank = engine.comm.rank
        start_it = engine.stats.num_iterations
        cpu, wall = time.process_time(), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        if rank == 0:
            prompts = [[1, 2, 3, (i % 50) + 4] for i in range(args.requests)]
            await generate_round(engine, prompts, args.tokens, args.consumer)
        else:
            await engine.wait_closed()
        if profiler is not None:
            profiler.disable()
        done = engine.stats.num_iterations - start_it
        cpu_us = (time.process_time() - cpu) / done * 1e6
        wall_us = (time.perf_counter() - wall) / done * 1e6
        states = {k: v / done for k, v in times.total_us.items()}
    split = ", ".join(f"{s} {v:.0f}" for s, v in states.items())
    ex = engine.worker.exchange.times
    print(f"[rank {rank}/{world}] {done} iterations, {args.consumer}: process CPU "
          f"{cpu_us:.0f} us/iteration, wall {wall_us:.0f}; states: {split}; "
          f"exchange skew {ex.skew_us_total / max(ex.count, 1):.0f} us mean, collective "
          f"{ex.collective_us_total / max(ex.count, 1):.0f} us mean", flush=True)
    if profiler is not None and rank == 0:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(40)
        with open(args.profile, "w") as f:
            f.write(out.getvalue())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--consumer", default="batch", choices=("batch", "stream"))
    ap.add_argument("--shared-memory", action="store_true")
    ap.add_argument("--profile", help="rank 0's cProfile (tottime) to this file")
    args = ap.parse_args()
    quiet_logs()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    with tempfile.TemporaryDirectory() as tmp:
        anyio.run(run, args, stand_in(tmp), world)


if __name__ == "__main__":
    main()
