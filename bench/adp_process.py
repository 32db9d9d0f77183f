"""ADP served from one process: ``ProcessEngine`` with 1 and then N ranks (N core processes
it spawns as a torch.distributed group, no torchrun), the same workload, in one run; prints
tokens/s per round, N ranks ÷ 1 rank (medians over the rounds after the first), and
whether every request's tokens were the same. The consumers (a ``generate`` task per
request, or one ``generate_batch``) run here, in this process, for every rank: no rank's
event loop runs them (bench/adp_run.py's torchrun engines run them on rank 0's).

    python bench/adp_process.py --model smollm2-135m-instruct --dtype bfloat16 --graphs \\
        --balanced-tokens 256 --requests 128 --batch 64 --worlds 1,2 --rounds 3

Without --model the weights are random in SmolLM2's shape (--tiny: a tiny model).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import anyio

sys.path.insert(0, os.path.dirname(__file__))
from _common import quiet_logs  # noqa: E402
from adp_run import SMOLLM2_SHAPE, engine_config, serve, workload  # noqa: E402


async def run_world(args, model, world):
    """{consumer: [tok/s per round]}, and the first consumer's outputs of the last round."""
    from specloop.engine import ProcessEngine
    rates, outs = {}, None
    async with ProcessEngine(engine_config(args, model, world)) as engine:
        for consumer in args.consumer.split(","):
            rates[consumer] = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                got = await serve(engine, workload(args.requests,
                                                   balanced_tokens=args.balanced_tokens),
                                  consumer)
                rates[consumer].append(sum(len(o) for o in got) / (time.perf_counter() - start))
                if outs is None or consumer == args.consumer.split(",")[0]:
                    outs = got
            print(f"world {world}, {consumer}: tok/s per round "
                  + ", ".join(f"{r:.0f}" for r in rates[consumer]), flush=True)
    return rates, outs


def steady(rates):
    """The median of the rounds after the first (warm-up), or of the one round."""
    return statistics.median(rates[1:] or rates)


async def main_async(args, model):
    worlds = [int(w) for w in args.worlds.split(",")]
    results = {w: await run_world(args, model, w) for w in worlds}
    base_rates, base_outs = results[worlds[0]]
    summary = {"worlds": worlds, "tok_s": {w: r for w, (r, _) in results.items()}}
    for world in worlds[1:]:
        rates, outs = results[world]
        same = sum(a == b for a, b in zip(outs, base_outs))
        print(f"world {world} ÷ world {worlds[0]}: "
              + ", ".join(f"{c} {steady(rates[c]) / steady(base_rates[c]):.2f}x"
                          for c in rates)
              + f"; outputs identical {same}/{len(outs)}", flush=True)
        summary[f"identical_{world}"] = same
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (tests)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--method", default="none")
    ap.add_argument("--draft-weights", help="a shipped head (e.g. smollm2-135m-instruct-eagle3)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--rejection", action="store_true")
    ap.add_argument("--lm-head-tp", action="store_true",
                    help="the drafter's LM head split over the ranks (parallel.lm_head_tp_in_adp)")
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--batch", type=int, default=16, help="max_batch_size per rank")
    ap.add_argument("--buckets", default="1,2,4,8,16,32", help="CUDA-graph batch buckets")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--balanced-tokens", type=int, default=0,
                    help="N equal greedy requests of this many new tokens, all at once")
    ap.add_argument("--worlds", default="1,2", help="ranks per run, the first the baseline")
    ap.add_argument("--rounds", type=int, default=2, help="serve the workload N times")
    ap.add_argument("--consumer", default="stream,batch",
                    help="stream: a generate task per request; batch: one generate_batch")
    ap.add_argument("--out", help="JSON summary")
    args = ap.parse_args()
    quiet_logs()
    model = args.model
    if model is None:
        from specloop.models.testing import write_tiny_checkpoint
        shape = dict(vocab_size=384, num_layers=2) if args.tiny else SMOLLM2_SHAPE
        model = write_tiny_checkpoint(tempfile.mkdtemp(prefix="ckpt-"), **shape, seed=0)
    anyio.run(main_async, args, model)


if __name__ == "__main__":
    main()
