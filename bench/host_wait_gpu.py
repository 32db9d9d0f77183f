"""Host-bound or GPU-bound: per iteration, the wall time and how long the host waited for
the GPU in ``finish_read_back`` (the GPU's slack over the host; ~0 means the host is the
bottleneck), for each of ``--configs`` (default: no speculation, n-gram K = 4 and n-gram
under adaptive K) at ``--batch`` rows, each engine alone in turn (built, run, closed), on
the held-out chat prompts; optionally then the same under cProfile with each run's top
functions by own time (and the engine's functions by cumulative time).

    cd bench && python host_wait_gpu.py [--sets 16] [--tokens 128] [--profile]
        [--batch 8 --configs "eagle3 K=3,eagle3 adaptive<=3"]
        [--device cpu]     (cpu: a smoke test of this script)

The seventh session's figures (docs/performance-history.md, "n-gram by match length,
measured").
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
import types

import anyio

from _common import HELD_OUT, engine_config, generate_round, held_out_sets, quiet_logs

from profile_spec_gpu import CONFIGS as SPEC_CONFIGS

# profile_spec_gpu's configurations that are engine configs alone (its "warm-up times" and
# "unchained" variants change the engine after it is built).
CONFIGS = {name: spec for name, spec in SPEC_CONFIGS.items()
           if not {"fixed_times", "unchained"} & set(spec)}
DEFAULT_CONFIGS = "none,ngram K=4,ngram adaptive<=4"


async def run(loaded, sets, spec, device, tokens, profile):
    from specloop.engine import AsyncEngine  # noqa: PLC0415
    batch = len(sets[0])
    async with AsyncEngine(engine_config(spec, batch, device), model=loaded) as engine:
        runner = engine.worker.runner
        finish, waits = runner.finish_read_back, []

        def timed(pending):
            start = time.perf_counter()
            out = finish(pending)
            waits.append(time.perf_counter() - start)
            return out
        runner.finish_read_back = timed
        await generate_round(engine, sets[0], 8)
        waits.clear()
        prof = cProfile.Profile() if profile else None
        start = time.perf_counter()
        if prof:
            prof.enable()
        for prompts in sets:
            await generate_round(engine, prompts, tokens)
        if prof:
            prof.disable()
        wall, n = time.perf_counter() - start, max(len(waits), 1)
        top = None
        if prof:
            text = io.StringIO()
            stats = pstats.Stats(prof, stream=text)
            stats.sort_stats("tottime").print_stats(25)
            # Which engine steps the own times add up in (specloop's functions only).
            stats.sort_stats("cumulative").print_stats("specloop", 40)
            top = text.getvalue()
    return {"wall_ms_per_iteration": round(wall * 1e3 / n, 3),
            "wait_ms_per_iteration": round(sum(waits) * 1e3 / n, 3), "iterations": n,
            "profile": top}


async def main_async(args) -> None:
    quiet_logs()
    ns = types.SimpleNamespace(device=args.device, prompts=args.prompts,
                               batches=str(args.batch))
    loaded, _, sets = next(held_out_sets(ns, min_prompts=args.sets))
    sets = sets[:args.sets]
    rows = []
    for profile in (False, True) if args.profile else (False,):
        for name in args.configs.split(","):
            row = {"config": name, "batch": args.batch, "profiled": profile,
                   **await run(loaded, sets, CONFIGS[name], args.device, args.tokens,
                               profile)}
            print(json.dumps({k: v for k, v in row.items() if k != "profile"}))
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default=HELD_OUT)
    ap.add_argument("--sets", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help=f"comma-separated, of: {', '.join(CONFIGS)}")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default="")
    anyio.run(main_async, ap.parse_args())


if __name__ == "__main__":
    main()
