"""What Programmatic Dependent Launch (PDL, Hopper+) would give a batch-1 decode step.

A decode step at batch 1 is a chain of ~200 small kernels, each waiting for the one before
it; in a CUDA graph on an H200 each skinny GEMM takes 2.3-3.7 us for ~0.3-1.5 us of weight
reads (bench_skinny_gemm.py), the rest being the launch and the first loads' latency. With
PDL a kernel is launched while the one before it still runs: it can load its WEIGHTS (which
no earlier kernel writes) before ``griddepcontrol.wait`` and only then load the
activations the previous kernel wrote (CUTLASS example 63 prefetches weights this way).

This bench builds SmolLM2-135M's 30 layers of decode GEMMs at one row (qkv 960x576,
o 576x576, gate_up 3072x576, down 576x1536, own weights per layer: 212 MB, so they stream
from HBM as in the model; each GEMM reads the previous one's output) with one small Triton
GEMV kernel, captures the 120-kernel chain in a CUDA graph three ways and times replays:

- ``base``: plain launches;
- ``pdl``: launched with PDL, ``gdc_wait`` first (only the launch overlaps);
- ``pdl+prefetch``: launched with PDL, the weight tile loaded before ``gdc_wait``.

It checks that all three give the same bits, and prints us per layer and the ratios. The
engine's kernels now launch the ``pdl+prefetch`` way (``specloop.samplers._pdl``;
``SPECLOOP_PDL=0`` for the plain launches); this bench isolates the effect.

    python bench/bench_pdl.py [--layers 30] [--reps 50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

import triton
import triton.language as tl

# (N, K, BLOCK_N, BLOCK_K, warps): the 1-row configs bench_skinny_gemm.py picked on the H200.
SHAPES = {"qkv": (960, 576, 2, 1024, 4), "o": (576, 576, 2, 1024, 4),
          "gate_up": (3072, 576, 2, 1024, 4), "down": (576, 1536, 8, 2048, 16)}


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          GDC: tl.constexpr, PREFETCH: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn[:, None] * K + rk[None, :]
    w_mask = (rn[:, None] < N) & (rk[None, :] < K)
    if GDC:
        # Let the next kernel launch now: it waits (gdc_wait) before reading our output.
        tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH:
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)     # no earlier kernel writes W
    if GDC:
        tl.extra.cuda.gdc_wait()                        # the previous kernel's output is ready
    if not PREFETCH:
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    x = tl.load(x_ptr + rk, mask=rk < K, other=0.0)
    acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=rn < N)


def chain(weights, x, outs, mode: str) -> None:
    gdc, prefetch = mode != "base", mode == "pdl+prefetch"
    extra = {"launch_pdl": True} if gdc else {}
    h = x
    for layer, outs_l in zip(weights, outs):
        for name, (n, k, bn, bk, warps) in SHAPES.items():
            y = outs_l[name]
            _gemv[(triton.cdiv(n, bn),)](h[:k], layer[name], y, n, k, BLOCK_N=bn, BLOCK_K=bk,
                                         GDC=gdc, PREFETCH=prefetch, num_warps=warps,
                                         **extra)
            h = y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "pdl.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    weights = [{name: torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5
                for name, (n, k, *_) in SHAPES.items()} for _ in range(args.layers)]
    x = torch.randn(576, device=dev, dtype=dt)
    results, final = {}, {}
    for mode in ("base", "pdl", "pdl+prefetch"):
        outs = [{name: torch.empty(n, device=dev, dtype=dt) for name, (n, *_) in
                 SHAPES.items()} for _ in range(args.layers)]
        try:
            chain(weights, x, outs, mode)           # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain(weights, x, outs, mode)
        except Exception as e:  # noqa: BLE001 - a bench: report and go on
            results[mode] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(mode, results[mode], flush=True)
            continue
        times = []
        for _ in range(args.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / args.layers)
        final[mode] = outs[-1]["down"].clone()
        results[mode] = {"us_per_layer_median": round(statistics.median(times), 3),
                         "us_per_layer_min": round(min(times), 3)}
    base = results.get("base", {}).get("us_per_layer_median")
    for mode, r in results.items():
        if "error" in r:
            continue
        r["same_bits_as_base"] = bool(torch.equal(final[mode], final["base"]))
        r["vs_base"] = round(base / r["us_per_layer_median"], 3) if base else None
        print(f"{mode:14s} {r['us_per_layer_median']:7.2f} us/layer (min "
              f"{r['us_per_layer_min']:.2f})  x{r['vs_base']} of base  same bits: "
              f"{r['same_bits_as_base']}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                   "torch": torch.__version__, "layers": args.layers, "modes": results},
                  f, indent=1)


if __name__ == "__main__":
    main()
