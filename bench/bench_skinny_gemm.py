"""H200: the skinny-GEMM Triton kernel (models/_skinny) against cuBLAS (F.linear) for
SmolLM2-135M's GEMMs, its EAGLE-3 head's and the LM heads, 1..32 rows, as a captured step
sees them: each timing replays a CUDA graph of >= 50 back-to-back calls (time / calls),
each call on its own copy of the weight, >= 128 MiB of copies in all, so the weights
stream from HBM as in a step over 30 layers, not from L2. No model weights needed (random
bf16 of the real shapes).

Per shape: cuBLAS at each row count, then every configuration of the sweep and the code
table's at every row count, and, around the chosen ones, half and twice their warps (tl.dot:
num_stages 2 / 4); each result is checked against F.linear (bf16 tolerance; one that fails
is reported, never chosen). For qkv and gate-up, whose add + RMSNorm ``norm_linear`` may take
into the GEMM's prologue (where a table gives them a fusable prefix; the shipped one does
at 1 row), also the add_rms_norm kernel and each fusable configuration on
the norm kernel: there cuBLAS costs cuBLAS + add_rms_norm, a fusable class its norm
kernel's time, any other class its time + add_rms_norm.

Bit classes: a shape may run different configurations for different row ranges only if
they give a row the same bits (padded graphs and chained steps must equal the eager call),
or, a tl.dot tail after them, F.linear's (as cuBLAS above the ranges would).
Configurations that sum over K in the same order do, whatever the family, BLOCK_N or
tile_m (the compiled split of K: 8 a thread x 32 lanes x BLOCK_K/256 warps, extra warps
along N where BLOCK_N >= 2; the norm kernel's RMS sum has them all along K); the bench
measures it: each
configuration's 32-row output (the plain kernel, and for shapes without silu the norm
kernel where fusable) is hashed over ``probe_inputs`` (randn, and pairs of K entries whose
products cancel, on which two summation orders differ in ~80% of outputs instead of ~1 in
5,000), and its 1-, 3- and 8-row calls must equal the 32-row call's rows. A class: equal
digests (plain, and norm where fusable). The choice per shape: per class, the fastest
configuration at each timed row count (the previous range's kept if within 1%), and the
class and row limit R saving the most time summed over the timed rows <= R (1, 2, 4 and 8
rows weigh the same: decode and VERIFY at small batches; 16 and 32 half), by >= 3% of
cuBLAS's, cuBLAS above R: ranges ((1, v...), (2, b2...), (8, b4...)) for SKINNY_TABLE.
Or a class's configurations without tl.dot up to R1, then up to R2 a tail of tl.dot
configurations whose plain digest is F.linear's (``cublas_tail``: they stand in for cuBLAS
there, models/_linear's rule), picked the same way, if that saves more; for qkv and
gate-up the prefix's rows cost the norm kernel's time where fusable, the tail's the
tl.dot time + add_rms_norm (models/_linear runs the norm apart there).
The fused silu-down shape's baseline is what it replaces: _kernels.silu_mul + F.linear.
Then a SmolLM2 layer without attention (add + RMSNorm, qkv, o, add + RMSNorm, gate-up,
SwiGLU, down) over 30 layers' weights, at 1, 4, 5 and 8 rows: cuBLAS, the dispatcher's table
as in the code, the table this run chose, and that with the norms in the GEMMs' prologue
(SPECLOOP_SKINNY_NORM's path).

Prints per shape and rows cuBLAS against the chosen config (and the fastest config at that
row count), and the SKINNY_TABLE literal to paste into models/_linear.py; writes JSON to
$OUT/skinny.json (OUT defaults to /tmp). Triton compiles happen first, in parallel worker
processes (Triton's on-disk cache then serves this process): a few hundred kernels,
estimated 10-30 s cold on 16 cores (0.2 s each on this repository's CPU box).

    python bench/bench_skinny_gemm.py            # everything (< 90 s on one H200)
    python bench/bench_skinny_gemm.py --rows 1,4 --shapes qkv,down+silu --no-refine
    # the choice again from an earlier run's timings and a bit-class file (CPU, no GPU):
    python bench/bench_skinny_gemm.py --offline skinny.json --bits bits.json
    # a table's configurations split K alike per shape (offline sm_90 compiles, CPU):
    python bench/bench_skinny_gemm.py --layouts [skinny_table.json]
    # every kernel a table may launch, its registers and spills (offline sm_90, CPU):
    python bench/bench_skinny_gemm.py --resources [skinny_table.json]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
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
# Shapes swept only when named (--shapes): the down projection on the activation
# (norm_mlp's GLU path), whose rows run the silu entry's configurations without the
# prologue -- to time those and find a tl.dot tail of cuBLAS's bits above its 8 rows.
EXTRA_SHAPES = {"down": (576, 1536, False)}
# norm_linear's shapes: the fused layer's add + RMSNorm may run in their prologue (where the
# table's prefix for them is norm-fusable).
NORM_SHAPES = ("qkv", "gate_up")
# 3, 5 and 6: VERIFY at batch 1 (eagle3 K = 2, n-gram K = 4, eagle3 K = 5), where a range
# ending at 4 sends a 5-row call to cuBLAS.
ROWS = (1, 2, 3, 4, 5, 6, 8, 16, 32)
PROBE_ROWS = 32
# The norm kernel's RMS sum over K can differ between classes in its last bit, which shows
# in a row's output only where it flips the rounding of a normed element (~6 randn rows in
# 10,000): the norm probe takes rows where that can happen (norm_probe_rows), many of them
# (the same compile as 32 rows: block_m 8).
NORM_PROBE_ROWS = 256
# add_rms_norm's time where it is not measured (--offline): the H200 layer figures, the
# table with and without the norms in the prologue at 1 row (two norms, 3.1 us).
NORM_US_OFFLINE = 1.56
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
    """The configurations tried for K (SkinnyConfig; each timed at every row count, as a
    shape's row ranges may take any configurations of one bit class). Without tl.dot, all of K in one pass (BLOCK_K = K
    rounded up to a power of two; a pass is not software-pipelined), at the fewest warps
    keeping the fp32 product within 64 registers a thread: ``v`` (rows reduced one after
    the other) at BLOCK_N 1..8, and K over 2 programs at BLOCK_N 8 (fp32 partials, a reduce
    kernel); ``b`` (a block of 2, 4 or 8 rows reduced in one reduction, [rows, BN, BK];
    2: less wasted on masked rows at 1 row) at BLOCK_N 1..4, BLOCK_K / 256 warps; tl.dot from 16-row tiles, pipelined over K.
    Pruned to what won or came close on the H200 (v at BLOCK_K/4, BLOCK_N 4 at BLOCK_K/2
    and three tl.dot tiles never did), so the bench stays < 90 s."""
    from specloop.models._linear import one_pass_block_k
    from specloop.models._skinny import SkinnyConfig as C
    full = one_pass_block_k(k)
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
    # tl.dot over all of K in one tile (``ONE_PASS``: W loaded before PDL's wait), whose
    # cost barely grows with the rows: 5-row VERIFY (n-gram K = 4) and batches 2+. Only up
    # to BLOCK_K 1024: at 2048 the tile held across the wait spills (offline sm_90: 3-5 KiB
    # of stack a thread, 17 KiB with the SwiGLU prologue; the H200 timed 4.1 and 718 us).
    if full <= 1024:
        out += [C(True, n, full, 1, w, 1) for n, w in [(16, 4), (16, 8), (32, 8), (64, 8)]]
    return out


def variants(cfg) -> list:
    """Around a chosen config: half and twice its warps, and for tl.dot num_stages 2 / 4
    (the broadcast path's single pass has nothing to pipeline, nor has the one-tile tl.dot:
    the sweep gives those num_stages 1, and their 2- and 4-stage twins compile alike)."""
    out = [cfg._replace(num_warps=w) for w in (cfg.num_warps // 2, cfg.num_warps * 2)
           if 2 <= w <= 16]
    if cfg.dot and cfg.num_stages != 1:
        out += [cfg._replace(num_stages=2), cfg._replace(num_stages=4)]
    return out


def compile_key(cfg, rows: int, k: int, act: bool, norm: bool = False) -> tuple:
    """What makes Triton compile apart (M is not specialised; N, K, strides are all
    multiples of 16 here): the block sizes as launched, the K programs, the flags, the
    kernel (norm: the RMSNorm-prologue kernel, always with its residual add)."""
    split, _ = cfg.k_splits(k)
    return (cfg, cfg.block_m(rows), split, act, norm)


def _compile_tasks(tasks: list) -> int:
    """Worker: run each (rows, N, K, act, cfg, norm) once, so Triton compiles it into its
    cache."""
    from specloop.models._skinny import skinny_linear, skinny_norm_linear
    done = 0
    for rows, n, k, act, cfg, norm in tasks:
        x = torch.zeros(rows, 2 * k if act else k, dtype=torch.bfloat16, device="cuda")
        w = torch.zeros(n, k, dtype=torch.bfloat16, device="cuda")
        try:   # one that cannot compile is reported by the timing loop, not here
            if norm:
                skinny_norm_linear(x, x, x[0], 1e-5, w, None, cfg)
            else:
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
        key = compile_key(t[4], t[0], t[2], t[3], t[5])
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


def probe_inputs(n: int, k: int, act: bool, device: str, dtype: torch.dtype,
                 rows: int = PROBE_ROWS, seed: int = 0) -> list[tuple]:
    """Inputs (x [rows, K or 2K], w [N, K], norm weight [K]) on which two configurations
    that sum over K in different orders give different bits: randn as in the timings (two
    orders differ in ~1 bf16 output in 5,000 there, too few to tell classes of a small
    shape apart), and pairs: K's entries in random pairs, x (both halves of a gate-up row)
    and the norm weight equal within a pair and w's of opposite sign, so every product
    cancels its partner's and the output is what the fp32 partial sums' rounding left,
    which depends on the order (~80% of outputs differ; CPU emulation of two reduction
    trees over K = 576)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    width = 2 * k if act else k
    x = torch.randn(rows, width, device=device, generator=gen).to(dtype)
    w = (torch.randn(n, k, device=device, generator=gen) * 0.05).to(dtype)
    nw = (torch.rand(k, device=device, generator=gen) + 0.5).to(dtype)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed)).to(device)
    a, b = perm[:k // 2], perm[k // 2:2 * (k // 2)]
    xp, wp, nwp = x.clone(), w.clone(), nw.clone()
    for half in range(width // k):
        xp[:, half * k + b] = xp[:, half * k + a]
    wp[:, b] = -wp[:, a]
    nwp[b] = nwp[a]
    return [(x, w, nw), (xp, wp, nwp)]


@functools.lru_cache(maxsize=None)      # per K: ~1 s of CPU each
def norm_probe_rows(k: int, rows: int, dtype: torch.dtype, seed: int = 1,
                    eps: float = 1e-5) -> torch.Tensor:
    """x [rows, k] on which two orders of the norm kernel's RMS sum give different bits:
    randn rows (drawn on the CPU) kept only where some element's x * rsqrt(mean(x^2) + eps)
    lies within two fp32 ulps of a rounding midpoint of ``dtype``, so the last bit of the
    RMS sum, which the order changes in ~30% of rows, can flip a normed element's rounding:
    ~5% of these rows show it, ~6 in 10,000 plain randn rows (CPU emulation of two
    reduction trees over K = 576, 8 x 32 x 4 against 4 x 32 x 8)."""
    gen = torch.Generator().manual_seed(seed)
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]   # mantissa bits
    kept: list[torch.Tensor] = []
    have = 0
    while have < rows:
        x = torch.randn(8192, k, generator=gen).to(dtype)
        xd = x.double()
        inv = 1.0 / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
        frac, _ = torch.frexp(xd * inv)                     # |frac| in [0.5, 1): 2^(mant+1) steps
        off = (frac.abs() * 2.0 ** (mant + 1)) % 1.0 - 0.5   # in dtype ulps; 0: on a midpoint
        risky = (off.abs() * 2.0 ** (23 - mant) < 2.0).any(-1)      # within 2 fp32 ulps
        kept.append(x[risky])
        have += int(risky.sum())
    return torch.cat(kept)[:rows]


_WEIGHTS: dict = {}


def _digest(ys: list[torch.Tensor]) -> str:
    """A hash of the outputs' bits: each row's 16-bit values weighted by fixed random odd
    int64s and summed on the device (wrapping: one changed value always changes the sum),
    so a 1024 x 49,152 output is not copied to the host."""
    h = hashlib.sha1()
    for y in ys:
        n = y.shape[-1]
        key = (n, y.device)
        if key not in _WEIGHTS:
            gen = torch.Generator().manual_seed(n)
            _WEIGHTS[key] = (torch.randint(-2 ** 62, 2 ** 62, (n,), generator=gen) | 1).to(y.device)
        rows = (y.reshape(-1, n).view(torch.int16).to(torch.int64) * _WEIGHTS[key]).sum(-1)
        h.update(rows.cpu().numpy().tobytes())
    return h.hexdigest()[:12]


def bit_classes(n: int, k: int, act: bool, configs: list, inputs: list,
                norm_inputs: list | None = None) -> dict:
    """tag -> (plain digest, norm digest or None): each configuration's 32-row outputs over
    ``inputs`` hashed, the plain kernel's and (no silu, ``norm_fusable``) the norm
    kernel's over ``inputs`` + ``norm_inputs`` (a zero residual delta: the add is
    elementwise, the same in every class); 'varies' where a 1-, 3- or 8-row call's rows
    differ from the 32-row call's, 'error: ...' where it fails. Also 'cublas': F.linear's
    (and on add_rms_norm's output)."""
    from specloop.models._kernels import add_rms_norm, silu_mul
    from specloop.models._skinny import norm_fusable, skinny_linear, skinny_norm_linear
    norm_inputs = inputs + (norm_inputs or [])
    out = {"cublas": (_digest([F.linear(silu_mul(x) if act else x, w) for x, w, _ in inputs]),
                      None if act else _digest([F.linear(add_rms_norm(x, None, nw, 1e-5)[0], w)
                                                for x, w, nw in norm_inputs]))}
    for cfg in configs:
        try:
            ys = []
            for x, w, _ in inputs:
                y = skinny_linear(x, w, None, cfg, silu_mul=act)
                if any(not torch.equal(skinny_linear(x[:m], w, None, cfg, silu_mul=act), y[:m])
                       for m in (1, 3, 8)):
                    out[cfg.tag()] = ("varies", None)
                    break
                ys.append(y)
            else:
                norm = None
                if not act and norm_fusable(cfg, k):
                    norm = _digest([skinny_norm_linear(x, torch.zeros_like(x), nw, 1e-5, w,
                                                       None, cfg)[0] for x, w, nw in norm_inputs])
                out[cfg.tag()] = (_digest(ys), norm)
        except Exception as e:  # noqa: BLE001 - e.g. out of resources: never chosen
            out[cfg.tag()] = (f"error: {type(e).__name__}", None)
    return out


def class_key(digests: tuple) -> tuple | None:
    """The class a configuration belongs to (None: it may not be chosen)."""
    plain, norm = digests
    return None if plain == "varies" or plain.startswith("error") else (plain, norm)


def cublas_tail(classes: dict) -> list:
    """The tags that may form a tail (models/_linear): tl.dot configurations whose plain
    digest is F.linear's (``classes``: bit_classes' tag -> digests). The plain kernel's
    alone: a tail's rows run add_rms_norm and then the plain GEMM, as F.linear's do."""
    ref = classes.get("cublas", (None, None))[0]
    return sorted(t for t, d in classes.items() if t != "cublas" and _is_dot(t)
                  and class_key(d) is not None and d[0] == ref)


def row_weight(rows: int) -> float:
    """How much a row count's saving counts in ``choose``: decode (1 row a sequence) and
    VERIFY at small batches (K + 1 = 2..8 rows) equally, larger batches half."""
    return 1.0 if rows <= 8 else 0.5


KEEP = 0.01   # a range keeps the previous range's configuration if within 1% of the fastest


def _is_dot(tag: str) -> bool:
    """The tag's configuration runs tl.dot (SkinnyConfig.tag()'s family letter ``d``)."""
    return tag.startswith("d")


def _greedy(tags: list, times: dict, cublas: dict, rows_list: list, picks: tuple = ()):
    """Over ``rows_list`` (ascending timed row counts) the fastest of ``tags`` at each (the
    previous range's kept within KEEP), appended to ``picks``: yields (ranges, weighted us
    saved, weighted cuBLAS us) after each row count, stopping at the first none of
    ``tags`` ran."""
    out = list(picks)
    saved = base = 0.0
    for rows in rows_list:
        ok = [t for t in tags if isinstance(times[t].get(rows), float)]
        if not ok:
            return
        tag = min(ok, key=lambda t: times[t][rows])
        if out and out[-1][1] in ok and times[out[-1][1]][rows] <= (1 + KEEP) * times[tag][rows]:
            tag = out[-1][1]
        saved += row_weight(rows) * (cublas[rows] - times[tag][rows])
        base += row_weight(rows) * cublas[rows]
        if out and out[-1][1] == tag:
            out[-1] = (rows, tag)
        else:
            out.append((rows, tag))
        yield tuple(out), saved, base


def choose(cublas: dict, times: dict, classes: dict, tail=()) -> tuple[tuple | None, float]:
    """-> (((max rows, tag), ...), weighted us saved over the timed rows) or (None, 0.0):
    the configurations of one bit class (``classes``: tag -> key; tags without one are
    never chosen), the fastest of the class at each timed row count covering the rows
    above the previous timed count, up to the row limit saving the most over ``cublas``
    (by >= 3% of its time there), each timed row count's saving weighted by
    ``row_weight``; a class's rows stop at the first row count none of its configurations
    ran. Or (models/_linear's prefix + tail) a class's configurations without tl.dot up to
    R1, then from R1 + 1 up to R2 the fastest of ``tail`` (tl.dot configurations in
    cuBLAS's bit class: F.linear's bits), the same way; the tail's rows stop at the first
    row count none of ``tail`` ran. A class's tl.dot and other configurations are never
    mixed otherwise (models/_linear: a tl.dot range only in the tail). Of equal savings the
    first found is kept: single classes (in key order) before prefix + tail, shorter
    before longer."""
    by_class: dict = {}   # a class's tl.dot configurations apart (only a tail may be tl.dot)
    for tag, key in classes.items():
        if key is not None and tag in times:
            by_class.setdefault((key, _is_dot(tag)), []).append(tag)
    rows_list = sorted(cublas)
    best: tuple[tuple | None, float] = (None, 0.0)

    def consider(picks: tuple, saved: float, base: float) -> None:
        nonlocal best
        if saved > best[1] and saved >= (1 - WIN) * base:
            best = (picks, saved)

    for key in sorted(by_class, key=repr):
        for run in _greedy(sorted(by_class[key]), times, cublas, rows_list):
            consider(*run)
    tail = sorted(t for t in tail if t in times and _is_dot(t))
    if tail:
        for run in _greedy(tail, times, cublas, rows_list):     # R1 = 0: the tail alone
            consider(*run)
        for key in sorted(by_class, key=repr):
            if key[1]:
                continue
            for i, (picks, saved, base) in enumerate(
                    _greedy(sorted(by_class[key]), times, cublas, rows_list)):
                for more, t_saved, t_base in _greedy(tail, times, cublas,
                                                     rows_list[i + 1:], picks):
                    consider(more, saved + t_saved, base + t_base)
    return best


def effective(cublas: dict, times: dict, norm_us: dict | None, norm_times: dict, k: int
              ) -> tuple[dict, dict]:
    """-> (baseline, times) as ``choose`` weighs them: for a shape whose norm runs in the
    prologue (``norm_us``: add_rms_norm's time per rows), cuBLAS + add_rms_norm, a
    norm-fusable configuration's norm-kernel time where measured (``norm_times``; else,
    --offline, its plain time), any other its time + add_rms_norm (a tl.dot tail's rows
    too: models/_linear runs add_rms_norm before it; an older run's norm-kernel times of
    a configuration no longer fusable, such as the tl.dot prologue of 13:20, are not
    used)."""
    if norm_us is None:
        return cublas, times
    from specloop.models._linear import parse_config
    from specloop.models._skinny import norm_fusable
    eff: dict = {}
    for tag, per in times.items():
        fusable = norm_fusable(parse_config(tag), k)
        eff[tag] = {}
        for rows, us in per.items():
            if fusable and tag in norm_times:
                eff[tag][rows] = norm_times[tag].get(rows, "not timed")
            elif isinstance(us, float) and rows in norm_us:
                eff[tag][rows] = us if fusable else us + norm_us[rows]
            else:
                eff[tag][rows] = us
    return {r: us + norm_us[r] for r, us in cublas.items() if r in norm_us}, eff


def code_configs(n: int, k: int, act: bool) -> list:
    """The configurations the code's table runs for the shape (every range's)."""
    from specloop.models._linear import skinny_config
    out = []
    for rows in range(1, 33):
        cfg = skinny_config(rows, n, k, act)
        if cfg is not None and cfg not in out:
            out.append(cfg)
    return out


def bench_shape(name: str, n: int, k: int, act: bool, rows_list, refine: bool) -> dict:
    from specloop.models._kernels import add_rms_norm, silu_mul
    from specloop.models._linear import parse_config
    from specloop.models._skinny import norm_fusable, skinny_linear, skinny_norm_linear
    norm_shape = name in NORM_SHAPES and not act
    wbytes = n * k * 2
    copies = max(2, math.ceil(L2_FLUSH_BYTES / wbytes))
    calls = 2 if SMOKE else min(MAX_CALLS, max(MIN_CALLS, copies))
    copies = min(copies, calls)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    ws = [(torch.randn(n, k, device=DEVICE, generator=gen) * 0.05).to(DTYPE)
          for _ in range(copies)]
    xs = {rows: torch.randn(rows, 2 * k if act else k, device=DEVICE, generator=gen).to(DTYPE)
          for rows in rows_list}
    deltas = {rows: torch.randn(rows, k, device=DEVICE, generator=gen).to(DTYPE)
              for rows in rows_list}
    nw = (torch.rand(k, device=DEVICE, generator=gen) + 0.5).to(DTYPE)
    last = ws[(calls - 1) % copies]
    refs = {rows: F.linear(silu_mul(x) if act else x, last) for rows, x in xs.items()}
    cublas, norm_us = {}, {} if norm_shape else None
    for rows, x in xs.items():
        if act:
            cublas[rows], _ = time_graph(lambda i: F.linear(silu_mul(x), ws[i % copies]), calls)
        else:
            cublas[rows], _ = time_graph(lambda i: F.linear(x, ws[i % copies]), calls)
        if norm_shape:
            norm_us[rows], _ = time_graph(
                lambda i: add_rms_norm(x, deltas[rows], nw, 1e-5)[0], calls)
    norm_refs = {rows: F.linear(add_rms_norm(x, deltas[rows], nw, 1e-5)[0], last)
                 for rows, x in xs.items()} if norm_shape else {}
    times: dict[str, dict[int, float | str]] = {}
    norm_times: dict[str, dict[int, float | str]] = {}
    inputs = probe_inputs(n, k, act, DEVICE, DTYPE)
    norm_inputs = None
    if not act:
        _, w1, nw1 = probe_inputs(n, k, act, DEVICE, DTYPE, rows=1, seed=1)[0]
        norm_inputs = [(norm_probe_rows(k, 8 if SMOKE else NORM_PROBE_ROWS, DTYPE).to(DEVICE),
                        w1, nw1)]
    classes: dict[str, tuple] = {}

    def timed(fn, ref) -> float | str:
        try:
            us, y = time_graph(fn, calls)
            return us if close(y, ref) else "mismatch"
        except Exception as e:  # noqa: BLE001 - e.g. out of resources: report it
            return f"error: {type(e).__name__}: {str(e)[:80]}"

    def run(cfgs):
        new = [c for c in cfgs if c.tag() not in times]
        for cfg in new:
            times[cfg.tag()] = {rows: timed(lambda i: skinny_linear(
                x, ws[i % copies], None, cfg, silu_mul=act), refs[rows]) for rows, x in xs.items()}
            if norm_shape and norm_fusable(cfg, k):
                norm_times[cfg.tag()] = {rows: timed(lambda i: skinny_norm_linear(
                    x, deltas[rows], nw, 1e-5, ws[i % copies], None, cfg)[0], norm_refs[rows])
                    for rows, x in xs.items()}
        classes.update(bit_classes(n, k, act, new, inputs, norm_inputs))

    def pick():
        base, eff = effective(cublas, times, norm_us, norm_times, k)
        keys = {t: class_key(d) for t, d in classes.items() if t != "cublas"}
        return choose(base, eff, keys, cublas_tail(classes)) + (base, eff)

    code = code_configs(n, k, act)          # what the code's table runs now
    swept = sweep(k)
    configs = swept + [c for c in code if c not in swept]
    if SMOKE:   # one of each family without tl.dot, the fewest programs (interpreted)
        configs = [max((c for c in configs if not c.dot and not c.tile_m),
                       key=lambda c: (c.block_n, c.block_k)),
                   max((c for c in configs if c.tile_m), key=lambda c: c.tile_m * c.block_n)]
    run(configs)
    ranges, saved, base, eff = pick()
    if refine and ranges:
        run([v for _, tag in ranges for v in variants(parse_config(tag))])
        ranges, saved, base, eff = pick()
    per_row_best = {}
    for rows in rows_list:
        ok = {t: per[rows] for t, per in eff.items() if isinstance(per.get(rows), float)}
        per_row_best[rows] = min(ok, key=ok.__getitem__) if ok else None
    failed = sorted(t for t, per in list(times.items()) + list(norm_times.items())
                    if any(not isinstance(v, float) for v in per.values()))
    varies = sorted(t for t, d in classes.items() if class_key(d) is None)
    what = "cuBLAS + add_rms_norm" if norm_shape else "cuBLAS"
    for rows in rows_list:
        tag = next((t for r, t in ranges or () if rows <= r), None)
        pick_us = eff[tag][rows] if tag else None
        fastest = per_row_best[rows]
        print(f"{name:10s} {n:6d}x{k:<5d} M={rows:<3d} {what} {base[rows]:6.2f} us  "
              + (f"{tag} {pick_us:6.2f} us x{pick_us / base[rows]:.2f}" if tag else "cuBLAS")
              + (f"  (fastest at this M: {fastest} {eff[fastest][rows]:.2f} us)"
                 if fastest else ""), flush=True)
    if failed:
        print(f"{name}: {len(failed)} configs failed somewhere: {failed[:4]}", flush=True)
    if varies:
        print(f"{name}: rows NOT the same bits in calls of 1/3/8 vs 32 rows, or failed: "
              f"{varies}", flush=True)
    groups: dict = {}
    for t, d in classes.items():
        if class_key(d) is not None:
            groups.setdefault(class_key(d), []).append(t)
    tail = cublas_tail(classes)
    print(f"{name}: {len(groups)} bit classes; tl.dot with cuBLAS's bits (a tail may take "
          f"them): {tail}", flush=True)
    del ws
    if not SMOKE:
        torch.cuda.empty_cache()
    return {"shape": name, "N": n, "K": k, "silu_mul": act, "calls": calls,
            "cublas_us": cublas, "norm_us": norm_us,
            "code_configs": [c.tag() for c in code],
            "ranges": [list(r) for r in ranges] if ranges else None,
            "saved_us_over_rows": saved, "fastest_per_rows": per_row_best,
            "configs": times, "norm_configs": norm_times,
            "bit_classes": sorted(sorted(g) for g in groups.values()), "cublas_tail": tail,
            "not_row_invariant_or_failed": varies}


def table_from(results: list[dict]) -> dict:
    return {(r["N"], r["K"], r["silu_mul"]):
            tuple(tuple(x) for x in r["ranges"]) if r["ranges"] else None for r in results}


def table_literal(table: dict) -> str:
    lines = ["SKINNY_TABLE: dict[tuple[int, int, bool], SkinnyRanges | None] = {"]
    for key, entry in table.items():
        if entry is None:
            lines.append(f"    {key!r}: None,")
            continue
        head = f"    {key!r}: ("
        parts = [f"{r!r}" for r in entry] + ([""] if len(entry) == 1 else [])
        line = head
        for i, part in enumerate(parts):
            sep = ", " if i < len(parts) - 1 else ""
            piece = part + sep if part else ""
            if len(line) + len(piece.rstrip()) > 88 and line != head:
                lines.append(line.rstrip())
                line = " " * len(head)
            line += piece
        lines.append(line.rstrip().rstrip(",") + ("," if len(entry) == 1 else "") + "),")
    lines.append("}")
    return "\n".join(lines)


def table_json(table: dict) -> dict:
    """The table as the file SPECLOOP_SKINNY_TABLE reads (models/_linear.py)."""
    return {f"{n},{k},{int(silu)}": None if v is None else [list(r) for r in v]
            for (n, k, silu), v in table.items()}


def classes_from_bits(bits: dict) -> dict[str, dict[str, tuple]]:
    """--offline: shape -> tag -> class key from a bit-class file (``groups`` and
    ``norm_groups`` per shape: lists of tags with equal digests, the form
    .dev/lead/probe_bits.py wrote). One random input can miss a difference (two orders
    differ in ~1 output in 5,000), so two tags share a class only where they shared a group
    in every shape measured with the same BLOCK_K rounding of K (the same tag is the same
    code there: K only masks)."""
    from specloop.models._linear import one_pass_block_k
    full = {name: one_pass_block_k(SHAPES[name][1]) for name in bits if name in SHAPES}
    out = {}
    for name in full:
        same = [s for s in full if full[s] == full[name]]
        key: dict[str, list] = {}
        for kind in ("groups", "norm_groups"):
            for s in same:
                for i, group in enumerate(bits[s].get(kind, [])):
                    for tag in group:
                        if "!" not in tag:
                            key.setdefault(tag, []).append((kind, s, i))
        plain = {t for g in bits[name]["groups"] for t in g if "!" not in t}
        out[name] = {t: (tuple(sorted(x for x in key[t] if x[0] == "groups")),
                         tuple(sorted(x for x in key[t] if x[0] == "norm_groups")) or None)
                     for t in plain}
    return out


def offline(skinny_path: str, bits_path: str | None) -> dict:
    """The choice again from an earlier run's skinny.json: its timings, and its bit classes
    (this bench's ``bit_classes``) or a bit-class file's (``classes_from_bits``); norm
    shapes: its add_rms_norm and norm-kernel timings where it has them (this bench), else
    add_rms_norm as NORM_US_OFFLINE and a fusable configuration's norm kernel as its plain
    time (the 09:47 run did not time them)."""
    with open(skinny_path) as f:
        run = json.load(f)
    classes: dict = {}
    if bits_path:
        with open(bits_path) as f:
            classes = classes_from_bits(json.load(f))
    table = {}
    for r in run["shapes"]:
        name = r["shape"]

        def ints(per: dict) -> dict:
            return {int(rows): us for rows, us in per.items()}
        cublas = ints(r["cublas_us"])
        times = {t: ints(per) for t, per in r["configs"].items()}
        norm_times = {t: ints(per) for t, per in (r.get("norm_configs") or {}).items()}
        norm_us = None
        if name in NORM_SHAPES and not r["silu_mul"]:
            norm_us = ints(r["norm_us"]) if r.get("norm_us") else \
                {rows: NORM_US_OFFLINE for rows in cublas}
        base, eff = effective(cublas, times, norm_us, norm_times, r["K"])
        if bits_path:
            keys = {t: classes.get(name, {}).get(t) for t in times}   # None: not measured
            ref = classes.get(name, {}).get("cublas")
            tail = [t for t in times if ref is not None and _is_dot(t)
                    and keys[t] is not None and keys[t][0] == ref[0]]
        elif "bit_classes" not in r:
            sys.exit(f"{skinny_path} has no bit classes (a run before they were measured): "
                     "give --bits")
        else:     # this bench's own: groups of equal digests
            keys = {t: i for i, group in enumerate(r["bit_classes"]) for t in group}
            # cuBLAS's tl.dot tags; a run before "cublas_tail": those grouped with
            # 'cublas' (plain and norm digests equal: stronger). Without silu, cuBLAS has a
            # norm digest and tl.dot one only where the run took it into the norm prologue
            # (13:20): the 13:08 run's qkv, o and gate-up give none, whatever their plain bits.
            tail = r.get("cublas_tail", [t for g in r["bit_classes"] if "cublas" in g
                                         for t in g if _is_dot(t)])
        ranges, saved = choose(base, eff, keys, tail)
        table[(r["N"], r["K"], r["silu_mul"])] = ranges
        print(f"{name:10s} {ranges}  saved {saved:.2f} us (weighted, over the timed rows); "
              f"tail candidates (cuBLAS's bits): {sorted(tail) or 'none'}")
        for rows in sorted(cublas):
            tag = next((t for m, t in ranges or () if rows <= m), None)
            print(f"   M={rows:<3d} base {base[rows]:6.2f}  "
                  + (f"{tag} {eff[tag][rows]:6.2f}" if tag else "cuBLAS"))
    return table


def bench_layer(table: dict | None, layers: int = 30) -> list[dict]:
    """A SmolLM2 layer without attention: add + RMSNorm, qkv, o, add + RMSNorm, gate-up,
    SwiGLU, down, over ``layers`` layers' weights, through the dispatcher: cuBLAS, the
    code's table, this run's table, and this run's with the norms in the GEMMs' prologue
    (``skinny_norm``), each with SwiGLU in the down GEMM's prologue; then with the norms
    and SwiGLU in the gate-up GEMM's epilogue (``glu``, ``norm_mlp``): us per layer.
    ``table`` None (``--layer-only``): the code's table for "this run's"."""
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
    for rows in (1, 4, 5, 8):
        x = torch.randn(rows, H, device=DEVICE, generator=gen).to(DTYPE)
        delta = torch.randn(rows, H, device=DEVICE, generator=gen).to(DTYPE)
        o_in = torch.randn(rows, H, device=DEVICE, generator=gen).to(DTYPE)
        res = {}
        for name, skinny, tab, norm, glu in (
                ("cublas", False, None, False, False),
                ("code table", True, None, False, False),
                ("bench table", True, table, False, False),
                ("bench table + norms", True, table, True, False),
                ("bench table + norms + glu", True, table, True, True)):
            lin = PackedLinear(skinny=skinny)
            lin.skinny_on_cpu, lin.skinny_norm, lin.glu = SMOKE, norm, glu
            saved = dict(_linear.SKINNY_TABLE)
            if tab is not None:
                _linear.SKINNY_TABLE.update(tab)

            def step(i, lin=lin):
                wqkv, wo, wgu, wd = weights[i]
                _, stream = lin.norm_linear(x, delta, norm_w, 1e-5, wqkv)
                return lin.norm_mlp(stream, lin(o_in, wo), norm_w, 1e-5, wgu, wd)[0]
            try:
                res[name], _ = time_graph(step, layers)
            finally:
                _linear.SKINNY_TABLE.clear()
                _linear.SKINNY_TABLE.update(saved)
        print(f"layer without attention M={rows}: " + ", ".join(
            f"{k} {v:.2f} us" for k, v in res.items())
            + f"  -> x{res['bench table'] / res['cublas']:.2f}, with norms "
              f"x{res['bench table + norms'] / res['cublas']:.2f}, + glu "
              f"x{res['bench table + norms + glu'] / res['cublas']:.2f}", flush=True)
        out.append({"rows": rows, "us_per_layer": res})
    return out


def compile_offline(cfg, k: int, act: bool = False, norm: bool = False, glu: bool = False):
    """The kernel compiled offline for sm_90 (no GPU; Triton's own toolchain) as the device
    launches ``cfg`` for K = ``k`` (pointers, N, K and strides divisible by 16: the launch
    specialises them, and without that every layout differs; GDC with launch_pdl, as on
    an H200, samplers/_pdl.py): ``_norm_skinny_kernel`` if ``norm``, else
    ``_skinny_kernel`` (``act``: the silu-mul prologue), ``glu``: the SwiGLU epilogue.
    -> Triton's compiled kernel (``asm`` holds its TTGIR and PTX)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specloop.models import _skinny
    fn = _skinny._norm_skinny_kernel if norm else _skinny._skinny_kernel
    split, _ = cfg.k_splits(k)
    const = dict(HAS_BIAS=False, BLOCK_M=cfg.block_m(8), BLOCK_N=cfg.block_n,
                 BLOCK_K=cfg.block_k, TILE=cfg.tile_m > 0, GDC=True, GLU=glu)
    const.update(dict(HAS_DELTA=True, HAS_COPY=False, ROPE=False, HQ=1, HKV=1, D=2, PAGE=1,
                      TREE=False) if norm else
                 dict(ACT=int(act), DOT=cfg.dot, SPLIT_K=split,
                      ONE_PASS=cfg.one_pass(k), PIECE=_skinny.one_pass_piece(cfg, k),
                      RES=False, NORM=False, SLICES=cfg.slices_for(k),
                      SLICE_PROGRAMS=cfg.slice_grid(k)))
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
            continue
        sig[name] = ("*fp32" if name == "p_ptr" or name == "y_ptr" and split > 1 and not norm
                     else "*i32" if name == "cnt_ptr" else "*bf16") \
            if name.endswith("_ptr") else "fp32" if name == "eps" else "i32"
        if name not in ("M", "eps"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg.num_warps,
                                   "num_stages": cfg.num_stages, "launch_pdl": True})


def reduce_splits(cfg, k: int, act: bool = False, norm: bool = False) -> tuple:
    """--layouts: ``compile_offline``'s TTGIR -> how each reduction in it splits the
    reduced axis: ((programs along K,), (extent, elements a thread, lanes, warps), ...).
    Configurations whose splits differ sum in different orders; equal splits are what
    every measured bit class has in common (the device's probe is the arbiter)."""
    import re

    split, _ = cfg.k_splits(k)
    ir = compile_offline(cfg, k, act, norm).asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<\{[^}]*\}>)", ir, re.M))
    out = set()
    for m in re.finditer(r'"tt\.reduce"\(.*?<\{axis = (\d+) : i32\}>.*?\}\) : '
                         r'\(tensor<([^>]*)>', ir, re.S):
        axis, ty = int(m.group(1)), m.group(2)
        dims, enc = ty.split(",")[0].split("x")[:-1], ty.split(",")[-1].strip()
        fields = dict(re.findall(r"(sizePerThread|threadsPerWarp|warpsPerCTA) = \[([^\]]*)\]",
                                 layouts.get(enc, "")))
        if len(fields) < 3:      # not a blocked layout: compare it as text
            out.add((dims[axis], enc))
            continue
        out.add((int(dims[axis]),) + tuple(int(fields[f].split(",")[axis])
                                           for f in ("sizePerThread", "threadsPerWarp",
                                                     "warpsPerCTA")))
    return ((split,),) + tuple(sorted(out, key=repr))


