"""Token-wise rejection sampling on CUDA in two Triton kernels, the same tokens as the
torch path of `rejection_sample(method="token")` for the same seeds.

Only what the algorithm needs is read: p(d_i), q(d_i) for the coins, then the one row at
tau (residual normalize((p - q)+), or p at K for the bonus), once. Kernel 1, grid
[B, chunk blocks]: every program recomputes tau (K gathers + the ACCEPT hash) and writes
the f64 sums of its 256-wide chunks of the row at tau. Kernel 2, grid [B]: chunk cdf,
the RESIDUAL/BONUS uniform, the chosen chunk's cdf, the token and the output row. This is
`inverse_cdf`'s two-level search; for f32 rows only the order of the f32 adds inside a
chunk differs, so a draw can differ from torch only when u lands within rounding of a
chunk boundary (f16/bf16: see _chunk_sums_kernel).
No host syncs and no host tensors: CUDA-graph capturable. triton is imported lazily.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:   # bound at run time by _kernels(), on first use
    import triton.language as tl

from . import _pdl
from ._probs import _CHUNK
from ._rng import _CHAIN_STARTS, Stream

_CHUNKS_PER_PROGRAM = 16  # 4096 elements of p (and q) per kernel-1 program
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def usable(d: torch.Tensor, target: torch.Tensor, draft: torch.Tensor | None) -> bool:
    """Whether the kernel handles these (already shape-checked) inputs."""
    return (target.is_cuda and target.dtype in _DTYPES and d.shape[1] > 0
            and target.shape[0] > 0 and _triton_importable())


# Triton code below; `tl` and the jit wrappers are bound by _kernels() on first use.


def _mix32(x):  # _rng._mix32 on uint32 lanes: products wrap mod 2**32 as the & does
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


def _chain(start, seed, pos, stream):
    h = _mix32(start ^ seed.to(tl.uint32))
    h = _mix32(h ^ (seed >> 32).to(tl.uint32))
    h = _mix32(h ^ pos.to(tl.uint32))
    pos_hi = ((pos >> 32).to(tl.uint32) & 0xFFFFFF) << 8
    h = _mix32(h ^ (pos_hi | stream.to(tl.uint32)))
    return _mix32(h)  # index word 0


def _uniform(seed, pos, stream, START0: tl.constexpr, START1: tl.constexpr):
    """_rng.uniform(seed, pos, stream) for scalar i64 seed and pos: the same bits."""
    h0 = _chain(tl.full([], START0, tl.uint32), seed, pos, stream).to(tl.int64)
    h1 = _chain(tl.full([], START1, tl.uint32), seed, pos, stream).to(tl.int64)
    k = (h0 << 20) | (h1 >> 12)
    return (k.to(tl.float64) + 0.5) * 2.220446049250313e-16  # 2**-52


def _accepted(d_ptr, t_ptr, q_ptr, seed, pos, b, K: tl.constexpr, V, st_b, st_k, sq_b,
              sq_k, HAS_Q: tl.constexpr, ACCEPT: tl.constexpr, START0: tl.constexpr,
              START1: tl.constexpr):
    """tau: leading drafts whose coin u passes u q(d) <= p(d) with p(d) > 0."""
    tau = tl.zeros([], tl.int64)
    alive = tl.full([], 1, tl.int64)
    for i in range(K):
        d = tl.load(d_ptr + b * K + i)
        ds = tl.minimum(tl.maximum(d, 0), V - 1)
        p = tl.load(t_ptr + b * st_b + i * st_k + ds).to(tl.float64)
        p = tl.where((d >= 0) & (d < V), p, 0.0)
        if HAS_Q:
            q = tl.load(q_ptr + b * sq_b + i * sq_k + ds).to(tl.float64)
        else:
            q = tl.full([], 1.0, tl.float64)
        u = _uniform(seed, pos + i, tl.full([], ACCEPT, tl.int32), START0, START1)
        ok = ((u * q <= p) & (p > 0)).to(tl.int64)
        alive = alive * ok
        tau += alive
    return tau


def _residual(t_ptr, q_ptr, d_ptr, offs, mask, b, tau, K: tl.constexpr, V, st_b, st_k,
              sq_b, sq_k, HAS_Q: tl.constexpr):
    """(p - q)+ (or p with the draft zeroed for point masses) at tau in the input
    dtype, as the torch path rounds it; p alone at tau = K."""
    p = tl.load(t_ptr + b * st_b + tau * st_k + offs, mask=mask, other=0.0)
    reject = tau < K
    at = tl.minimum(tau, K - 1)
    if HAS_Q:
        q = tl.load(q_ptr + b * sq_b + at * sq_k + offs, mask=mask & reject, other=0.0)
        r = tl.maximum(p.to(tl.float32) - q.to(tl.float32), 0.0).to(p.dtype)
    else:
        d = tl.load(d_ptr + b * K + at)
        ds = tl.minimum(tl.maximum(d, 0), V - 1)
        r = tl.where(reject & (offs == ds), 0.0, p)
    return r, p


def _chunk_sums_kernel(d_ptr, t_ptr, q_ptr, seeds_ptr, pos_ptr, sums_ptr, tau_ptr,
                       K: tl.constexpr, V, NCH: tl.constexpr, st_b, st_k, sq_b, sq_k,
                       HAS_Q: tl.constexpr, CHUNK: tl.constexpr, CPP: tl.constexpr,
                       ACCEPT: tl.constexpr, START0: tl.constexpr,
                       START1: tl.constexpr, GDC: tl.constexpr = False):
    if GDC:  # PDL (_pdl): no weights, so the wait first
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    seed = tl.load(seeds_ptr + b)
    pos = tl.load(pos_ptr + b)
    tau = _accepted(d_ptr, t_ptr, q_ptr, seed, pos, b, K, V, st_b, st_k, sq_b, sq_k,
                    HAS_Q, ACCEPT, START0, START1)
    tl.store(tau_ptr + b, tau, mask=blk == 0)
    offs = blk * (CPP * CHUNK) + tl.arange(0, CPP * CHUNK)
    r, _ = _residual(t_ptr, q_ptr, d_ptr, offs, offs < V, b, tau, K, V, st_b, st_k,
                     sq_b, sq_k, HAS_Q)
    # f32 sum per chunk, as inverse_cdf for f32 rows (f16/bf16: not rounded back, so
    # chunk and inner cdfs agree; torch rounds them to the input dtype).
    s = tl.sum(tl.reshape(r.to(tl.float32), (CPP, CHUNK)), axis=1)
    c = blk * CPP + tl.arange(0, CPP)
    tl.store(sums_ptr + b * NCH + c, s.to(tl.float64), mask=c < NCH)


def _search(cdf, t, has_mass, idx, valid):
    """First index with cdf > t, clamped to the last index with mass (_probs._search)."""
    n = tl.sum(((cdf <= t) & valid).to(tl.int64), axis=0)
    last = tl.max(tl.where(has_mass & valid, idx, 0), axis=0)
    return tl.minimum(n, last)


def _sample_kernel(d_ptr, t_ptr, q_ptr, seeds_ptr, pos_ptr, sums_ptr, tau_ptr, out_ptr,
                   K: tl.constexpr, V, NCH: tl.constexpr, st_b, st_k, sq_b, sq_k,
                   HAS_Q: tl.constexpr, CHUNK: tl.constexpr, CPP: tl.constexpr,
                   NCH_P2: tl.constexpr, K1_P2: tl.constexpr,
                   RESIDUAL: tl.constexpr, BONUS: tl.constexpr,
                   START0: tl.constexpr, START1: tl.constexpr, GDC: tl.constexpr = False):
    if GDC:  # PDL (_pdl): no weights, so the wait first
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0).to(tl.int64)
    seed = tl.load(seeds_ptr + b)
    pos = tl.load(pos_ptr + b)
    tau = tl.load(tau_ptr + b)
    ci = tl.arange(0, NCH_P2)
    cvalid = ci < NCH
    sums = tl.load(sums_ptr + b * NCH + ci, mask=cvalid, other=0.0)
    empty = tl.sum(sums, axis=0) <= 0  # sums >= 0: zero only when every entry is
    if empty:
        # A residual with no mass (only through rounding): sample p at tau instead.
        for c0 in range(0, NCH, CPP):
            offs = c0 * CHUNK + tl.arange(0, CPP * CHUNK)
            _, p = _residual(t_ptr, q_ptr, d_ptr, offs, offs < V, b, tau, K, V,
                             st_b, st_k, sq_b, sq_k, HAS_Q)
            s = tl.sum(tl.reshape(p.to(tl.float32), (CPP, CHUNK)), axis=1)
            c = c0 + tl.arange(0, CPP)
            tl.store(sums_ptr + b * NCH + c, s.to(tl.float64), mask=c < NCH)
        tl.debug_barrier()
        sums = tl.load(sums_ptr + b * NCH + ci, mask=cvalid, other=0.0)
    cdf = tl.cumsum(sums, axis=0)
    total = tl.sum(tl.where(ci == NCH - 1, cdf, 0.0), axis=0)
    stream = tl.where(tau == K, BONUS, RESIDUAL)
    t = _uniform(seed, pos + tau, stream, START0, START1) * total
    c = _search(cdf, t, sums > 0, ci, cvalid)
    before = tl.sum(tl.where(ci == c - 1, cdf, 0.0), axis=0)
    j_idx = tl.arange(0, CHUNK)
    offs = c * CHUNK + j_idx
    r, p = _residual(t_ptr, q_ptr, d_ptr, offs, offs < V, b, tau, K, V, st_b, st_k,
                     sq_b, sq_k, HAS_Q)
    r = tl.where(empty, p, r)
    inner = r.to(tl.float64)
    j = _search(tl.cumsum(inner, axis=0), t - before, inner > 0, j_idx, j_idx < CHUNK)
    tok = c * CHUNK + j
    k = tl.arange(0, K1_P2)
    dk = tl.load(d_ptr + b * K + k, mask=k < tau, other=-1)
    row = tl.where(k == tau, tok, dk)
    tl.store(out_ptr + b * (K + 1) + k, row, mask=k < K + 1)


_JIT = ("_mix32", "_chain", "_uniform", "_accepted", "_residual", "_chunk_sums_kernel",
        "_search", "_sample_kernel")


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """Compile-on-first-use: jit the functions above in place (Triton resolves callees and
    `tl` through module globals, the interpreter included); without triton, never runs."""
    import triton
    import triton.language as tl

    g = globals()
    g["tl"] = tl
    for name in _JIT:
        g[name] = triton.jit(g[name])
    return g["_chunk_sums_kernel"], g["_sample_kernel"]


def token_rejection_sample(d: torch.Tensor, target: torch.Tensor, draft: torch.Tensor | None,
                           seeds: torch.Tensor, positions: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ids [B, K+1] i64, num_accepted [B] i64), as rejection_sample(method="token",
    validate=False) returns them; inputs as `usable` accepts."""
    import triton

    chunk_sums_kernel, sample_kernel = _kernels()
    B, K = d.shape
    V = target.shape[2]
    if target.stride(2) != 1:
        target = target.contiguous()
    if draft is not None and draft.stride(2) != 1:
        draft = draft.contiguous()
    d, seeds, positions = d.contiguous(), seeds.contiguous(), positions.contiguous()
    q = target if draft is None else draft  # a dummy pointer for point-mass drafts
    nch = triton.cdiv(V, _CHUNK)
    dev = target.device
    sums = torch.empty((B, nch), dtype=torch.float64, device=dev)
    tau = torch.empty((B,), dtype=torch.int64, device=dev)
    out = torch.empty((B, K + 1), dtype=torch.int64, device=dev)
    common = dict(HAS_Q=draft is not None, CHUNK=_CHUNK, CPP=_CHUNKS_PER_PROGRAM,
                  START0=_CHAIN_STARTS[0], START1=_CHAIN_STARTS[1], **_pdl.launch_kw(target))
    strides = (target.stride(0), target.stride(1), q.stride(0), q.stride(1))
    grid = (B, triton.cdiv(nch, _CHUNKS_PER_PROGRAM))
    chunk_sums_kernel[grid](d, target, q, seeds, positions, sums, tau, K, V, nch, *strides,
                            ACCEPT=int(Stream.ACCEPT), num_warps=8, **common)
    sample_kernel[(B,)](d, target, q, seeds, positions, sums, tau, out, K, V, nch, *strides,
                        NCH_P2=triton.next_power_of_2(nch),
                        K1_P2=triton.next_power_of_2(K + 1),
                        RESIDUAL=int(Stream.RESIDUAL), BONUS=int(Stream.BONUS),
                        num_warps=4, **common)
    return out, tau
