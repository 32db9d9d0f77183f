"""H200, real SmolLM2 (bf16, CUDA graphs): tokens/s with speculation / without, batch 1 and
32, greedy, held-out chat prompts (Debian fortunes split of a prompts.jsonl), EOS ignored.
Each config builds one engine, warms up, then runs ``--runs`` timed rounds; prints min-max
tokens/s, the ratio of medians to no speculation, and AL; appends rows to --out (JSON lines).

    python bench/bench_heads_gpu.py --prompts prompts.jsonl --out rows.jsonl
"""

from __future__ import annotations

import argparse
import statistics

import anyio

from _common import (add_round_args, device_sync, emit_row, engine_config, generate_round,
                     held_out_batches, quiet_logs, speed_row, timed_round)

CONFIGS = {"none": {"method": "none"},
           "ngram K=4": {"method": "ngram", "num_draft_tokens": 4},
           "eagle3 K=2": {"method": "eagle3", "num_draft_tokens": 2,
                          "draft_weights": "smollm2-135m-instruct-eagle3"},
           "eagle3 K=3": {"method": "eagle3", "num_draft_tokens": 3,
                          "draft_weights": "smollm2-135m-instruct-eagle3"}}


async def measure(spec, loaded, prompts, tokens, runs, device):
    from specloop.engine import AsyncEngine
    batch, sync = len(prompts), device_sync(device)
    async with AsyncEngine(engine_config(spec, batch, device), model=loaded) as engine:
        await generate_round(engine, prompts, 8)
        rates = [batch * tokens / await timed_round(engine, prompts, tokens, sync)
                 for _ in range(runs)]
        al = engine.stats.mean_acceptance_length
    return rates, al


def main() -> None:
    ap = argparse.ArgumentParser()
    add_round_args(ap)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    args = ap.parse_args()
    quiet_logs()
    for loaded, batch, prompts in held_out_batches(args):
        base = None
        for name, spec in CONFIGS.items():
            rates, al = anyio.run(measure, spec, loaded, prompts, args.tokens, args.runs,
                                  args.device)
            base = base or statistics.median(rates)
            emit_row(speed_row(batch, name, rates, base, al, args.tokens, args.device),
                     args.out)


if __name__ == "__main__":
    main()
