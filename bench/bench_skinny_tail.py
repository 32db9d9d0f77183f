"""H200: the skinny GEMM's tl.dot tail above 32 rows (models/_linear DOT_MAX_ROWS) against
cuBLAS, for the GEMMs VERIFY runs at batch 8-64 with speculation (K = 3: 32-256 rows) and
no speculation at batch 33-256: per shape and row count, cuBLAS's time and each tl.dot
configuration's (the same timing as bench_skinny_gemm.py: a CUDA graph of back-to-back
calls, each on its own copy of the weight, so weights stream from HBM), and its bits:

- ``cublas``: whether the configuration's output equals F.linear's at that row count
  (bench_skinny_gemm.py's probe inputs, on which two summation orders differ in ~80 % of
  outputs) -- the table's rule for a tail (cuBLAS's bit class);
- ``rows``: whether each row equals the same row of the 32-row call (the kernel's per-row
  arithmetic: a graph padded to a larger bucket equals the unpadded call);
- per shape, whether cuBLAS itself gives a row the same bits at every row count
  (``cublas_invariant``): where it does not, F.linear above the table was a class of its own
  at each row count already.

``--one-tile`` also times each configuration as one BLOCK_K tile over K (models/_skinny
``PIECES`` off: K = 576 padded to 1024) beside the two tiles it runs now (512 + 64,
``one_pass_piece``), and checks that both give the same bits.

No model weights needed (random bf16 of the real shapes). Writes $OUT/skinny_tail.json
(``--label X``: skinny_tail_X.json).

``--compose A.json B.json ... --table-out T.json`` (no GPU) chooses each timed shape's
entry again from those runs (bench_skinny_gemm.py's ``choose``: the weighted saving over
cuBLAS, >= 3 %) and writes the code's table with them as a file SPECLOOP_SKINNY_TABLE
reads: where the run timed the shape's prefix rows (its configurations without tl.dot, one
bit class), prefix and tail are chosen together from them and the tail candidates; where it
timed only rows above the prefix, the ranges below its first timed row stay and the tail
above them is chosen. A tail candidate is a tl.dot configuration that gave F.linear's bits
and each row the same bits at every timed row count. The engine may still disagree with a
choice made from calls alone (a cuBLAS GEMM breaks PDL's chain of Triton kernels): compare
tables by GPU time an iteration (``h200_check.sh tables``, its ``gpu:`` lines).

    python bench/bench_skinny_tail.py [--rows 32,64,128,256] [--shapes qkv,o,gate_up]
        [--configs d64x1024s1w8n1,d32x1024s1w4n1] [--one-tile]
    # tl.dot over blocks of 32 / 64 rows (``m``: a program reads its tile of W once for
    # them, not once for each 16; gate-up lost to cuBLAS from 96 rows with 16, and with
    # ``m32`` from 128 alone -- the shipped table takes it to 128 for PDL's chain):
    python bench/bench_skinny_tail.py --shapes gate_up,qkv,o --rows 64,96,128,192,256 \
        --configs d64x1024s1w8n1m32,d64x1024s1w8n1m64,d128x1024s1w8n1m32,d128x1024s1w8n1
    # the down GEMM on the activation (K = 1536: two tiles of 1024 + 512, not 2048):
    python bench/bench_skinny_tail.py --shapes down --rows 2,5,8,16,32 --one-tile \
        --configs d16x2048s1w8n1,d32x2048s1w8n1,d16x2048s1w4n1
    python bench/bench_skinny_tail.py --compose $OUT/skinny_tail_*.json --table-out t.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

import bench_skinny_gemm as sg

ROWS = (32, 48, 64, 96, 128, 160, 192, 256)
CONFIGS = ("d64x1024s1w8n1", "d32x1024s1w4n1", "d64x1024s1w4n1", "d128x1024s1w8n1",
           "d64x1024s1w8n2")
SHAPES = ("qkv", "o", "gate_up")
# The table entry a timed shape stands for where it is not (N, K, False): the down GEMM on
# the activation runs the silu entry's configurations (models/_linear ``norm_mlp``).
TABLE_KEYS = {"down": (576, 1536, True)}


def bench(name: str, rows_list, tags, one_tile: bool = False) -> dict:
    from specloop.models import _skinny
    from specloop.models._linear import parse_config
    from specloop.models._skinny import skinny_linear
    n, k, _ = {**sg.SHAPES, **sg.EXTRA_SHAPES}[name]
    copies = max(2, math.ceil(sg.L2_FLUSH_BYTES / (n * k * 2)))
    calls = min(sg.MAX_CALLS, max(sg.MIN_CALLS, copies))
    copies = min(copies, calls)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = [(torch.randn(n, k, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
          for _ in range(copies)]
    probe = sg.probe_inputs(n, k, False, "cuda", torch.bfloat16, rows=max(*rows_list, 32))
    out = {"shape": name, "N": n, "K": k, "cublas_us": {}, "configs": {}}
    ref32 = [F.linear(x[:32], w) for x, w, _ in probe]
    out["cublas_invariant"] = all(
        torch.equal(F.linear(x[:m], w)[:32], r[:m]) for m in rows_list for (x, w, _), r in
        zip(probe, ref32))
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
        out["cublas_us"][rows], _ = sg.time_graph(lambda i: F.linear(x, ws[i % copies]), calls)
    for label in [v for tag in tags for v in ((tag, tag + "/1") if one_tile else (tag,))]:
        tag = label.removesuffix("/1")
        cfg = parse_config(tag)
        per = out["configs"][label] = {}
        _skinny.PIECES = not label.endswith("/1")
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
            try:
                us, _ = sg.time_graph(lambda i: skinny_linear(x, ws[i % copies], None, cfg),
                                      calls)
                ys = [skinny_linear(px[:rows], w, None, cfg) for px, w, _ in probe]
                cublas = all(torch.equal(y, F.linear(px[:rows], w))
                             for y, (px, w, _) in zip(ys, probe))
                same = all(torch.equal(y[:32], skinny_linear(px[:32], w, None, cfg)[:rows])
                           for y, (px, w, _) in zip(ys, probe))
                per[rows] = {"us": round(us, 3), "cublas": cublas, "rows": same}
                if label != tag:    # one tile against the two tiles: the same bits
                    _skinny.PIECES = True
                    per[rows]["pieces_equal"] = all(
                        torch.equal(y, skinny_linear(px[:rows], w, None, cfg))
                        for y, (px, w, _) in zip(ys, probe))
                    _skinny.PIECES = False
            except Exception as e:  # noqa: BLE001 - e.g. out of resources: report it
                per[rows] = {"error": f"{type(e).__name__}: {str(e)[:80]}"}
    _skinny.PIECES = True
    return out


def compose(results: list[dict], table: dict) -> dict:
    """``table`` (models/_linear's form) with each of ``results``' shapes chosen again (the
    module docstring's ``--compose``); a later result for a shape replaces an earlier one's
    times tag by tag."""
    from specloop.models._linear import parse_config
    merged: dict = {}
    for r in results:
        m = merged.setdefault(r["shape"], {"N": r["N"], "K": r["K"], "cublas": {},
                                           "configs": {}})
        m["cublas"].update({int(rows): us for rows, us in r["cublas_us"].items()})
        for tag, per in r["configs"].items():
            if not tag.endswith("/1"):
                m["configs"].setdefault(tag, {}).update(
                    {int(rows): c for rows, c in per.items()})
    out = dict(table)
    for name, m in merged.items():
        key = TABLE_KEYS.get(name, (m["N"], m["K"], False))
        entry = table.get(key) or ()
        prefix = tuple((rows, tag) for rows, tag in entry if not parse_config(tag).dot)
        top = prefix[-1][0] if prefix else 0
        timed = sorted(m["cublas"])
        # The prefix's rows timed: chosen again too (not for a shape whose prefix runs the
        # norm in its prologue, which this bench does not time).
        whole = top > 0 and timed[0] == 1 and name not in sg.NORM_SHAPES
        rows_list = timed if whole else [r for r in timed if r > top]
        cublas = {r: m["cublas"][r] for r in rows_list}
        times, tail = {}, []
        for tag, per in m["configs"].items():
            dot = parse_config(tag).dot
            times[tag] = {r: per[r]["us"] if "us" in per.get(r, {}) and per[r]["rows"] and
                          (per[r]["cublas"] or not dot) else "mismatch" for r in rows_list}
            if dot and all(isinstance(us, float) for us in times[tag].values()):
                tail.append(tag)
        classes = {tag: "prefix" for _, tag in prefix} if whole else {}
        picks, saved = sg.choose(cublas, times, classes, tail)
        # Rows below the first timed one keep their ranges (the prefix's, and the tail's
        # where it starts below the run's rows: their layer-bench choice).
        keep = () if whole else tuple((rows, tag) for rows, tag in entry
                                      if rows < rows_list[0])
        new = keep + tuple(picks or ())
        out[key] = new or None
        print(f"{name} {key}: {entry or 'cuBLAS'} -> {new or 'cuBLAS'} "
              f"(saves {saved:.2f} us weighted over rows {rows_list})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--one-tile", action="store_true",
                    help="also each configuration as one BLOCK_K tile (label /1)")
    ap.add_argument("--label", default="", help="write skinny_tail_LABEL.json")
    ap.add_argument("--compose", nargs="+", metavar="TAIL_JSON",
                    help="no GPU: choose the timed shapes' entries again (with --table-out)")
    ap.add_argument("--table-out", default="skinny_table.json")
    args = ap.parse_args()
    if args.compose:
        from specloop.models import _linear
        results = [r for path in args.compose for r in json.load(open(path))["results"]]
        table = compose(results, _linear.SKINNY_TABLE)
        _linear.check_table(table)
        with open(args.table_out, "w") as f:
            json.dump(sg.table_json(table), f, indent=1)
        print(f"wrote {args.table_out}")
        return
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for name in args.shapes.split(","):
        r = bench(name, rows_list, args.configs.split(","), args.one_tile)
        results.append(r)
        print(f"{name} ({r['N']}x{r['K']}) cuBLAS row-invariant: {r['cublas_invariant']}")
        for rows in rows_list:
            cells = [f"cublas {r['cublas_us'][rows]:.2f}"]
            for tag, per in r["configs"].items():
                c = per[rows]
                cells.append(f"{tag} " + (c["error"][:30] if "error" in c else
                             f"{c['us']:.2f}{'' if c['cublas'] else ' !cublas'}"
                             f"{'' if c['rows'] else ' !rows'}"
                             f"{'' if c.get('pieces_equal', True) else ' !pieces'}"))
            print(f"  {rows:4d} rows: " + " | ".join(cells), flush=True)
    sg.write_out(f"skinny_tail{'_' + args.label if args.label else ''}.json",
                 {"results": results})


if __name__ == "__main__":
    main()
