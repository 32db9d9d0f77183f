"""H200: the skinny-GEMM Triton kernel (models/_skinny) against cuBLAS (F.linear) for
SmolLM2-135M's GEMMs, its EAGLE-3 head's and the LM heads, 1..32 rows, as a captured step
sees them: each timing replays a CUDA graph of >= 50 back-to-back calls (time / calls),
each call on its own copy of the weight, >= 128 MiB of copies in all, so the weights
stream from HBM as in a step over 30 layers, not from L2. No model weights needed (random
bf16 of the real shapes).

Per shape: cuBLAS at each row count, then every configuration of the sweep and the code
table's at every row count (one configuration serves all rows of a shape: the kernel gives
a row the same bits whatever the rows, which padded graphs and chained steps need), and,
around the chosen one, half and twice its warps (tl.dot: num_stages 2 / 4); each result is
checked against F.linear (bf16 tolerance; one that fails is reported, never chosen). The
choice per shape: the config and row limit R saving the most time summed over the timed
rows <= R (1, 2, 4 and 8 rows weigh the same: decode and VERIFY at small batches; 16 and
32 half), by >= 3% of cuBLAS's, cuBLAS above R. The sweep's ``b`` configs (blocks of 2, 4
or 8 rows reduced in one reduction) are the ones meant for VERIFY's 2-8 rows. The fused
silu-down shape's baseline is what it replaces: _kernels.silu_mul + F.linear. Then a
SmolLM2 layer without attention (add + RMSNorm, qkv, o, add + RMSNorm, gate-up, SwiGLU,
down) over 30 layers' weights, at 1, 4 and 8 rows: cuBLAS, the dispatcher's table as in
the code, the table this run chose, and that with the norms in the GEMMs' prologue
(SPECLOOP_SKINNY_NORM's path).

Prints per shape and rows cuBLAS against the chosen config (and the fastest config at that
row count), and the SKINNY_TABLE literal to paste into models/_linear.py; writes JSON to
$OUT/skinny.json (OUT defaults to /tmp). Triton compiles happen first, in parallel worker
processes (Triton's on-disk cache then serves this process): a few hundred kernels,
estimated 10-30 s cold on 16 cores (0.2 s each on this repository's CPU box).

    python bench/bench_skinny_gemm.py            # everything (< 90 s on one H200)
    python bench/bench_skinny_gemm.py --rows 1,4 --shapes qkv,down --no-refine
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F

# name -> (N, K, silu_mul): SmolLM2-135M (hidden 576, 9 q heads + 3 kv heads of 64,
# intermediate 1536, vocab 49152) and its EAGLE-3 head (fc3 3*576 -> 576, fc 2*576 -> 576,
# draft LM head over 16384 draft tokens).
SHAPES = {
    "qkv": (960, 576, False),
    "o": (576, 576, False),
    "gate_up": (3072, 576, False),
    "down+silu": (576, 1536, True),
    "fc3": (576, 1728, False),
    "fc": (576, 1152, False),
    "draft_lm": (16384, 576, False),
    "lm_head": (49152, 576, False),
}
ROWS = (1, 2, 4, 8, 16, 32)
L2_FLUSH_BYTES = 128 << 20   # > 2x the H200's 50 MB L2
MIN_CALLS, MAX_CALLS = 50, 400
WIN = 0.97                   # a config is chosen only if <= 97% of cuBLAS's time
# --smoke (CPU, Triton's interpreter): shapes / 8, 2 calls, 2 configs, wall-clock timing.
SMOKE = False
DEVICE = "cuda"
DTYPE = torch.bfloat16


def _warps(elements: int) -> int | None:
    """The fewest warps (4, 8 or 16) holding ``elements`` fp32 within 64 a thread."""
    return next((w for w in (4, 8, 16) if elements <= 64 * 32 * w), None)


def sweep(k: int) -> list:
    """The configurations tried for K (SkinnyConfig; one per shape serves every row count,
    so each is timed at all of them). Without tl.dot, all of K in one pass (BLOCK_K = K
    rounded up to a power of two; a pass is not software-pipelined), at the fewest warps
    keeping the fp32 product within 64 registers a thread: ``v`` (rows reduced one after
    the other) at BLOCK_N 1..8, and K over 2 programs at BLOCK_N 8 (fp32 partials, a reduce
    kernel); ``b`` (a block of 2, 4 or 8 rows reduced in one reduction, [rows, BN, BK];
    2: less wasted on masked rows at 1 row) at BLOCK_N 1..4, BLOCK_K / 256 warps; tl.dot from 16-row tiles, pipelined over K.
    Pruned to what won or came close on the H200 (v at BLOCK_K/4, BLOCK_N 4 at BLOCK_K/2
    and three tl.dot tiles never did), so the bench stays < 90 s."""
    from specloop.models._skinny import SkinnyConfig as C
    full = min(4096, max(16, 1 << max(0, (k - 1).bit_length())))
    out = []
    for bn, bk in ((1, full), (2, full), (4, full), (8, full), (8, full // 2)):
        warps = _warps(bn * bk)
        if bk >= 16 and warps is not None:
            out.append(C(False, bn, bk, 1, warps))
    # b: as many warps as BLOCK_K / 256 (8 bf16 a thread along K): more would lay the
    # loads out apart from the product, through shared memory (offline sm_90 compiles:
    # 3 barriers at 4 warps for [4, 2, 1024], 7 at 8); <= 128 fp32 products a thread.
    tile_warps = max(1, min(16, full // 256))
    for tile_m, bn in ((2, 2), (2, 4), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2)):
        if tile_m * bn * full <= 128 * 32 * tile_warps:
            out.append(C(False, bn, full, 1, tile_warps, tile_m=tile_m))
    out += [C(True, n, b, s) for n, b, s in [(16, 64, 1), (32, 64, 1), (64, 64, 1),
                                              (16, 128, 2)]]
    return out


def variants(cfg) -> list:
    """Around a chosen config: half and twice its warps, and for tl.dot num_stages 2 / 4
    (the broadcast path's single pass has nothing to pipeline)."""
    out = [cfg._replace(num_warps=w) for w in (cfg.num_warps // 2, cfg.num_warps * 2)
           if 2 <= w <= 16]
    if cfg.dot:
        out += [cfg._replace(num_stages=2), cfg._replace(num_stages=4)]
    return out


def compile_key(cfg, rows: int, k: int, act: bool) -> tuple:
    """What makes Triton compile apart (M is not specialised; N, K, strides are all
    multiples of 16 here): the block sizes as launched, the K programs, the flags."""
    split, _ = cfg.k_splits(k)
    return (cfg, cfg.block_m(rows), split, act)


def _compile_tasks(tasks: list) -> int:
    """Worker: run each (rows, N, K, act, cfg) once, so Triton compiles it into its cache."""
    from specloop.models._skinny import skinny_linear
    done = 0
    for rows, n, k, act, cfg in tasks:
        x = torch.zeros(rows, 2 * k if act else k, dtype=torch.bfloat16, device="cuda")
        w = torch.zeros(n, k, dtype=torch.bfloat16, device="cuda")
        try:   # one that cannot compile is reported by the timing loop, not here
            skinny_linear(x, w, None, cfg, silu_mul=act)
            done += 1
        except Exception:  # noqa: BLE001
            pass
    torch.cuda.synchronize()
    return done


def precompile(tasks: list, workers: int) -> None:
    """One task per distinct compile, spread over spawned workers (each its own CUDA
    context); on any failure the timing loop compiles what is missing itself."""
    seen, unique = set(), []
    for t in tasks:
        key = compile_key(t[4], t[0], t[2], t[3])
        if key not in seen:
            seen.add(key)
            unique.append(t)
    start = time.perf_counter()
    chunks = [unique[i::workers] for i in range(workers)]
    try:
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            done = sum(pool.map(_compile_tasks, [c for c in chunks if c]))
    except Exception as e:  # noqa: BLE001 - a bench: report and go on
        print(f"parallel compile failed ({e!r}); compiling while timing", flush=True)
        return
    print(f"compiled {done} kernels in {time.perf_counter() - start:.1f} s on {workers} "
          f"workers", flush=True)


def time_graph(fn, calls: int, reps: int = 7) -> tuple[float, torch.Tensor]:
    """fn(i) for i < calls captured in one graph -> (median us per call, last output)."""
    if SMOKE:   # no graphs on the CPU: the calls once, wall clock
        start = time.perf_counter()
        for i in range(calls):
            out = fn(i)
        return (time.perf_counter() - start) * 1e6 / calls, out.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(0)                                   # compile / autotune outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            out = fn(i)
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    result = out.clone()
    del graph
    return statistics.median(times), result


def close(y: torch.Tensor, ref: torch.Tensor) -> bool:
    err = (y.float() - ref.float()).abs().max().item()
    return err <= 2e-2 * max(1.0, ref.float().abs().max().item())


def row_weight(rows: int) -> float:
    """How much a row count's saving counts in ``choose``: decode (1 row a sequence) and
    VERIFY at small batches (K + 1 = 2..8 rows) equally, larger batches half."""
    return 1.0 if rows <= 8 else 0.5


def choose(cublas: dict, times: dict) -> tuple[str | None, int, float]:
    """-> (config, R, weighted us saved over the timed rows <= R): the config and row limit
    saving the most over cuBLAS (one config per shape for all rows <= R, by >= 3% of
    cuBLAS's time there), each timed row count's saving weighted by ``row_weight``, so a
    config fast at 1 row but slow at 4 (VERIFY at batch 1, K = 3) loses to one that is
    nearly as fast at 1 and also wins at 2, 4 and 8; (None, 0, 0.0) if none saves."""
    best: tuple[str | None, int, float] = (None, 0, 0.0)
    for tag, per in times.items():
        saved = base = 0.0
        for rows in sorted(cublas):
            if not isinstance(per.get(rows), float):
                break
            saved += row_weight(rows) * (cublas[rows] - per[rows])
            base += row_weight(rows) * cublas[rows]
            if saved > best[2] and saved >= (1 - WIN) * base:
                best = (tag, rows, saved)
    return best


def bench_shape(name: str, n: int, k: int, act: bool, rows_list, refine: bool) -> dict:
    from specloop.models._kernels import silu_mul
    from specloop.models._linear import parse_config, skinny_config
    from specloop.models._skinny import skinny_linear
    wbytes = n * k * 2
    copies = max(2, math.ceil(L2_FLUSH_BYTES / wbytes))
    calls = 2 if SMOKE else min(MAX_CALLS, max(MIN_CALLS, copies))
    copies = min(copies, calls)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    ws = [(torch.randn(n, k, device=DEVICE, generator=gen) * 0.05).to(DTYPE)
          for _ in range(copies)]
    xs = {rows: torch.randn(rows, 2 * k if act else k, device=DEVICE, generator=gen).to(DTYPE)
          for rows in rows_list}
    last = ws[(calls - 1) % copies]
    refs = {rows: F.linear(silu_mul(x) if act else x, last) for rows, x in xs.items()}
    cublas = {}
    for rows, x in xs.items():
        if act:
            cublas[rows], _ = time_graph(lambda i: F.linear(silu_mul(x), ws[i % copies]), calls)
        else:
            cublas[rows], _ = time_graph(lambda i: F.linear(x, ws[i % copies]), calls)
    times: dict[str, dict[int, float | str]] = {}

    def run(cfg):
        if cfg.tag() in times:
            return
        per = times[cfg.tag()] = {}
        for rows, x in xs.items():
            try:
                us, y = time_graph(lambda i: skinny_linear(x, ws[i % copies], None, cfg,
                                                           silu_mul=act), calls)
                per[rows] = us if close(y, refs[rows]) else "mismatch"
            except Exception as e:  # noqa: BLE001 - e.g. out of resources: report it
                per[rows] = f"error: {type(e).__name__}: {str(e)[:80]}"

    code = skinny_config(1, n, k, act)         # what the code's table runs now
    configs = sweep(k) + ([code] if code else [])
    if SMOKE:   # one of each family without tl.dot, the fewest programs (interpreted)
        configs = [max((c for c in configs if not c.dot and not c.tile_m),
                       key=lambda c: (c.block_n, c.block_k)),
                   max((c for c in configs if c.tile_m), key=lambda c: c.tile_m * c.block_n)]
    for cfg in configs:
        run(cfg)
    tag, max_rows, saved = choose(cublas, times)
    if refine and tag is not None:
        for cfg in variants(parse_config(tag)):
            run(cfg)
        tag, max_rows, saved = choose(cublas, times)
    per_row_best = {}
    for rows in rows_list:
        ok = {t: per[rows] for t, per in times.items() if isinstance(per.get(rows), float)}
        per_row_best[rows] = min(ok, key=ok.__getitem__) if ok else None
    failed = sorted(t for t, per in times.items()
                    if any(not isinstance(v, float) for v in per.values()))
    chosen = times.get(tag, {}) if tag else {}
    for rows in rows_list:
        pick = chosen.get(rows) if tag and rows <= max_rows else None
        fastest = per_row_best[rows]
        print(f"{name:10s} {n:6d}x{k:<5d} M={rows:<3d} cuBLAS {cublas[rows]:6.2f} us  "
              + (f"{tag} {pick:6.2f} us x{pick / cublas[rows]:.2f}" if pick else "cuBLAS")
              + (f"  (fastest at this M: {fastest} {times[fastest][rows]:.2f} us)"
                 if fastest else ""), flush=True)
    if failed:
        print(f"{name}: {len(failed)} configs failed somewhere: {failed[:4]}", flush=True)
    del ws
    if not SMOKE:
        torch.cuda.empty_cache()
    return {"shape": name, "N": n, "K": k, "silu_mul": act, "calls": calls,
            "cublas_us": cublas, "code_config": code.tag() if code else None,
            "chosen": tag, "max_rows": max_rows, "saved_us_over_rows": saved,
            "fastest_per_rows": per_row_best, "configs": times}


def table_from(results: list[dict]) -> dict:
    return {(r["N"], r["K"], r["silu_mul"]):
            (r["chosen"], r["max_rows"]) if r["chosen"] else None for r in results}


def table_literal(table: dict) -> str:
    lines = ["SKINNY_TABLE: dict[tuple[int, int, bool], tuple[str, int] | None] = {"]
    lines += [f"    {key!r}: {entry!r}," for key, entry in table.items()]
    lines.append("}")
    return "\n".join(lines)


def bench_layer(table: dict, layers: int = 30) -> list[dict]:
    """A SmolLM2 layer without attention: add + RMSNorm, qkv, o, add + RMSNorm, gate-up,
    SwiGLU, down, over ``layers`` layers' weights, through the dispatcher: cuBLAS, the
    code's table, this run's table, and this run's with the norms in the GEMMs' prologue
    (``skinny_norm``): us per layer."""
    from specloop.models import _linear
    from specloop.models._linear import PackedLinear
    QKV, H = SHAPES["qkv"][:2]
    I = SHAPES["down+silu"][1]
    gen = torch.Generator(device=DEVICE).manual_seed(1)

    def w(*shape):
        return (torch.randn(*shape, device=DEVICE, generator=gen) * 0.05).to(DTYPE)

    weights = [(w(QKV, H), w(H, H), w(2 * I, H), w(H, I)) for _ in range(layers)]
    norm_w = (torch.rand(H, device=DEVICE, generator=gen) + 0.5).to(DTYPE)
    out = []
    for rows in (1, 4, 8):
        x = torch.randn(rows, H, device=DEVICE, generator=gen).to(DTYPE)
        delta = torch.randn(rows, H, device=DEVICE, generator=gen).to(DTYPE)
        o_in = torch.randn(rows, H, device=DEVICE, generator=gen).to(DTYPE)
        res = {}
        for name, skinny, tab, norm in (("cublas", False, None, False),
                                        ("code table", True, None, False),
                                        ("bench table", True, table, False),
                                        ("bench table + norms", True, table, True)):
            lin = PackedLinear(skinny=skinny)
            lin.skinny_on_cpu, lin.skinny_norm = SMOKE, norm
            saved = dict(_linear.SKINNY_TABLE)
            if tab is not None:
                _linear.SKINNY_TABLE.update(tab)

            def step(i, lin=lin):
                wqkv, wo, wgu, wd = weights[i]
                _, stream = lin.norm_linear(x, delta, norm_w, 1e-5, wqkv)
                gate_up, _ = lin.norm_linear(stream, lin(o_in, wo), norm_w, 1e-5, wgu)
                return lin.silu_mul_linear(gate_up, wd)
            try:
                res[name], _ = time_graph(step, layers)
            finally:
                _linear.SKINNY_TABLE.clear()
                _linear.SKINNY_TABLE.update(saved)
        print(f"layer without attention M={rows}: " + ", ".join(
            f"{k} {v:.2f} us" for k, v in res.items())
            + f"  -> x{res['bench table'] / res['cublas']:.2f}, with norms "
              f"x{res['bench table + norms'] / res['cublas']:.2f}", flush=True)
        out.append({"rows": rows, "us_per_layer": res})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {list(SHAPES)}")
    ap.add_argument("--no-refine", dest="refine", action="store_false",
                    help="skip num_warps / num_stages variants around each best config")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--smoke", action="store_true",
                    help="CPU under TRITON_INTERPRET=1: this script's logic on shapes / 8")
    args = ap.parse_args()
    global SMOKE, DEVICE, DTYPE
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke needs TRITON_INTERPRET=1")
        SMOKE, DEVICE, DTYPE = True, "cpu", torch.float16   # (interpreter: no bf16 tl.dot)
        args.refine, args.workers = False, 1
        for name, (n, k, act) in SHAPES.items():
            SHAPES[name] = (n // 8, k // 8, act)
    elif not torch.cuda.is_available():
        sys.exit("needs CUDA")
    from specloop.models import _skinny
    if not _skinny.available():
        sys.exit("needs Triton")
    import triton
    t0 = time.perf_counter()
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    tasks = []
    from specloop.models._linear import skinny_config
    for n, k, act in shapes.values():
        code = skinny_config(1, n, k, act)
        for cfg in sweep(k) + ([code] if code else []):
            for v in [cfg] + (variants(cfg) if args.refine else []):
                tasks += [(rows, n, k, act, v) for rows in rows_list]
    if args.workers > 1:
        precompile(tasks, args.workers)
    results = [bench_shape(name, n, k, act, rows_list, args.refine)
               for name, (n, k, act) in shapes.items()]
    table = table_from(results)
    layer = bench_layer(table, 2 if SMOKE else 30) \
        if {"qkv", "o", "gate_up", "down+silu"} <= set(shapes) else []
    print("\nshape        N x K      config          rows<=  us saved over the rows (sum)")
    for r in results:
        print(f"{r['shape']:10s} {r['N']:6d}x{r['K']:<5d} {str(r['chosen']):15s} "
              f"{r['max_rows']:5d}  {r['saved_us_over_rows']:.2f}")
    literal = table_literal(table)
    print("\n# Paste into models/_linear.py (replacing SKINNY_TABLE):\n" + literal)
    path = os.path.join(os.environ.get("OUT", "/tmp"), "skinny.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"device": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(),
                   "torch": torch.__version__,
                   "triton": triton.__version__, "shapes": results, "layer": layer,
                   "table": {repr(k): v for k, v in table.items()}, "table_literal": literal,
                   "seconds": time.perf_counter() - t0}, f, indent=1)
    # The same table as a file SPECLOOP_SKINNY_TABLE can point at (models/_linear.py).
    with open(os.path.join(os.path.dirname(path), "skinny_table.json"), "w") as f:
        json.dump({f"{n},{k},{int(silu)}": None if v is None else list(v)
                   for (n, k, silu), v in table.items()}, f, indent=1)
    print(f"\nwrote {path}, skinny_table.json ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
