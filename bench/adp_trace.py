"""Summarise ``bench/adp_run.py --trace-out DIR``: per consumer, medians over its rounds'
iterations of each rank's state times and of the exchange's skew and collective time
(the collective also split: exchanges the rank arrived last to, and those it waited in).

    python bench/adp_trace.py DIR
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys


def load(folder):
    runs = {}
    for path in sorted(glob.glob(os.path.join(folder, "trace_w*_r*.json"))):
        with open(path) as f:
            data = json.load(f)
        runs.setdefault(data["world"], {})[data["rank"]] = data
    return runs


def spans(rounds, end):
    """consumer -> [(first iteration, last + 1, first exchange, last + 1)] per round."""
    out = {}
    for i, (consumer, first_it, first_ex, _) in enumerate(rounds):
        nxt = rounds[i + 1] if i + 1 < len(rounds) else (None, end[0], end[1], None)
        out.setdefault(consumer, []).append((first_it, nxt[1], first_ex, nxt[2]))
    return out


def med(values):
    return f"{statistics.median(values):.0f}" if values else "-"


def summarise(world, ranks):
    rounds = ranks[0]["rounds"]
    last_it = max(it for r in ranks.values() for it, _, _ in r["states"]) + 1
    for consumer, parts in spans(rounds, (last_it, ranks[0]["exchange_count"])).items():
        rates = [f"{tok_s:.0f}" for c, _, _, tok_s in rounds if c == consumer]
        print(f"world {world}, {consumer}: tok/s per round {', '.join(rates)}")
        for rank, data in sorted(ranks.items()):
            states, its = {}, set()
            for it, state, us in data["states"]:
                if any(a <= it < b for a, b, _, _ in parts):
                    states.setdefault(state, []).append(us)
                    its.add(it)
            line = ", ".join(f"{s} {med(v)}" for s, v in states.items())
            # The deque keeps the last exchanges: index from the end.
            ex, count = data["exchange"], data["exchange_count"]
            picked = [ex[i - (count - len(ex))] for a, b, c, d in parts for i in range(c, d)
                      if 0 <= i - (count - len(ex)) < len(ex)]
            # Split: arrived last (skew 0: its own path only) or waited (the last rank's
            # path from its stamp to its post, then noticing it between other tasks).
            last = [c for s, c in picked if s == 0]
            waited = [c for s, c in picked if s > 0]
            exch = (f"; exchange skew median {med([s for s, _ in picked])} us, collective "
                    f"median {med([c for _, c in picked])} us over {len(picked)} (arrived "
                    f"last {med(last)} over {len(last)}, waited {med(waited)} over "
                    f"{len(waited)})" if picked else "")
            print(f"  rank {rank}: {len(its)} iterations; median state us: {line}{exch}")


def per_round(world, ranks):
    """Round by round: each rank's median iteration (sum of its states' times) and its
    exchange's median skew and collective."""
    rounds = ranks[0]["rounds"]
    last_it = max(it for r in ranks.values() for it, _, _ in r["states"]) + 1
    ends = [(r[1], r[2]) for r in rounds[1:]] + [(last_it, ranks[0]["exchange_count"])]
    for n, ((consumer, first_it, first_ex, tok_s), (end_it, end_ex)) in enumerate(
            zip(rounds, ends)):
        cells = []
        for rank, data in sorted(ranks.items()):
            iters = {}
            for it, _, us in data["states"]:
                if first_it <= it < end_it:
                    iters[it] = iters.get(it, 0) + us
            ex, count = data["exchange"], data["exchange_count"]
            picked = [ex[i - (count - len(ex))] for i in range(first_ex, end_ex)
                      if 0 <= i - (count - len(ex)) < len(ex)]
            cell = f"r{rank} it {med(list(iters.values()))}"
            if picked:
                cell += (f" skew {med([a for a, _ in picked])} coll "
                         f"{med([b for _, b in picked])}")
            cells.append(cell)
        print(f"  round {n} {consumer}: {tok_s:.0f} tok/s; median us: " + "; ".join(cells))


def ratios(runs):
    """N ranks / 1 rank tokens/s, round by round (same consumer, same round index)."""
    if 1 not in runs:
        return
    base = runs[1][0]["rounds"]
    for world, ranks in sorted(runs.items()):
        if world == 1:
            continue
        rows = {}
        for (c1, _, _, one), (c2, _, _, many) in zip(base, ranks[0]["rounds"]):
            if c1 == c2:
                rows.setdefault(c1, []).append(f"{many / one:.2f}")
        for consumer, values in rows.items():
            print(f"{world} ranks / 1 rank, {consumer}: per round " + " / ".join(values))


def main():
    runs = load(sys.argv[1])
    for world, ranks in sorted(runs.items()):
        summarise(world, ranks)
        per_round(world, ranks)
    ratios(runs)


if __name__ == "__main__":
    main()
