# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-calls=False, disallow-untyped-decorators=False
"""Skinny GEMMs on CUDA: y = x @ W^T (+ bias) for a few rows of x, as one Triton kernel.

A decode step multiplies 1..32 rows (B tokens, or B·(K+1) in VERIFY) by each weight. cuBLAS
picks tiles for those row counts that leave most of an H200's 132 SMs idle (3.7-3.9 us for
SmolLM2's 576-wide GEMMs, whose weights take ~0.3-1.5 us to stream from HBM). This kernel
splits N finely (BLOCK_N rows of W a program, optionally K over SPLIT_K programs), so each
GEMM spreads over many SMs:

- ``DOT=False`` (meant for 1..8 rows): a broadcast multiply and a sum over K per tile, no
  tensor cores (tl.dot needs >= 16 rows, and a GEMV is bound by reading W anyway);
- ``DOT=True``: tl.dot on x's rows padded to BLOCK_M >= 16 in registers (masked loads).

Accumulation is in fp32, rounded once to x's dtype at the store. SPLIT_K > 1 writes fp32
partial sums to a [SPLIT_K, M, N] scratch and a second small kernel adds them in split
order (no atomics), so every configuration is deterministic: the same inputs give the same
bits, and a CUDA-graph replay equals the eager call.

``ACT=1`` is the MLP's down projection on the fused gate-up output [M, 2I]: the prologue
loads gate and up and forms silu(gate) * up in fp32, rounded to x's dtype exactly as
``_kernels.silu_mul`` rounds it, so one kernel replaces silu_mul + the down GEMM.

Which configuration runs for which (N, K, rows) is ``models/_linear``'s table; this module
is the kernel and its launcher only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

try:  # Triton is optional: without it every linear is F.linear.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available() -> bool:
    return triton is not None


class SkinnyConfig(NamedTuple):
    """One launch configuration (the bench sweeps these; ``models/_linear`` keeps a table)."""

    dot: bool         # tl.dot (rows padded to >= 16) or broadcast-multiply-reduce
    block_n: int      # rows of W (output columns) per program; >= 16 with dot
    block_k: int      # K per loop iteration; >= 16 with dot
    split_k: int = 1  # programs along K (> 1: fp32 partials + an ordered reduce kernel)
    num_warps: int = 4
    num_stages: int = 3

    def block_m(self, rows: int) -> int:
        """Rows of x per program: all of them (a power of two), >= 16 for tl.dot; more
        than 32 rows run as several row blocks."""
        return max(16 if self.dot else 1, min(_pow2(rows), 32))

    def tag(self) -> str:
        """Compact name, e.g. ``d16x128s2w4n3`` (dot, BLOCK_N 16, BLOCK_K 128, split 2)."""
        return (f"{'d' if self.dot else 'v'}{self.block_n}x{self.block_k}s{self.split_k}"
                f"w{self.num_warps}n{self.num_stages}")


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if triton is not None:

    # M is not specialised (Triton would compile M == 1 apart): one compile per config.
    @triton.jit(do_not_specialize=["M"])
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       k_per_split, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                       DOT: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        # This program's K range (k_per_split is a multiple of BLOCK_K).
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(K, k_lo + k_per_split)
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + rk
            k_ok = ks < k_hi
            xm = m_ok[:, None] & k_ok[None, :]
            if ACT == 1:
                # x is gate_up [M, 2K]: silu(gate) * up as _kernels.silu_mul computes and
                # rounds it (the down GEMM's input is that kernel's output, bit for bit).
                g = tl.load(x_rows + ks[None, :], mask=xm, other=0.0)
                u = tl.load(x_rows + K + ks[None, :], mask=xm, other=0.0).to(tl.float32)
                gf = g.to(tl.float32)
                a = (gf / (1.0 + tl.exp(-gf)) * u).to(g.dtype)
            else:
                a = tl.load(x_rows + ks[None, :], mask=xm, other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if DOT:
                acc += tl.dot(a, tl.trans(w), out_dtype=tl.float32)
            else:
                prod = a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
                acc += tl.sum(prod, axis=2)
        out_mask = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            y = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
            tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
        else:
            # y_ptr is the fp32 scratch [SPLIT_K, M, N]; _splitk_reduce_kernel finishes.
            part = y_ptr + (pid_k * M + rm.to(tl.int64))[:, None] * N + rn[None, :]
            tl.store(part, acc, mask=out_mask)

    @triton.jit(do_not_specialize=["M"])
    def _splitk_reduce_kernel(p_ptr, b_ptr, y_ptr, M, N, stride_ym, HAS_BIAS: tl.constexpr,
                              SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        # The partials summed in split order (deterministic), bias, one rounding.
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < M * N
        acc = tl.load(p_ptr + offs, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(p_ptr + s * M * N + offs, mask=ok, other=0.0)
        m = offs // N
        n = offs % N
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + m.to(tl.int64) * stride_ym + n, acc.to(y_ptr.dtype.element_ty),
                 mask=ok)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  config: SkinnyConfig, *, silu_mul: bool = False) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype, by ``config``.
    ``silu_mul``: x is a gate-up output [..., 2K] and the product is silu(gate) * up
    (rounded to x's dtype) @ weight^T. x's last dim and weight's rows must be contiguous;
    x, weight and bias share a dtype (the caller, ``models/_linear``, checks)."""
    N, K = weight.shape
    width = x.shape[-1]
    if width != (2 * K if silu_mul else K):
        raise ValueError(f"skinny_linear: x is [..., {width}], weight [{N}, {K}]"
                         f"{' (silu_mul: x must be [..., 2K])' if silu_mul else ''}")
    x2 = x.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(1) != 1:
        raise ValueError("skinny_linear: weight rows must be contiguous")
    M = x2.shape[0]
    y = x2.new_empty(M, N)
    if M == 0:
        return y.view(*x.shape[:-1], N)
    c = config
    bm = c.block_m(M)
    split = max(1, min(c.split_k, triton.cdiv(K, c.block_k)))
    # Each split's K range a multiple of BLOCK_K (so no program straddles two splits).
    k_per = triton.cdiv(triton.cdiv(K, split), c.block_k) * c.block_k
    split = triton.cdiv(K, k_per)
    grid = (triton.cdiv(N, c.block_n), split, triton.cdiv(M, bm))
    b = bias if bias is not None else weight
    out = y if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    _skinny_kernel[grid](x2, weight, b, out, M, N, K, x2.stride(0), weight.stride(0),
                         y.stride(0), k_per, ACT=int(silu_mul), HAS_BIAS=bias is not None,
                         DOT=c.dot, SPLIT_K=split, BLOCK_M=bm, BLOCK_N=c.block_n,
                         BLOCK_K=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages)
    if split > 1:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(M * N, block),)](
            out, b, y, M, N, y.stride(0), HAS_BIAS=bias is not None, SPLIT_K=split,
            BLOCK=block, num_warps=4)
    return y.view(*x.shape[:-1], N)
