"""Offline sm_90 PTX (no GPU) of a one-tile tl.dot GEMM shaped like SmolLM2's qkv at 5-16
rows (BLOCK_M 16, BLOCK_N 64, K = 576 as 512 + 64, 8 warps, PDL), with and without an
RMSNorm prologue that loads x once: the stream itself, its residual add done upstream (in
the o / down GEMM's epilogue, not built yet). Prints, between PDL's wait and the first
MMA, the order of global loads (L), shared stores (S) and barriers (B), and their counts.

The thirty-second session's fused forms loaded x, delta and the squares apart, and Triton
put a layout conversion's barrier after each load, so each waited a round trip in turn
(performance-history.md, "The RMSNorm in the tl.dot tail's GEMM, applied to the product").
With one load, every global load is issued before the first barrier; the norm adds its
reduction (shuffles and a few barriers, no memory round trip). A prototype for a study,
not the shipped kernel:  python bench/study_norm_prologue_ptx.py"""
import re
import warnings

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def gemm(x_ptr, d_ptr, nw_ptr, w_ptr, y_ptr, M, K, eps, NORM: tl.constexpr,
         DELTA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         HALF: tl.constexpr, PIECE: tl.constexpr):
    tl.extra.cuda.gdc_launch_dependents()
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ka = tl.arange(0, HALF)
    kb = HALF + tl.arange(0, PIECE)
    wa = tl.load(w_ptr + rn[:, None] * K + ka[None, :])
    wb = tl.load(w_ptr + rn[:, None] * K + kb[None, :], mask=(kb < K)[None, :], other=0.0)
    if NORM:
        na = tl.load(nw_ptr + ka)
        nb = tl.load(nw_ptr + kb, mask=kb < K, other=0.0)
    tl.extra.cuda.gdc_wait()
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    xa = tl.load(x_ptr + rm[:, None] * K + ka[None, :], mask=m_ok[:, None], other=0.0)
    xb = tl.load(x_ptr + rm[:, None] * K + kb[None, :], mask=m_ok[:, None] & (kb < K)[None, :],
                 other=0.0)
    if DELTA:   # the residual add in the prologue too (the thirty-second session's inputs)
        xa = (xa.to(tl.float32) + tl.load(d_ptr + rm[:, None] * K + ka[None, :],
                                          mask=m_ok[:, None], other=0.0).to(tl.float32)
              ).to(xa.dtype)
        xb = (xb.to(tl.float32) + tl.load(d_ptr + rm[:, None] * K + kb[None, :],
                                          mask=m_ok[:, None] & (kb < K)[None, :],
                                          other=0.0).to(tl.float32)).to(xb.dtype)
    if NORM:
        fa = xa.to(tl.float32)
        fb = xb.to(tl.float32)
        ss = tl.sum(fa * fa, axis=1) + tl.sum(fb * fb, axis=1)
        inv = 1.0 / tl.sqrt(ss / K + eps)
        xa = na[None, :] * (fa * inv[:, None]).to(xa.dtype)
        xb = nb[None, :] * (fb * inv[:, None]).to(xb.dtype)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = tl.dot(xa, tl.trans(wa), acc, out_dtype=tl.float32)
    acc = tl.dot(xb, tl.trans(wb), acc, out_dtype=tl.float32)
    tl.store(y_ptr + rm[:, None] * (BLOCK_N * 15) + rn[None, :], acc.to(tl.bfloat16),
             mask=m_ok[:, None])


def ptx(norm, delta):
    sig = {"x_ptr": "*bf16", "d_ptr": "*bf16", "nw_ptr": "*bf16", "w_ptr": "*bf16",
           "y_ptr": "*bf16", "M": "i32", "K": "i32", "eps": "fp32"}
    const = dict(NORM=norm, DELTA=delta, BLOCK_M=16, BLOCK_N=64, HALF=512, PIECE=64)
    for k in const:
        sig[k] = "constexpr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = triton.compile(ASTSource(gemm, sig, const), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 8, "launch_pdl": True})
    return c.asm["ptx"]


def main() -> None:
    for norm, delta in ((False, False), (True, False), (True, True)):
        text = ptx(norm, delta)
        body = text[text.index("griddepcontrol.wait"):]
        body = body[:body.index("mma.sync") if "mma.sync" in body else body.index("wgmma")]
        lines = [re.sub(r"^@!?%p\d+\s+", "", l.strip()) for l in body.splitlines()]
        n_bar = sum(l.startswith("bar.sync") for l in lines)
        n_ld = sum(l.startswith("ld.global") for l in lines)
        first_bar = next((i for i, l in enumerate(lines) if l.startswith("bar.sync")), None)
        lds_before_bar = sum(l.startswith("ld.global") for l in lines[:first_bar]) \
            if first_bar is not None else n_ld
        shfl = sum("shfl" in l for l in lines)
        kinds = (("ld.global", "L"), ("bar.sync", "B"), ("st.shared", "S"))
        order = "".join(next((c for p, c in kinds if l.startswith(p)), "") for l in lines)
        print(order)
        print(f"norm={norm} delta={delta}: wait->first MMA: {len(lines)} lines, {n_ld} global "
              f"loads ({lds_before_bar} before the first bar.sync), {n_bar} bar.sync, {shfl} "
              "shuffles")


if __name__ == "__main__":
    main()
