"""Where the host waits for the GPU outside the one read-back an iteration: every
synchronizing CUDA call (``torch.cuda.set_sync_debug_mode("warn")``: ``.item()``,
``.tolist()``, a copy to pageable memory, ``nonzero`` ...) in rounds at ``--batch`` (1),
counted by the engine line that made it, per config. The engine's own read-back (pinned
memory and a CUDA event) is not such a call, so a healthy iteration shows none; a line that
shows up once per switch of adaptive K is a switch's cost.

    cd bench && python sync_points_gpu.py [--configs "ngram K=4,ngram adaptive<=4"]
        [--device cpu]     (cpu: a smoke test of this script; no CUDA call syncs there)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import traceback
import types
import warnings

import anyio
import torch

from _common import generate_round, held_out_sets, quiet_logs
from profile_spec_gpu import bench_engine

HERE = os.path.dirname(os.path.abspath(__file__))


def engine_line(stack: list[traceback.FrameSummary], root: str) -> str:
    """The innermost frame under the installed package's ``root`` (a checkout installed
    editable, or site-packages/specloop) that made the call, outside this bench."""
    for frame in reversed(stack):
        name = os.path.abspath(frame.filename)
        if name.startswith(root) and not name.startswith(HERE):
            return f"{os.path.relpath(name, root)}:{frame.lineno} {frame.name}"
    return "(outside the engine)"


async def count_syncs(loaded, rounds, name: str, tokens: int, device: str) -> dict:
    """``rounds``: lists of prompts, each a closed round at the batch of its length."""
    import specloop.engine  # noqa: PLC0415
    # The package's root: the folder holding engine/ (site-packages/specloop, or a
    # checkout installed editable).
    root = os.path.dirname(os.path.dirname(os.path.abspath(specloop.engine.__file__))) + os.sep
    async with bench_engine(name, loaded, len(rounds[0]), device) as engine:
        for prompts in rounds[:2]:     # warm: the first iterations' one-off work
            await generate_round(engine, prompts, 16)
        where: collections.Counter[str] = collections.Counter()
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                where[engine_line(traceback.extract_stack(), root)] += 1
            else:
                shown(message, category, filename, lineno, file, line)

        iterations = engine.stats.num_iterations
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():     # restores showwarning on the way out
                warnings.simplefilter("always")
                warnings.showwarning = show
                for prompts in rounds:
                    await generate_round(engine, prompts, tokens)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        adaptive = engine.worker.adaptive
        return {"iterations": engine.stats.num_iterations - iterations,
                "k_chosen": None if adaptive is None else dict(sorted(adaptive.chosen.items())),
                "sync_calls": dict(where.most_common(20))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="ngram K=4,ngram adaptive<=4 warm-up times")
    ap.add_argument("--prompts", default=os.path.join(HERE, "prompts_heldout.jsonl"))
    ap.add_argument("--sets", type=int, default=4,
                    help="rounds of held-out prompts, one after another")
    ap.add_argument("--batch", type=int, default=1, help="prompts a round")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    quiet_logs()
    ns = types.SimpleNamespace(device=args.device, prompts=args.prompts,
                               batches=str(args.batch))
    loaded, _, sets = next(held_out_sets(ns, min_prompts=args.sets))
    rounds = sets[:args.sets]
    rows = []
    for name in args.configs.split(","):
        row = {"config": name, "batch": args.batch,
               **anyio.run(count_syncs, loaded, rounds, name, args.tokens,
                                           args.device)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
