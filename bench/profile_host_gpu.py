"""Where a batch-N iteration's wall time goes on one GPU, with real SmolLM2 weights (issue 12):
each state's median time per iteration, the first iteration (the prefill of the whole
batch) apart, the run's wall time and, under cProfile, the engine's Python functions by
own time. No speculation, greedy, chat prompts, one ``generate_batch`` per round.

    python bench/profile_host_gpu.py --batches 64 [--tokens 256] [--runs 3] [--cprofile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import anyio
import torch

from _common import generate_round, quiet_logs
from bench_gpu_e2e import chat_prompts, engine_config


class _PerIteration:
    """Each state's time in each iteration with requests (µs), in order."""

    def __init__(self):
        self.on, self.rows, self._cur = False, [], {}

    def on_transition(self, event):
        if not (self.on and event.batch_size):
            return
        self._cur[event.state.value] = event.duration_us
        if event.state.value == "RESCAN":
            self.rows.append(self._cur)
            self._cur = {}


async def one_batch(name, loaded, batch, tokens, runs, method, use_cprofile):
    from specloop.engine import AsyncEngine
    prompts = chat_prompts(loaded.tokenizer, batch)
    per = _PerIteration()
    out = {"batch": batch, "method": method, "runs": []}
    async with AsyncEngine(engine_config(name, batch, method), model=loaded,
                           observers=[per]) as engine:
        await generate_round(engine, prompts, 8)
        for consumer in ("batch", "stream"):
            for _ in range(runs):
                torch.cuda.synchronize()
                it0 = engine.stats.num_iterations
                per.rows, per.on = [], True
                start = time.perf_counter()
                await generate_round(engine, prompts, tokens, consumer)
                torch.cuda.synchronize()
                wall = time.perf_counter() - start
                per.on = False
                iters = engine.stats.num_iterations - it0
                first = per.rows[0] if per.rows else {}
                rest = per.rows[1:]
                med = {k: round(statistics.median(r.get(k, 0.0) for r in rest), 1)
                       for k in (rest[0] if rest else {})}
                out["runs"].append({
                    "consumer": consumer, "tok_s": round(batch * tokens / wall),
                    "ms_iter": round(wall / iters * 1e3, 3), "iterations": iters,
                    "first_iteration_us": first,
                    "median_state_us": med,
                    "median_iteration_us": round(statistics.median(sum(r.values())
                                                                   for r in rest), 1)})
                print(json.dumps(out["runs"][-1]), flush=True)
        if use_cprofile:
            prof = cProfile.Profile()
            prof.enable()
            await generate_round(engine, prompts, tokens, "batch")
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
            out["cprofile"] = s.getvalue()
            print(s.getvalue()[:6000], flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batches", default="64")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--method", default="none")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    quiet_logs()
    from specloop.models import load_model, resolve_model_path
    loaded = load_model(resolve_model_path(args.model), dtype=torch.bfloat16, device="cuda")
    results = []
    for batch in [int(b) for b in args.batches.split(",")]:
        results.append(anyio.run(one_batch, args.model, loaded, batch, args.tokens,
                                 args.runs, args.method, args.cprofile))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
