"""Paged attention on the GPU: one kernel against split-KV (flash-decoding), per call.

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head dim 64, bf16), random
data, no weights: a KV cache of ``--max-len`` positions a slot in ``--page``-position pages
handed out in a random order, one cache per call like the model's layers (so L2 holds
what it would). For each batch B, query tokens T (decode; VERIFY with K = 3, 5) and
context length, a CUDA graph holds ``--calls`` calls (the model's ~30 layers) and is
replayed; the time per call is the replay's ÷ calls (so the in-graph gap between kernels
is in it, as in the model). Each split count S is timed, and the automatic one
(``attention_splits``, from the shapes only); rows shorter than ``--split-min`` positions
are not split whatever S (one program each: contexts 128 and 320, what chat serving sees,
show what S > 1 costs them); every result is checked against the one kernel (S = 1).
Prints a table and writes JSON to $OUT/attention.json (OUT: /tmp).

    python bench/bench_paged_attention.py            # the full table, < 90 s on an H200
    python bench/bench_paged_attention.py --device cpu --batches 1,3 --tokens 1,4 \\
        --contexts 20,60 --max-len 64 --split-min 32 --splits 2,4 --block-n 16 --calls 2 \\
        --tiles 32x4
        # a smoke test (TRITON_INTERPRET=1)

Table columns: µs per call for S = 1 (the one kernel) and each S (the default combine:
the last program of a row's splits adds their partials); ``auto`` is the rule's S and its
time; ``best`` the fastest S; ``auto/best`` the rule's time over the best's (1.00: the rule
picked the best, or one within noise); ``x`` the one kernel's time over the rule's;
``kern`` the rule's S with combine="kernel" (a second kernel adds the partials) and the one
kernel's time over it. A second table sweeps the KV tile, warps and pipelining stages
(``--tiles``; stages: Triton's default unless given) for S = 1 and auto.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from specloop.graphs._cuda import capture_graph
from specloop.models import _kernels

HQ, HKV, D = 9, 3, 64


def make_inputs(batch: int, T: int, context: int, args, device: str, gen: torch.Generator):
    """Per-call caches, q, a shuffled block table, slots and starts (lengths just under
    ``context``, not multiples of a tile)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    per = -(-args.max_len // args.page)
    pages = batch * per
    order = torch.randperm(pages, generator=gen).int().view(batch, per)
    table = torch.cat([order, torch.full((1, per), pages, dtype=torch.int32)]).to(device)
    shape = (pages + 1, args.page, HKV, D)
    caches = [(torch.randn(shape, device=device, dtype=dtype),
               torch.randn(shape, device=device, dtype=dtype)) for _ in range(args.calls)]
    q = torch.randn(batch, T, HQ, D, generator=gen).to(device, dtype)
    lengths = [max(T, context - (b % 13)) for b in range(batch)]
    starts = torch.tensor([n - T for n in lengths], device=device)
    slots = torch.arange(batch, device=device)
    return caches, q, table, slots, starts


def time_per_call(fn, calls: int, device: str, replays: int, repeats: int) -> tuple[float, object]:
    """µs per call (median of ``repeats`` timings of ``replays`` graph replays) and the first
    call's output. On the CPU: eager calls, wall time (a smoke test, not a figure)."""
    if device != "cuda":
        out = None
        start = time.perf_counter()
        for i in range(calls):
            o = fn(i)
            out = o if out is None else out
        return (time.perf_counter() - start) / calls * 1e6, out
    graph, outs = capture_graph(lambda: [fn(i) for i in range(calls)])
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / (replays * calls))
    del graph
    return statistics.median(times), outs[0].clone()


