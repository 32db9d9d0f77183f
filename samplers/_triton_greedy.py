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

Mode "row" (SPECLOOP_GREEDY_VERIFY=row, or greedy_verify's ``mode``) is the one-kernel
alternative: a program a row (its K+1 positions) scans all of V itself; fewer programs
and no second launch, for an A/B at small batches on the GPU (bench_greedy_verify_gpu).

Exactly torch.argmax's choice (both modes): the first index among equal maxima; NaN
counts as larger than everything (the first NaN wins, as torch.argmax on CPU and CUDA);
a row of -inf gives 0. Logits f32, f16 or bf16 (compared as f32, an exact widening). A draft outside
the vocabulary never matches. No host syncs and no host tensors: CUDA-graph capturable.
On Hopper the kernels are launched with PDL (``_pdl``: every program waits for the kernel
before it first; nothing here is a weight).
triton is imported lazily, as in _triton_rejection.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

import torch

from . import _pdl
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
# The one-kernel "row" mode: a program a row, 16 warps, 8192 logits a step (offline sm_90
# SASS: a thread's four 16-byte loads of a step issued together; 8 warps with 8 loads a
# thread interleave them with the compares).
_ROW_BLOCK = 8192
# SPECLOOP_GREEDY_VERIFY: "split" (default), "row" (see greedy_verify), or "torch" (the
# torch ops on CUDA too); for an A/B of whole runs, read once, at import.
_MODE = os.environ.get("SPECLOOP_GREEDY_VERIFY") or "split"
# SPECLOOP_TREE_WALK: how the tree kernel reads the parents' targets ("store" or
# "registers": tree_greedy_verify's ``walk``); "registers" is untimed on a GPU (written in
# the forty-second session without one), for an A/B.
_TREE_WALK = os.environ.get("SPECLOOP_TREE_WALK") or "store"
# SPECLOOP_TREE_WARPS: the tree kernel's warps (default: ``tree_warps``), for an A/B.
_TREE_WARPS = int(os.environ.get("SPECLOOP_TREE_WARPS") or 0)
_ENABLED = _MODE != "torch"
_INT_MAX = 2147483647


def usable(d: torch.Tensor, target_logits: torch.Tensor) -> bool:
    """Whether the kernels handle these inputs: d [B, K] i64, target_logits [B, K+1, V]."""
    return (_ENABLED and target_logits.is_cuda and target_logits.dtype in _DTYPES
            and target_logits.dim() == 3 and target_logits.shape[0] > 0
            and target_logits.shape[2] > 0 and d.dtype == torch.int64
            and d.shape == (target_logits.shape[0], target_logits.shape[1] - 1)
            and _triton_importable())


def tree_warps(t_p2: int, s_p2: int) -> int:
    """The tree kernel's warps for its [T_P2, S_P2] partials: one warp a 128 of them, 1 to
    4. The kernel is one program a row, so its time is one block's instruction stream:
    with one warp the 31-node tree's (T_P2 32) is ~1,900 instructions (offline sm_90
    SASS, 132 registers, 190 shuffles), with four ~550 a warp (44 registers), the
    15-node tree's 1,000 against 380 (on the H200 the kernel took 9.4 µs of tree31's
    critical path at one warp, 3.0 of tree15's). The output is the same at any count:
    maxima and first indices, in any order."""
    return _TREE_WARPS or min(4, max(1, t_p2 * s_p2 // 128))


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
                     BLOCK: tl.constexpr, IMAX: tl.constexpr, GDC: tl.constexpr = False):
    # Program (row, s): logits [s * CHUNK, (s+1) * CHUNK) of row = b * T + t. Each lane keeps
    # its own best as it walks the chunk (indices grow, so a strict > keeps the first of
    # equal values; a NaN replaces a number and is never replaced), one reduction at the end.
    if GDC:  # PDL (specloop.samplers._pdl): no weights, so the wait first
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
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
                    S_P2: tl.constexpr, IMAX: tl.constexpr, COUNT: tl.constexpr,
                    GDC: tl.constexpr = False):
    # Row b: its K+1 positions' S partials -> t [K+1]; n = the drafts' matching prefix;
    # out[b] = [t_0..t_n, -1 ..., n] (out [B, K+2]). COUNT False (K = 0): out[b] = t_0
    # (out [B], a plain argmax).
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    t = tl.arange(0, T_P2)
    tok = _targets(pv_ptr, pi_ptr, b, t, K + 1, S, S_P2, IMAX)
    _emit(tok.to(tl.int64), t, b, d_ptr, out_ptr, K, s_d, COUNT)


def _targets(pv_ptr, pi_ptr, b, t, T, S, S_P2: tl.constexpr, IMAX: tl.constexpr):
    """Row b's T positions (t [T_P2]): each one's argmax from its S partials."""
    sp = tl.arange(0, S_P2)
    ok = (t < T)[:, None] & (sp < S)[None, :]
    at = (b * T + t)[:, None] * S + sp[None, :]
    pv = tl.load(pv_ptr + at, mask=ok, other=float("-inf"))
    pi = tl.load(pi_ptr + at, mask=ok, other=IMAX)
    return _best(pv, pi, IMAX)[1]


def _emit(tok, t, b, d_ptr, out_ptr, K, s_d, COUNT: tl.constexpr):
    """Row b's output from its targets tok [T_P2] (positions t): see _combine_kernel."""
    d = tl.load(d_ptr + b.to(tl.int64) * s_d + t, mask=t < K, other=-1)
    n = tl.min(tl.where((t < K) & (d != tok), t, K), axis=0)
    if COUNT:
        row = out_ptr + b.to(tl.int64) * (K + 2)
        tl.store(row + t, tl.where(t <= n, tok, -1), mask=t < K + 1)
        tl.store(row + K + 1, n.to(tl.int64))
    else:
        tl.store(out_ptr + b + t, tok, mask=t < 1)


def _row_kernel(x_ptr, d_ptr, out_ptr, V, K, s_b, s_t, s_d, T_P2: tl.constexpr,
                BLOCK: tl.constexpr, IMAX: tl.constexpr, COUNT: tl.constexpr,
                GDC: tl.constexpr = False):
    # The one-kernel alternative (mode "row"): program b scans its K+1 positions' whole
    # rows itself, BLOCK logits a step, then writes as _combine_kernel. A lane takes its
    # first in-vocabulary value whatever it is (so an all -inf row gives index 0).
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    t = tl.arange(0, T_P2)
    lanes = tl.arange(0, BLOCK)
    toks = tl.zeros([T_P2], tl.int64)
    for i in range(0, K + 1):
        base = x_ptr + b.to(tl.int64) * s_b + i * s_t
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.full([BLOCK], IMAX, tl.int32)
        for lo in range(0, V, BLOCK):
            n = lo + lanes
            m = n < V
            v = tl.load(base + n, mask=m, other=float("-inf")).to(tl.float32)
            take = m & ((v > best) | ((v != v) & (best == best)) | (best_i == IMAX))
            best = tl.where(take, v, best)
            best_i = tl.where(take, n, best_i)
        _, first = _best(best[None, :], best_i[None, :], IMAX)
        toks = tl.where(t == i, tl.min(first, axis=0).to(tl.int64), toks)
    _emit(toks, t, b, d_ptr, out_ptr, K, s_d, COUNT)


def _tree_kernel(pv_ptr, pi_ptr, tok_ptr, tgt_ptr, par_ptr, anc_ptr, dep_ptr, out_ptr,
                 path_ptr, R, D, S, s_tok, T_P2: tl.constexpr, S_P2: tl.constexpr,
                 D_P2: tl.constexpr, IMAX: tl.constexpr, REGISTERS: tl.constexpr = False,
                 GDC: tl.constexpr = False):
    # Row b of a draft tree's greedy VERIFY (samplers/_tree.py accept_tree): its R tree
    # rows' S partials -> their targets; a row is accepted where every row on its path
    # (ancestors anc [R, D+1]) holds its parent's target; the deepest accepted row (the
    # first in the tree's order among equals) ends the path. out [B, D+2]: the path's
    # drafts, the target after them at n, -1 past it, then n; path [B, D+1]. The tree's
    # tables are constants (built once a tree): loaded before PDL's wait. The parents'
    # targets: stored in tgt [B, R] and read back after a barrier, and the path's row
    # read at the best row's index; or (REGISTERS) gathered from the targets in registers
    # (tl.gather) and the path's row picked by a masked sum: no memory round trip after
    # the partials (SPECLOOP_TREE_WALK; the same output).
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.arange(0, T_P2)
    j = tl.arange(0, D_P2)
    rows = (t < R)[:, None]
    inside = rows & (j <= D)[None, :]
    anc = tl.load(anc_ptr + t[:, None] * (D + 1) + j[None, :], mask=inside, other=0)
    parent = tl.load(par_ptr + anc, mask=inside, other=0)
    depth = tl.load(dep_ptr + t, mask=t < R, other=0)
    if REGISTERS:   # each path's next row (its drafts: the row after j on the path)
        nxt = tl.load(anc_ptr + t[:, None] * (D + 1) + j[None, :] + 1,
                      mask=rows & (j < D)[None, :], other=0)
    if GDC:
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    tgt = _targets(pv_ptr, pi_ptr, b, t, R, S, S_P2, IMAX).to(tl.int64)
    tok_row = tok_ptr + b.to(tl.int64) * s_tok
    mine = tl.load(tok_row + anc, mask=inside, other=0)
    tgt_row = tgt_ptr + b.to(tl.int64) * R
    if REGISTERS:
        after = tl.load(tok_row + nxt, mask=rows & (j < D)[None, :], other=0)
        theirs = tl.gather(tl.broadcast_to(tgt[:, None], (T_P2, D_P2)), parent, 0)
    else:
        tl.store(tgt_row + t, tgt, mask=t < R)
        tl.debug_barrier()      # every lane's targets stored before any lane reads them
        theirs = tl.load(tgt_row + parent, mask=inside, other=0)
    match = (mine == theirs) | (anc == 0) | ~inside
    accepted = tl.min(match.to(tl.int32), axis=1) > 0
    score = tl.where(accepted & (t < R), depth * R + (R - 1 - t), -1)
    best = tl.argmax(score, axis=0)
    if REGISTERS:
        on = t == best
        n = tl.sum(tl.where(on, depth, 0), axis=0)
        path = tl.sum(tl.where(on[:, None], anc, 0), axis=0)
        drafts = tl.sum(tl.where(on[:, None], after, 0), axis=0)
        bonus = tl.sum(tl.where(on, tgt, 0), axis=0)
    else:
        n = tl.load(dep_ptr + best)
        path = tl.load(anc_ptr + best * (D + 1) + j, mask=j <= D, other=0)
        nxt_row = tl.load(anc_ptr + best * (D + 1) + j + 1, mask=j < D, other=0)
        drafts = tl.load(tok_row + nxt_row, mask=j < D, other=0)
        bonus = tl.load(tgt_row + best)
    row = out_ptr + b.to(tl.int64) * (D + 2)
    tl.store(row + j, tl.where(j < n, drafts, tl.where(j == n, bonus, -1)), mask=j <= D)
    tl.store(row + D + 1, n.to(tl.int64))
    tl.store(path_ptr + b.to(tl.int64) * (D + 1) + j, path, mask=j <= D)


_JIT = ("_best", "_emit", "_targets", "_partials_kernel", "_combine_kernel", "_row_kernel",
        "_tree_kernel")


@functools.cache
def _kernels() -> tuple[Any, Any, Any, Any]:
    """Compile-on-first-use: jit the functions above in place (Triton resolves callees and
    `tl` through module globals, the interpreter included); without triton, never runs."""
    import triton
    import triton.language as tl

    g = globals()
    g["tl"] = tl
    for name in _JIT:
        g[name] = triton.jit(g[name])
    return g["_partials_kernel"], g["_combine_kernel"], g["_row_kernel"], g["_tree_kernel"]


def usable_argmax(logits: torch.Tensor) -> bool:
    """Whether `greedy_argmax` handles logits (a draft step's [B, V])."""
    return (_ENABLED and logits.is_cuda and logits.dtype in _DTYPES and logits.dim() == 2
            and logits.shape[0] > 0 and logits.shape[1] > 0 and _triton_importable())


def greedy_argmax(logits: torch.Tensor, **kw: Any) -> torch.Tensor:
    """logits [B, V] -> i64 [B], logits.argmax(-1) (the same choice: see the module doc)
    in the same kernels as greedy_verify (``kw``: its), writing only the token."""
    return _run(None, logits[:, None], **kw)


def greedy_verify(d: torch.Tensor, target_logits: torch.Tensor, **kw: Any) -> torch.Tensor:
    """packed [B, K+2] i64: strict_from_targets(d, target_logits.argmax(-1))'s token_ids
    [B, K+1] then its num_accepted; inputs as `usable` accepts (any device under the
    interpreter).

    ``mode`` (None: $SPECLOOP_GREEDY_VERIFY, default "split"): "split", the two kernels
    (module doc); "row", one kernel, a program a row scanning all of its K+1 positions (no
    partials, no second launch; fewer programs: for an A/B at small batches). ``block``
    (None: 1024 split, 8192 row) and, split, ``chunk`` (None: `chunk_size`): the scan's
    sizes, powers of two (block <= chunk; small ones let interpreted tests cross chunks)."""
    return _run(d, target_logits, **kw)


def _run(d: torch.Tensor | None, target_logits: torch.Tensor, *, mode: str | None = None,
         chunk: int | None = None, block: int | None = None) -> torch.Tensor:
    """d None: the argmax [B] of target_logits [B, 1, V]; else greedy_verify's packed."""
    import triton

    partials_kernel, combine_kernel, row_kernel, _ = _kernels()
    mode = _MODE if mode is None else mode
    if mode not in ("split", "row"):
        raise ValueError(f"greedy_verify: mode={mode!r} (or $SPECLOOP_GREEDY_VERIFY): "
                         "'split' or 'row' ('torch': the torch ops, no kernel)")
    B, T, V = target_logits.shape
    if target_logits.stride(2) != 1:
        target_logits = target_logits.contiguous()
    dev = target_logits.device
    shape = (B,) if d is None else (B, T + 1)
    out = torch.empty(shape, dtype=torch.int64, device=dev)
    if d is None or T == 1:  # no drafts: out stands in for the pointer (no load reads it)
        d_arg, s_d = out, 0
    else:
        d_arg = d if d.stride(1) == 1 else d.contiguous()
        s_d = d_arg.stride(0)
    t_p2 = triton.next_power_of_2(T)
    pdl = _pdl.launch_kw(target_logits)
    if mode == "row":
        row_kernel[(B,)](target_logits, d_arg, out, V, T - 1, target_logits.stride(0),
                         target_logits.stride(1), s_d, T_P2=t_p2,
                         BLOCK=_ROW_BLOCK if block is None else block, IMAX=_INT_MAX,
                         COUNT=d is not None, num_warps=16, **pdl)
        return out
    pv, pi, S = _partials(partials_kernel, target_logits, chunk, block, pdl)
    combine_kernel[(B,)](pv, pi, d_arg, out, T - 1, S, s_d, T_P2=t_p2,
                         S_P2=triton.next_power_of_2(S), IMAX=_INT_MAX,
                         COUNT=d is not None, num_warps=1, **pdl)
    return out


def tree_greedy_verify(tokens: torch.Tensor, target_logits: torch.Tensor,
                       parents: torch.Tensor, ancestors: torch.Tensor,
                       depths: torch.Tensor, *, chunk: int | None = None,
                       block: int | None = None, walk: str | None = None,
                       warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft tree's greedy VERIFY in two kernels (``samplers/_tree.accept_tree`` of
    ``target_logits.argmax(-1)``, the same choice): tokens [B, R] (the root and the
    nodes), target_logits [B, R, V], the tree's tables (``TreeTables``: parents [R],
    ancestors [R, D+1], depths [R]) -> (packed [B, D+2]: the path's tokens, the target
    after them, -1 past it, then the count; path [B, D+1]). The partials kernel is
    greedy_verify's; ``chunk``, ``block`` as its. ``walk`` (None: $SPECLOOP_TREE_WALK,
    default "store"): "store", the parents' targets through memory; "registers", in
    registers (``_tree_kernel``'s REGISTERS; the same output). ``warps``: the tree
    kernel's (None: ``tree_warps``)."""
    import triton

    partials_kernel, _, _, tree_kernel = _kernels()
    B, R, V = target_logits.shape
    D = ancestors.shape[1] - 1
    if target_logits.stride(2) != 1:
        target_logits = target_logits.contiguous()
    tokens = tokens if tokens.stride(1) == 1 else tokens.contiguous()
    dev = target_logits.device
    walk = _TREE_WALK if walk is None else walk
    if walk not in ("store", "registers"):
        raise ValueError(f"tree_greedy_verify: walk={walk!r} (or $SPECLOOP_TREE_WALK): "
                         "'store' or 'registers'")
    registers = walk == "registers"
    packed = torch.empty(B, D + 2, dtype=torch.int64, device=dev)
    path = torch.empty(B, D + 1, dtype=torch.int64, device=dev)
    # The targets' scratch (the store walk's; the register walk reads none).
    tgt = packed if registers else torch.empty(B, R, dtype=torch.int64, device=dev)
    pdl = _pdl.launch_kw(target_logits)
    pv, pi, S = _partials(partials_kernel, target_logits, chunk, block, pdl)
    t_p2, s_p2 = triton.next_power_of_2(R), triton.next_power_of_2(S)
    tree_kernel[(B,)](pv, pi, tokens, tgt, parents, ancestors, depths, packed, path, R, D,
                      S, tokens.stride(0), T_P2=t_p2,
                      **({"REGISTERS": True} if registers else {}),
                      S_P2=s_p2, D_P2=triton.next_power_of_2(D + 1),
                      IMAX=_INT_MAX, num_warps=warps or tree_warps(t_p2, s_p2), **pdl)
    return packed, path


def _partials(partials_kernel: Any, target_logits: torch.Tensor, chunk: int | None,
              block: int | None, pdl: dict[str, Any]
              ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Kernel 1 over target_logits [B, T, V] (last dim contiguous): -> (the partial maxima
    [B*T*S], their first indices, S chunks a row)."""
    import triton

    B, T, V = target_logits.shape
    rows = B * T
    chunk = chunk_size(rows, V) if chunk is None else chunk
    block = min(_BLOCK if block is None else block, chunk)
    S = triton.cdiv(V, chunk)
    pv = torch.empty(rows * S, dtype=torch.float32, device=target_logits.device)
    pi = torch.empty(rows * S, dtype=torch.int32, device=target_logits.device)
    partials_kernel[(rows, S)](target_logits, pv, pi, V, T, target_logits.stride(0),
                               target_logits.stride(1), S, CHUNK=chunk, BLOCK=block,
                               IMAX=_INT_MAX, num_warps=4, **pdl)
    return pv, pi, S