def kernel_resources(compiled) -> dict[str, int]:
    """``compile_offline``'s PTX through Triton's own ptxas for sm_90a with -v ->
    registers a thread, bytes of stack frame, of spill stores and of spill loads."""
    import re
    import subprocess
    import tempfile

    try:
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(90).path
    except ImportError:         # an older Triton: one ptxas
        from triton import knobs
        ptxas = knobs.nvidia.ptxas.path
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        run = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o",
                              os.path.join(tmp, "kernel.cubin")],
                             capture_output=True, text=True, check=True)
    text = run.stdout + run.stderr
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                      r"(\d+) bytes spill loads", text)
    regs = re.search(r"Used (\d+) registers", text)
    if frame is None or regs is None:
        raise RuntimeError(f"ptxas -v said nothing of registers or stack: {text[-500:]}")
    stack, stores, loads = map(int, frame.groups())
    return {"registers": int(regs.group(1)), "stack": stack, "spill_stores": stores,
            "spill_loads": loads}


def launched_variants(shape, n: int, k: int, act: bool):
    """-> (max rows, config, what) for every kernel the dispatcher may launch with a
    resolved table entry (models/_linear): each range's plain GEMM; for a silu entry its
    configurations on the activation without the prologue (``norm_mlp``, and
    ``silu_mul_linear`` on a one-tile tl.dot) and with it where ``prologue_fits``; for
    other shapes of even N the SwiGLU epilogue where the configuration holds whole pairs
    (``_norm_glu``: gate-up), and in the norm-fusable prefix the norm kernel, with GLU
    too."""
    from specloop.models._skinny import glu_fits, prologue_fits
    for max_rows, cfg in shape.ranges:
        yield max_rows, cfg, dict()
        if act:
            if prologue_fits(cfg, k):
                yield max_rows, cfg, dict(act=True)
            continue
        glu = n % 2 == 0 and glu_fits(cfg, k)
        if glu:
            yield max_rows, cfg, dict(glu=True)
        if shape.norm and max_rows <= shape.prefix:
            yield max_rows, cfg, dict(norm=True)
            if glu:
                yield max_rows, cfg, dict(norm=True, glu=True)


