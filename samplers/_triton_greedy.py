# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# (Triton device code, untyped as in the modules pyproject.toml's overrides name.)
"""All-greedy strict verification on CUDA in two Triton kernels: the tokens and counts of
`strict_from_targets(d, target_logits.argmax(-1))`, written straight into one
``packed`` [B, K+2] i64 tensor (token ids [B, K+1], then the accepted count).

Kernel 1, grid [B * (K+1), S]: each program scans one chunk of a row's V logits (a few
thousand) and writes the chunk's (max, first index of the max). Kernel 2, grid [B]: the
row's S partials per position (max, then the smallest index among equal maxima: the same
bits in any order, so no atomics and no run-to-run variation), t_i, the drafts' matching
prefix n, and the row [t_0..t_n, -1..., n].

Exactly torch.argmax's choice: the first index among equal maxima; NaN counts as larger
than everything (the first NaN wins, as torch.argmax on CPU and CUDA); a row of -inf
gives 0. Logits f32, f16 or bf16 (compared as f32, an exact widening). A draft outside
the vocabulary never matches. No host syncs and no host tensors: CUDA-graph capturable.
triton is imported lazily, as in _triton_rejection.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

import torch

from ._triton_rejection import _triton_importable

if TYPE_CHECKING:   # bound at run time by _kernels(), on first use
    import triton.language as tl

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A program loads BLOCK logits a step (num_warps 4: 8 f32 a thread, two 16-byte loads) and
# scans CHUNK of them; S = cdiv(V, CHUNK) programs a row. The chunk doubles from 2048 while
# the grid has more than _MAX_PROGRAMS programs, so that batch 1 (49152 logits: 24
# programs) is many short scans in parallel and a large batch does not pay many tiny ones.
_BLOCK = 1024
_MIN_CHUNK = 2048
_MAX_CHUNK = 16384
_MAX_PROGRAMS = 2048
# SPECLOOP_GREEDY_VERIFY=torch keeps the torch ops on CUDA too (an A/B of whole runs);
# read once, at import.
_ENABLED = (os.environ.get("SPECLOOP_GREEDY_VERIFY") or "triton") != "torch"
_INT_MAX = 2147483647


def usable(d: torch.Tensor, target_logits: torch.Tensor) -> bool:
    """Whether the kernels handle these inputs: d [B, K] i64, target_logits [B, K+1, V]."""
    return (_ENABLED and target_logits.is_cuda and target_logits.dtype in _DTYPES
            and target_logits.dim() == 3 and target_logits.shape[0] > 0
            and target_logits.shape[2] > 0 and d.dtype == torch.int64
            and d.shape == (target_logits.shape[0], target_logits.shape[1] - 1)
            and _triton_importable())


def chunk_size(rows: int, vocab: int) -> int:
    """The logits one kernel-1 program scans, for ``rows`` = B * (K+1) rows of ``vocab``."""
    chunk = _MIN_CHUNK
    while chunk < _MAX_CHUNK and rows * -(-vocab // chunk) > _MAX_PROGRAMS:
        chunk *= 2
    return chunk


# Triton code below; `tl` and the jit wrappers are bound by _kernels() on first use.


def _best(val, idx, IMAX: tl.constexpr):
    """(max, first index) of each row of val/idx [R, N]; NaN is the maximum (its smallest
    index); ties go to the smallest index. A lane past the data holds -inf and IMAX."""
    nan = val != val
    has_nan = tl.max(nan.to(tl.int32), axis=1) > 0
    top = tl.max(tl.where(nan, float("-inf"), val), axis=1)
    pick = tl.where(has_nan[:, None], nan, val == top[:, None])
    first = tl.min(tl.where(pick, idx, IMAX), axis=1)
    return tl.where(has_nan, float("nan"), top), first


def _partials_kernel(x_ptr, pv_ptr, pi_ptr, V, T, s_b, s_t, S, CHUNK: tl.constexpr,
                     BLOCK: tl.constexpr, IMAX: tl.constexpr):
    # Program (row, s): logits [s * CHUNK, (s+1) * CHUNK) of row = b * T + t. Each lane keeps
    # its own best as it walks the chunk (indices grow, so a strict > keeps the first of
    # equal values; a NaN replaces a number and is never replaced), one reduction at the end.
    row = tl.program_id(0)
    s = tl.program_id(1)
    base = x_ptr + (row // T).to(tl.int64) * s_b + (row % T).to(tl.int64) * s_t
    lo = s * CHUNK
    lanes = tl.arange(0, BLOCK)
    n = lo + lanes
    m = n < V
    best = tl.load(base + n, mask=m, other=float("-inf")).to(tl.float32)
    best_i = tl.where(m, n, IMAX)
    for off in tl.static_range(BLOCK, CHUNK, BLOCK):  # <= 16 steps: all loads in flight
        n = lo + off + lanes
        m = n < V
        v = tl.load(base + n, mask=m, other=float("-inf")).to(tl.float32)
        take = (v > best) | ((v != v) & (best == best))
        best = tl.where(take, v, best)
        best_i = tl.where(take, n, best_i)
    top, first = _best(best[None, :], best_i[None, :], IMAX)
    at = row * S + s + tl.arange(0, 1)
    tl.store(pv_ptr + at, top)
    tl.store(pi_ptr + at, first)


def _combine_kernel(pv_ptr, pi_ptr, d_ptr, out_ptr, K, S, s_d, T_P2: tl.constexpr,
                    S_P2: tl.constexpr, IMAX: tl.constexpr, COUNT: tl.constexpr):
    # Row b: its K+1 positions' S partials -> t [K+1]; n = the drafts' matching prefix;
    # out[b] = [t_0..t_n, -1 ..., n] (out [B, K+2]). COUNT False (K = 0): out[b] = t_0
    # (out [B], a plain argmax).
    b = tl.program_id(0)
    t = tl.arange(0, T_P2)
    sp = tl.arange(0, S_P2)
    ok = (t < K + 1)[:, None] & (sp < S)[None, :]
    at = (b * (K + 1) + t)[:, None] * S + sp[None, :]
    pv = tl.load(pv_ptr + at, mask=ok, other=float("-inf"))
    pi = tl.load(pi_ptr + at, mask=ok, other=IMAX)
    _, tok = _best(pv, pi, IMAX)
    tok = tok.to(tl.int64)
    d = tl.load(d_ptr + b.to(tl.int64) * s_d + t, mask=t < K, other=-1)
    n = tl.min(tl.where((t < K) & (d != tok), t, K), axis=0)
    if COUNT:
        row = out_ptr + b.to(tl.int64) * (K + 2)
        tl.store(row + t, tl.where(t <= n, tok, -1), mask=t < K + 1)
        tl.store(row + K + 1, n.to(tl.int64))
    else:
        tl.store(out_ptr + b + t, tok, mask=t < 1)


_JIT = ("_best", "_partials_kernel", "_combine_kernel")


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
    return g["_partials_kernel"], g["_combine_kernel"]


def usable_argmax(logits: torch.Tensor) -> bool:
    """Whether `greedy_argmax` handles logits (a draft step's [B, V])."""
    return (_ENABLED and logits.is_cuda and logits.dtype in _DTYPES and logits.dim() == 2
            and logits.shape[0] > 0 and logits.shape[1] > 0 and _triton_importable())


def greedy_argmax(logits: torch.Tensor, *, chunk: int | None = None,
                  block: int = _BLOCK) -> torch.Tensor:
    """logits [B, V] -> i64 [B], logits.argmax(-1) (the same choice: see the module doc)
    in the same two kernels, the second writing only the token."""
    return _run(None, logits[:, None], chunk, block)


def greedy_verify(d: torch.Tensor, target_logits: torch.Tensor, *,
                  chunk: int | None = None, block: int = _BLOCK) -> torch.Tensor:
    """packed [B, K+2] i64: strict_from_targets(d, target_logits.argmax(-1))'s token_ids
    [B, K+1] then its num_accepted; inputs as `usable` accepts (any device under the
    interpreter). ``chunk`` (None: `chunk_size`) and ``block``, powers of two with
    block <= chunk: the scan's sizes (small ones let interpreted tests cross chunks)."""
    return _run(d, target_logits, chunk, block)


def _run(d: torch.Tensor | None, target_logits: torch.Tensor, chunk: int | None,
         block: int) -> torch.Tensor:
    """d None: the argmax [B] of target_logits [B, 1, V]; else greedy_verify's packed."""
    import triton

    partials_kernel, combine_kernel = _kernels()
    B, T, V = target_logits.shape
    if target_logits.stride(2) != 1:
        target_logits = target_logits.contiguous()
    rows = B * T
    chunk = chunk_size(rows, V) if chunk is None else chunk
    block = min(block, chunk)
    S = triton.cdiv(V, chunk)
    dev = target_logits.device
    pv = torch.empty(rows * S, dtype=torch.float32, device=dev)
    pi = torch.empty(rows * S, dtype=torch.int32, device=dev)
    shape = (B,) if d is None else (B, T + 1)
    out = torch.empty(shape, dtype=torch.int64, device=dev)
    partials_kernel[(rows, S)](target_logits, pv, pi, V, T, target_logits.stride(0),
                               target_logits.stride(1), S, CHUNK=chunk, BLOCK=block,
                               IMAX=_INT_MAX, num_warps=4)
    if d is None or T == 1:  # no drafts: out stands in for the pointer (no load reads it)
        d_arg, s_d = out, 0
    else:
        d_arg = d if d.stride(1) == 1 else d.contiguous()
        s_d = d_arg.stride(0)
    combine_kernel[(B,)](pv, pi, d_arg, out, T - 1, S, s_d,
                         T_P2=triton.next_power_of_2(T), S_P2=triton.next_power_of_2(S),
                         IMAX=_INT_MAX, COUNT=d is not None, num_warps=1)
    return out
