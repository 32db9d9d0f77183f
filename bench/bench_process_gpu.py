"""The engine core in its own process (``ProcessEngine``) against the engine in this one
(``AsyncEngine``): tokens/s of each speculative config at each batch, all engines of a
batch open at once and taking turns run by run (drift hits all alike), with the host's
speed before each run (``host_python_us``).

Why: from batch ~2 a speculative iteration is host-bound on the H200, and from ~32 plain
decoding is too; about half the host's work an iteration is the front door's (each
request's consumer woken, detokenizing), which ``ProcessEngine`` moves to this process
(docs/performance-history.md, "The engine core in its own process").

    python bench/bench_process_gpu.py --out rows.jsonl [--configs "none,eagle3 K=3"]
        [--batches 1,32,64,128] [--runs 3] [--tokens 128] [--min-prompts 32]
        [--kinds process,in-process] [--consumer stream|batch] [--device cpu]

Each row: one (batch, config, kind); ``vs_none`` its median over the same kind's first
config's median, ``vs_in_process`` over the in-process engine of the same config (runs
paired by order), ``al`` from the engine's (the core's) stats.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import anyio

from _common import (add_round_args, device_sync, emit_row, engine_config, generate_round,
                     held_out_sets, host_python_us, quiet_logs, speed_row)
from profile_spec_gpu import CONFIGS


async def measure(names, kinds, loaded, sets, tokens, runs, device, consumer):
    """-> {(name, kind): (rates, AL)}; every engine built and warmed first."""
    from specloop.engine import AsyncEngine, ProcessEngine  # noqa: PLC0415

    batch, sync = len(sets[0]), device_sync(device)
    out = {}
    async with contextlib.AsyncExitStack() as stack:
        engines = {}
        for name in names:
            config = engine_config(CONFIGS[name], batch, device)
            for kind in kinds:
                engine = AsyncEngine(config, model=loaded) if kind == "in-process" \
                    else ProcessEngine(config)
                engines[name, kind] = await stack.enter_async_context(engine)
        for engine in engines.values():
            await generate_round(engine, sets[0], 8, consumer)
        before = {key: await _stats(engine) for key, engine in engines.items()}
        walls = {key: [] for key in engines}
        speeds = {key: [] for key in engines}
        for _ in range(runs):
            for key, engine in engines.items():
                speeds[key].append(host_python_us())
                sync()
                start = time.perf_counter()
                for prompts in sets:
                    await generate_round(engine, prompts, tokens, consumer)
                sync()
                walls[key].append(time.perf_counter() - start)
        for key, engine in engines.items():
            stats, first = await _stats(engine), before[key]
            drafting = stats.num_drafting_rows - first.num_drafting_rows
            al = 1 + (stats.num_accepted_tokens - first.num_accepted_tokens) / drafting \
                if drafting else None
            iterations = stats.num_iterations - first.num_iterations
            out[key] = ([batch * len(sets) * tokens / w for w in walls[key]], al,
                        {"host_python_us": speeds[key],
                         "iteration_ms": round(sum(walls[key]) * 1e3 / max(iterations, 1), 3)})
    return out


async def _stats(engine):
    """A copy of the engine's counters (the core's, across the pipe)."""
    import copy  # noqa: PLC0415
    fetch = getattr(engine, "fetch_stats", None)
    return await fetch() if fetch is not None else copy.deepcopy(engine.stats)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_round_args(ap, batches="1,32,64,128")
    ap.add_argument("--configs", default="none,eagle3 K=3")
    ap.add_argument("--kinds", default="process,in-process")
    ap.add_argument("--consumer", choices=("stream", "batch"), default="stream")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    ap.add_argument("--min-prompts", type=int, default=32)
    args = ap.parse_args()
    quiet_logs()
    names, kinds = args.configs.split(","), args.kinds.split(",")
    for loaded, batch, sets in held_out_sets(args, min_prompts=args.min_prompts):
        got = anyio.run(measure, names, kinds, loaded, sets, args.tokens, args.runs,
                        args.device, args.consumer)
        for kind in kinds:
            base = statistics.median(got[names[0], kind][0])
            for name in names:
                rates, al, extra = got[name, kind]
                paired = None
                if kind != "in-process" and (name, "in-process") in got:
                    paired = [round(a / b, 3) for a, b in zip(rates, got[name, "in-process"][0])]
                emit_row(speed_row(batch, name, rates, base, al, args.tokens, args.device,
                                   kind=kind, consumer=args.consumer,
                                   prompts_per_run=batch * len(sets),
                                   vs_in_process=paired, **extra), args.out)


if __name__ == "__main__":
    main()