def check_resources(table: dict) -> list[str]:
    """--resources: every kernel the dispatcher may launch for the table's configurations
    (``launched_variants``), compiled offline for sm_90 (``kernel_resources``); -> those
    that spill to local memory. (A norm kernel whose stream store sat under ``if pid_n ==
    0`` compiled to 32 registers and ~3 KB of spills a thread and ran ~10x slower on the
    H200: docs/performance-history.md, thirty-second session.)"""
    from specloop.models._linear import _resolve
    problems, seen = [], set()
    for (n, k, act), entry in table.items():
        if not entry:
            continue
        for max_rows, cfg, what in launched_variants(_resolve(entry, k), n, k, act):
            key = (cfg, k, tuple(sorted(what.items())))
            if key in seen:
                continue
            seen.add(key)
            use = kernel_resources(compile_offline(cfg, k, **what))
            label = "+".join(name for name, on in what.items() if on) or "plain"
            spills = use["spill_stores"] + use["spill_loads"] + use["stack"]
            print(f"{n}x{k}{' silu' if act else ''} <= {max_rows:3d} rows {cfg.tag():22s} "
                  f"{label:9s} {use['registers']:3d} registers, stack {use['stack']} B, "
                  f"spills {use['spill_stores']}/{use['spill_loads']} B", flush=True)
            if spills:
                problems.append(f"{(n, k, act)} {cfg.tag()} {label}: {use}")
    return problems


