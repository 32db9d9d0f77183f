"""Does the shipped eagle3 head accept differently early in an answer than later? The
chain's expected tokens an iteration E(k) (1 + accepted drafts of a chain of k), for k = 1
.. 3, over the starts in each band of answer positions, on the CPU (SmolLM2 fp32, greedy
answers through the engine, the head's teacher-forced unroll: bench/tree_acceptance.py's
ranks). Why it matters: adaptive K prices E(k) from the batch's tail (the rows with the
most tokens left, engine/_adaptive_tail.py), and under a server's steady load those are the
rows that joined last, early in their answers; where E(3) / E(2) is lower there than over
whole answers, the rule would draft K = 2 where K = 3 makes more tokens for the batch.

    python bench/acceptance_by_position.py [--prompts 32] [--tokens 192] [--skip 0]
        [--bands 0,16,32,64,128] [--out bench/results/cpu_acceptance_by_position.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from _common import quiet_logs
from held_out_prompts import read as held_out
from tree_acceptance import NAME, accepted, greedy_answers, load_head, rank_paths

from specloop.samplers._tree import DraftTree

DEPTH = 3


DEPTH_CHAINS = {k: set(DraftTree.chain(k).paths) for k in range(1, DEPTH + 1)}


def chain_accepted(path: tuple[int, ...], k: int) -> int:
    """Drafts a chain of ``k`` accepts at a start whose true path has ranks ``path``."""
    return accepted(path, DEPTH_CHAINS[k])


def by_band(per_answer: list[list[tuple[int, ...]]], bands: list[int]) -> list[dict]:
    """E(k) for k = 1 .. DEPTH over the starts in each band [bands[i], bands[i+1]) of
    answer positions (the last band open), with the starts counted."""
    rows = []
    edges = bands + [1 << 30]
    for lo, hi in zip(edges, edges[1:]):
        starts = [p for paths in per_answer for p in paths[lo:hi]]
        if not starts:
            continue
        e = {k: 1 + sum(chain_accepted(p, k) for p in starts) / len(starts)
             for k in range(1, DEPTH + 1)}
        rows.append({"band": [lo, None if hi == 1 << 30 else hi], "starts": len(starts),
                     **{f"E{k}": round(v, 3) for k, v in e.items()},
                     "E3/E2": round(e[3] / e[2], 4)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=192, help="answer tokens at most")
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--bands", default="0,16,32,64,128")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    quiet_logs()
    from specloop.models import load_model  # noqa: PLC0415

    start = time.perf_counter()
    loaded = load_model(NAME, dtype=torch.float32, device="cpu")
    texts = [row["text"] for row in held_out()][args.skip:args.skip + args.prompts]
    answers = greedy_answers(loaded, texts, args.tokens + DEPTH + 1)
    print(f"{len(answers)} greedy answers ({sum(len(a) for _, a in answers)} tokens) in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    head = load_head(loaded, max(len(p) + len(a) for p, a in answers) + DEPTH + 2)
    per_answer = rank_paths(loaded, head, answers, DEPTH)
    rows = by_band(per_answer, [int(b) for b in args.bands.split(",")])
    print(f"{'answer positions':>18s} {'starts':>7s} {'E(1)':>6s} {'E(2)':>6s} {'E(3)':>6s} "
          f"{'E(3)/E(2)':>9s}")
    for r in rows:
        lo, hi = r["band"]
        print(f"{f'{lo}..{hi - 1}' if hi else f'{lo}..':>18s} {r['starts']:7d} "
              f"{r['E1']:6.3f} {r['E2']:6.3f} {r['E3']:6.3f} {r['E3/E2']:9.4f}")
    whole = by_band(per_answer, [0])[0]
    print(f"{'all':>18s} {whole['starts']:7d} {whole['E1']:6.3f} {whole['E2']:6.3f} "
          f"{whole['E3']:6.3f} {whole['E3/E2']:9.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "prompts": args.prompts, "skip": args.skip, "tokens": args.tokens,
            "answers": len(answers), "bands": rows, "all": whole}, indent=1) + "\n")


if __name__ == "__main__":
    main()