def measure(batch, T, context, args, device, gen, block_n, warps, split_values, stages=None):
    """One shape: µs per call for S = 1, each S and the rule's S (combine="last": no second
    kernel), and the rule's S with combine="kernel" (a second kernel), each checked against
    S = 1."""
    caches, q, table, slots, starts = make_inputs(batch, T, context, args, device, gen)
    sm = _kernels._sm_count(q.device)
    auto = _kernels.default_splits(q, caches[0][0], table, block_n, args.split_min)
    variants = {str(s): (s, "last") for s in dict.fromkeys([1, *split_values, auto])}
    if auto > 1 and args.kernel:
        variants["kernel"] = (auto, "kernel")
    us, err, failed = {}, {}, {}
    ref = None
    for label, (s, combine) in variants.items():
        def call(i, s=s, combine=combine):
            k, v = caches[i]
            return _kernels.paged_attention(q, k, v, table, slots, starts, splits=s,
                                            block_n=block_n, num_warps=warps,
                                            num_stages=stages, combine=combine,
                                            split_min=args.split_min)
        try:
            us[label], out = time_per_call(call, args.calls, device, args.replays,
                                           args.repeats)
        except Exception as exc:  # noqa: BLE001 - one variant failing leaves the others' rows
            if label == "1":
                raise
            failed[label] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"  B {batch} T {T} ctx {context}: {label} failed: {failed[label]}")
            us[label] = float("nan")
            continue
        if ref is None:
            ref = out.float()
        err[label] = float((out.float() - ref).abs().max())
    ok = {k: t for k, t in us.items() if k not in failed}
    best = int(min((k for k in ok if k != "kernel"), key=ok.get))
    fastest = min(ok, key=ok.get)
    return {"batch": batch, "T": T, "context": context, "block_n": block_n, "num_warps": warps,
            "num_stages": stages,
            "sm_count": sm, "us_per_call": {k: round(t, 3) for k, t in us.items()},
            "max_abs_diff_vs_one_kernel": err,
            "auto_splits": auto, "best_splits": best, "auto_is_best": auto == best,
            "auto_over_best": round(us[str(auto)] / us[str(best)], 3),
            "one_kernel_over_auto": round(us["1"] / us[str(auto)], 3),
            "one_kernel_over_kernel_combine": (round(us["1"] / us["kernel"], 3) if "kernel" in us
                                               else None),
            "fastest": fastest, "failed": failed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test (TRITON_INTERPRET=1)")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--tokens", default="1,4,6", help="query tokens a row (decode, VERIFY)")
    ap.add_argument("--contexts", default="128,320,512,1024,2048",
                    help="positions a row (just under); 128, 320: chat rows, below split_min")
    ap.add_argument("--splits", default="2,4,8,16,32", help="S values timed besides 1, auto")
    ap.add_argument("--max-len", type=int, default=2048, help="the cache's (engine default)")
    ap.add_argument("--page", type=int, default=16, help="positions a page (engine default)")
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--tiles", default="16x4,32x4,64x8",
                    help="BLOCK_N x warps [x stages] swept (S = 1 and auto) at B 1, 32, T 1, 4 "
                         "and every other context; '' to skip")
    ap.add_argument("--split-min", type=int, default=None,
                    help="a row splits from this many positions (default: the engine's)")
    ap.add_argument("--no-kernel", dest="kernel", action="store_false",
                    help="skip combine='kernel' (the rule's S, a second kernel)")
    ap.add_argument("--calls", type=int, default=30, help="calls a graph (the model's layers)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA: run with --device cpu (under TRITON_INTERPRET=1) to smoke-test")
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    began = time.perf_counter()
    split_values = ints(args.splits)
    rows = []
    head = (f"{'B':>4} {'T':>2} {'ctx':>5} | {'S=1':>6} " + " ".join(f"{'S=' + str(s):>6}"
            for s in split_values) + f" | {'auto':>9} {'best':>4} {'auto/best':>9} {'x':>5}"
            f" | {'kern':>6} {'x':>5} {'maxdiff':>8}")
    print(f"paged attention, µs per call ({args.calls} calls a graph), HQ {HQ} HKV {HKV} D {D},"
          f" page {args.page}, max_len {args.max_len}, BLOCK_N {args.block_n}, "
          f"warps {args.num_warps}, split_min "
          f"{args.split_min if args.split_min is not None else _kernels._SPLIT_MIN}")
    print(head)
    for batch in ints(args.batches):
        for T in ints(args.tokens):
            for context in ints(args.contexts):
                r = measure(batch, T, context, args, args.device, gen, args.block_n,
                            args.num_warps, split_values)
                rows.append(r)
                u = r["us_per_call"]
                cells = " ".join(f"{u.get(str(s), float('nan')):6.2f}" for s in split_values)
                kern = (f"{u['kernel']:6.2f} {r['one_kernel_over_kernel_combine']:5.2f}"
                        if "kernel" in u else f"{'-':>6} {'-':>5}")
                print(f"{batch:>4} {T:>2} {context:>5} | {u['1']:6.2f} {cells} | "
                      f"{u[str(r['auto_splits'])]:6.2f}@{r['auto_splits']:<2} "
                      f"{r['best_splits']:>4} {r['auto_over_best']:9.2f} "
                      f"{r['one_kernel_over_auto']:5.2f} | {kern} "
                      f"{max(r['max_abs_diff_vs_one_kernel'].values()):8.1e}")
                if max(r["max_abs_diff_vs_one_kernel"].values()) > 0.05:
                    print("  ^ a split result differs from the one kernel's by more than "
                          "bf16 rounding: see max_abs_diff_vs_one_kernel in the JSON")
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    tiles = []
    if args.tiles:
        print("\nKV tile sweep (S = 1 and auto), µs per call")
        print(f"{'B':>4} {'T':>2} {'ctx':>5} {'tile':>8} | {'S=1':>6} {'auto':>9} {'kern':>6}")
        for batch in [b for b in (1, 32) if b in ints(args.batches)] or ints(args.batches)[:1]:
            for T in ints(args.tokens)[:2]:
                for context in (ints(args.contexts)[1::2] or ints(args.contexts)):
                    for tile in args.tiles.split(","):
                        block_n, warps, *stages = (int(x) for x in tile.split("x"))
                        r = measure(batch, T, context, args, args.device, gen, block_n, warps,
                                    [], stages[0] if stages else None)
                        tiles.append(r)
                        u = r["us_per_call"]
                        print(f"{batch:>4} {T:>2} {context:>5} {tile:>8} | {u['1']:6.2f} "
                              f"{u[str(r['auto_splits'])]:6.2f}@{r['auto_splits']:<2} "
                              f"{u.get('kernel', float('nan')):6.2f}")
    picked = sum(r["auto_is_best"] for r in rows)
    within = sum(r["auto_over_best"] <= 1.05 for r in rows)
    kernel_wins = sum(r["fastest"] == "kernel" for r in rows)
    split_min = args.split_min if args.split_min is not None else _kernels._SPLIT_MIN
    short = [r for r in rows if r["context"] < split_min]
    worst = max((r["us_per_call"][str(r["auto_splits"])] / r["us_per_call"]["1"] for r in short),
                default=float("nan"))
    print(f"\nauto picked the best S in {picked}/{len(rows)} cases, within 5% of it in "
          f"{within}/{len(rows)}; combine='kernel' fastest of all in {kernel_wins}/{len(rows)}; "
          f"contexts below split_min {split_min}: auto / S=1 at most {worst:.3f}; "
          f"{time.perf_counter() - began:.0f} s")
    out = Path(os.environ.get("OUT", "/tmp")) / "attention.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out.write_text(json.dumps({"device": device, "args": vars(args), "rows": rows,
                               "tiles": tiles, "auto_best": picked, "auto_within_5pct": within,
                               "kernel_combine_fastest": kernel_wins,
                               "short_auto_over_one_kernel_max": worst,
                               "cases": len(rows)}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