def check_layouts(table: dict) -> list[str]:
    """--layouts: each shape's prefix configurations (its ranges without tl.dot; an entry
    of tl.dot ranges only: all of them) must split K alike in every reduction, plain and
    (no silu, every one norm-fusable) norm kernel; -> problems. A tl.dot tail after a
    prefix must give F.linear's bits, which only the device can tell (the probe, the GPU
    test): listed, not checked."""
    from specloop.models._linear import _resolve
    from specloop.models._skinny import norm_fusable
    problems = []
    for (n, k, act), entry in table.items():
        if not entry:
            continue
        shape = _resolve(entry, k)
        cfgs = list(dict.fromkeys(c for m, c in shape.ranges
                                  if m <= shape.prefix or not shape.prefix))
        tail = [c.tag() for m, c in shape.ranges if shape.prefix and m > shape.prefix]
        if tail:
            print(f"{n}x{k}{' silu' if act else ''}: tail {tail} (cuBLAS's bits: not "
                  "checked here)", flush=True)
        kernels = [False] + ([True] if not act and cfgs and
                             all(norm_fusable(c, k) for c in cfgs) else [])
        for norm in kernels:
            splits = {c.tag(): reduce_splits(c, k, act, norm) for c in cfgs}
            same = len(set(splits.values())) == 1
            print(f"{n}x{k}{' silu' if act else ''}{' norm' if norm else ''}: "
                  f"{'same' if same else 'DIFFERENT'}  "
                  + "; ".join(f"{t} {v}" for t, v in splits.items()), flush=True)
            if not same:
                problems.append(f"{(n, k, act)}{' norm kernel' if norm else ''}: {splits}")
    return problems


