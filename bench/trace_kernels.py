"""One steady iteration's device work in order, from a torch-profiler chrome trace
(``profile_spec_gpu.py --trace-dir``): each kernel or copy with the launch it came from
(a graph replay, a kernel launch, a copy), its median duration and the median idle gap
before it, over the iterations whose sequence is the most common one.

Aggregates by kernel name (``critical_path_us_per_iter``) say how much a kind of kernel
costs, not where it sits; this says which step's glue a small torch kernel belongs to.
The profiler instruments every node of a replayed graph, so gaps read larger than in an
unprofiled run; durations hold.

    python bench/trace_kernels.py TRACE.json [--top 0] [--out FILE.txt]

Iterations end at each device-to-host copy (VERIFY's read-back).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def device_events(trace: dict) -> tuple[list[dict], dict[int, str]]:
    """Device events in time order, and each correlation id's runtime call name."""
    events = trace["traceEvents"]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS and "dur" in e),
                    key=lambda e: e["ts"])
    launch = {e["args"]["correlation"]: e["name"] for e in events
              if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    return device, launch


def iterations(device: list[dict]) -> list[list[dict]]:
    """Device events split after each device-to-host copy."""
    out: list[list[dict]] = [[]]
    for e in device:
        out[-1].append(e)
        if "DtoH" in e["name"] or "Device -> Pinned" in e["name"]:
            out.append([])
    return [it for it in out if it]


def signature(it: list[dict], launch: dict[int, str]) -> tuple:
    return tuple((launch.get(e["args"].get("correlation"), "?"), e["name"]) for e in it)


def summarize(trace: dict) -> tuple[int, int, list[tuple[str, str, float, float]]]:
    """(iterations seen, iterations of the common sequence, rows: launch label, name,
    median gap µs, median duration µs)."""
    device, launch = device_events(trace)
    its = iterations(device)[1:-1]          # the first and last are partial
    sigs = collections.Counter(signature(it, launch) for it in its)
    common, count = sigs.most_common(1)[0]
    same = [it for it in its if signature(it, launch) == common]
    rows = []
    group, last_corr = 0, None
    for j, (call, name) in enumerate(common):
        corr = same[0][j]["args"].get("correlation")
        if corr != last_corr:
            group += 1
            last_corr = corr
        label = f"{group:02d} {call.replace('cuda', '')[:14]}"
        gaps = [it[j]["ts"] - (it[j - 1]["ts"] + it[j - 1]["dur"]) if j else 0.0
                for it in same]
        durs = [it[j]["dur"] for it in same]
        rows.append((label, name, statistics.median(gaps), statistics.median(durs)))
    return len(its), count, rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=0, help="also list the N longest rows")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    seen, count, rows = summarize(json.loads(Path(args.trace).read_text()))
    lines = [f"{args.trace}: {seen} iterations, {count} with the common sequence of "
             f"{len(rows)} device events; gap + duration = "
             f"{sum(max(r[2], 0) for r in rows):.1f} + {sum(r[3] for r in rows):.1f} µs"]
    lines.append(f"{'#':>4} {'launch':17} {'gap':>6} {'dur':>6}  name")
    for i, (label, name, gap, dur) in enumerate(rows):
        lines.append(f"{i:4d} {label:17} {gap:6.1f} {dur:6.1f}  {name[:90]}")
    by_launch: dict[str, float] = collections.defaultdict(float)
    for label, _, gap, dur in rows:
        by_launch[label] += dur
    lines.append("per launch (µs of kernels): " + ", ".join(
        f"{k.strip()} {v:.1f}" for k, v in by_launch.items()))
    if args.top:
        lines.append(f"longest {args.top}:")
        for label, name, gap, dur in sorted(rows, key=lambda r: -r[3])[:args.top]:
            lines.append(f"  {dur:6.1f} {label:17} {name[:90]}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