def write_out(name: str, rows: dict) -> str:
    """``rows`` with the device and versions as $OUT/``name`` (OUT defaults to /tmp)."""
    import triton
    path = os.path.join(os.environ.get("OUT", "/tmp"), name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"device": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(),
                   "torch": torch.__version__, "triton": triton.__version__, **rows}, f,
                  indent=1)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help=f"of {list(SHAPES) + list(EXTRA_SHAPES)}")
    ap.add_argument("--no-refine", dest="refine", action="store_false",
                    help="skip num_warps / num_stages variants around each best config")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--offline", metavar="SKINNY_JSON",
                    help="no GPU: choose the table again from this earlier run's timings "
                         "(and --bits); prints the literal")
    ap.add_argument("--bits", metavar="BITS_JSON",
                    help="with --offline: bit classes per shape (groups / norm_groups), for "
                         "a skinny.json without its own (before bit classes were measured)")
    ap.add_argument("--layouts", nargs="?", const="code", metavar="TABLE_JSON",
                    help="no GPU: compile each shape's configurations of the code's table (or "
                         "a skinny_table.json) offline for sm_90 and check that they split K "
                         "alike in every reduction; exit 1 if not")
    ap.add_argument("--resources", nargs="?", const="code", metavar="TABLE_JSON",
                    help="no GPU: compile every kernel the dispatcher may launch for the "
                         "code's table (or a skinny_table.json) offline for sm_90 and print "
                         "its registers and spills (ptxas -v); exit 1 if any spills")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU under TRITON_INTERPRET=1: this script's logic on shapes / 8")
    ap.add_argument("--layer-only", action="store_true",
                    help="no sweep: the layer bench on the code's table (+ norms, + glu)")
    args = ap.parse_args()
    global SMOKE, DEVICE, DTYPE
    # The offline checks (CPU): a table's layouts, or its kernels' spills; exit 1 on a problem.
    for source, check, bad, good in ((args.layouts, check_layouts, "layouts differ:",
                                      "all alike"),
                                     (args.resources, check_resources, "spills:",
                                      "no spills")):
        if source:
            from specloop.models import _linear
            table = _linear.SKINNY_TABLE if source == "code" else \
                _linear._table_from_file(source)
            problems = check(table)
            print("\n".join(["", bad] + problems) if problems else "\n" + good)
            sys.exit(1 if problems else 0)
    if args.offline:
        print("\n# Paste into models/_linear.py (replacing SKINNY_TABLE):\n"
              + table_literal(offline(args.offline, args.bits)))
        return
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
    t0 = time.perf_counter()
    if args.layer_only:
        path = write_out("skinny_layer.json", {"layer": bench_layer(None, 2 if SMOKE else 30)})
        print(f"wrote {path} ({time.perf_counter() - t0:.0f} s)")
        return
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = {s: {**SHAPES, **EXTRA_SHAPES}[s] for s in args.shapes.split(",")}
    tasks = []
    from specloop.models._skinny import norm_fusable
    for name, (n, k, act) in shapes.items():
        for cfg in sweep(k) + code_configs(n, k, act):
            for v in [cfg] + (variants(cfg) if args.refine else []):
                tasks += [(rows, n, k, act, v, False) for rows in rows_list]
                if not act and norm_fusable(v, k):   # bit classes (32 rows); qkv, gate-up: timed
                    tasks += [(rows, n, k, act, v, True) for rows in
                              (rows_list if name in NORM_SHAPES else [PROBE_ROWS])]
    if args.workers > 1:
        precompile(tasks, args.workers)
    results = [bench_shape(name, n, k, act, rows_list, args.refine)
               for name, (n, k, act) in shapes.items()]
    table = table_from(results)
    layer = bench_layer(table, 2 if SMOKE else 30) \
        if {"qkv", "o", "gate_up", "down+silu"} <= set(shapes) else []
    print("\nshape        N x K      us saved (weighted sum)  ranges (max rows, config)")
    for r in results:
        print(f"{r['shape']:10s} {r['N']:6d}x{r['K']:<5d} {r['saved_us_over_rows']:6.2f}  "
              f"{r['ranges'] or 'cuBLAS'}")
    literal = table_literal(table)
    print("\n# Paste into models/_linear.py (replacing SKINNY_TABLE):\n" + literal)
    path = write_out("skinny.json", {
        "shapes": results, "layer": layer, "table": {repr(k): v for k, v in table.items()},
        "table_literal": literal, "seconds": time.perf_counter() - t0})
    # The same table as a file SPECLOOP_SKINNY_TABLE can point at (models/_linear.py).
    with open(os.path.join(os.path.dirname(path), "skinny_table.json"), "w") as f:
        json.dump(table_json(table), f, indent=1)
    print(f"\nwrote {path}, skinny_table.json ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
