# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-calls=False, disallow-untyped-decorators=False
"""Skinny GEMMs on CUDA: y = x @ W^T (+ bias) for a few rows of x, as one Triton kernel.

A decode step multiplies 1..32 rows (B tokens, or B·(K+1) in VERIFY) by each weight. cuBLAS
picks tiles for those row counts that leave most of an H200's 132 SMs idle (3.7-3.9 us for
SmolLM2's 576-wide GEMMs, whose weights take ~0.3-1.5 us to stream from HBM). This kernel
splits N finely (BLOCK_N rows of W a program, optionally K over SPLIT_K programs), so each
GEMM spreads over many SMs:

- ``DOT=False``: a program loads its [BLOCK_N, BLOCK_K] tile of W once (all of K, or
  its split's part, in one pass: no loop to pipeline) and then, row after row, a broadcast
  multiply and a sum over K; no tensor cores (tl.dot needs >= 16 rows, and a GEMV is
  bound by reading W anyway);
- ``DOT=True``: tl.dot on x's rows padded to 16 in registers (masked loads), pipelined
  over K by num_stages; where one BLOCK_K covers a program's K range (``ONE_PASS``, e.g.
  ``d16x1024`` for K = 576), one load of W, issued before PDL's wait, and one tl.dot: the
  tensor cores make a row's cost nearly independent of the number of rows (1..16), where
  the broadcast paths' fp32 products grow with them. A K range that fills at most three
  quarters of its power-of-two tile runs as two tiles chained through the accumulator
  (``PIECE``: K = 576 as 512 + 64, 36 MMA steps a row block, not 64): the same steps in
  the same order less those that add zeros, so the same bits (H200: qkv's d64x1024 at 2-16
  rows 1.95-2.32 us against 2.21-2.34; ``SPECLOOP_SKINNY_PIECES=0``: one tile);
- ``TILE=True`` (the ``b`` family, ``SkinnyConfig.tile_m`` > 0): like the broadcast path,
  but a program takes a fixed block of ``tile_m`` rows and reduces all of them in ONE
  reduction over K: x as [BLOCK_M, 1, BLOCK_K], the W tile once as [1, BLOCK_N, BLOCK_K],
  ``sum(x * w, axis=2)`` -> [BLOCK_M, BLOCK_N], one masked 2-D store. The broadcast path
  reduces row after row, each a cross-warp reduction (a latency step: its 4-row call costs
  ~1.5x its 1-row call on an H200); here a block of 2, 4 or 8 rows costs one. Rows past M
  are masked (loaded as 0, never stored), so a row's arithmetic is the same whatever M.

A row's arithmetic depends on the configuration alone, not on the number of rows in the
call (a row's sums never mix in another row's values, and the code a row runs, its place
in its block included, is fixed by the configuration; tl.dot's rows are independent), so a
row gives the same bits in a call of 1 row or of 32: a CUDA graph padded to a larger batch
bucket computes what the unpadded call computes, as long as every configuration the
dispatcher picks for a shape gives the same bits. Different configurations may: without
tl.dot, configurations that sum a row over K in the same order do, whatever their family,
BLOCK_N or tile_m; on the H200 every ``v``/``b`` configuration at BLOCK_K 1024 and 4 warps
(and 8 warps at BLOCK_N >= 2) is one bit class, 2 warps another (the compiled split of K:
8 a thread x 32 lanes x BLOCK_K/256 warps, more warps along N where BLOCK_N >= 2; the
norm kernel's 1-D RMS sum takes every warp along K). ``models/_linear``'s table may therefore give a shape
different configurations for different row ranges, all of ONE class (one class under
the norm kernel too where the norm is fused), or above them a tail of tl.dot ranges with
F.linear's bits (models/_linear's rule); bench/bench_skinny_gemm.py measures the classes.

Accumulation is in fp32, rounded once to x's dtype at the store. SPLIT_K > 1 writes fp32
partial sums to a [SPLIT_K, M, N] scratch and a second small kernel adds them in split
order (no atomics), so every configuration is deterministic: the same inputs give the same
bits, and a CUDA-graph replay equals the eager call.

``ACT=1`` is the MLP's down projection on the fused gate-up output [M, 2I]: the prologue
loads gate and up and forms silu(gate) * up in fp32, rounded to x's dtype exactly as
``_kernels.silu_mul`` rounds it, so one kernel replaces silu_mul + the down GEMM. ``GLU``
puts the same arithmetic in the gate-up GEMM's epilogue instead: a program's tile of W is
its output columns' gate rows, then the same columns' up rows, each sum is rounded as the
gate-up output would be, and the program stores silu(gate) * up [M, I] (``glu_fits``
configurations: whole pairs in a tile, no split-K). The down GEMM then reads the
activation without a prologue, where the prologue form recomputed silu * up over all of
K in every program (``models/_linear`` ``norm_mlp``); both give the same bits.

``_norm_skinny_kernel`` (``skinny_norm_linear``) also takes the fused layer's residual add
+ RMSNorm (``_kernels.add_rms_norm``'s arithmetic) into the prologue of the GEMM after it,
for broadcast configurations that hold all of K in one pass: every program normalises the
few rows itself, the first column block stores the residual stream, and the normed rows
are never written. (It runs where ``models/_linear``'s table gives qkv or gate-up a fusable
prefix: the shipped table's at 1 row; from 2 rows its one-tile tl.dot qkv and gate-up take
add_rms_norm instead.)

On Hopper the three kernels are launched with Programmatic Dependent Launch (``GDC``,
``specloop.samplers._pdl``: its module doc has the rules): a program loads its tile of W
(and the norm weight, the bias) before ``gdc_wait`` and x after it, so the weight reads of
the next GEMM overlap the end of the kernel before (bench/bench_pdl.py), the one-tile tl.dot
form (``ONE_PASS``) too; the looped tl.dot path, which interleaves W and x, and the split-K
reduce wait first. The wait adds no
arithmetic: the same bits as without PDL.

Which configuration runs for which (N, K, rows) is ``models/_linear``'s table; this module
is the kernels and their launchers only.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from specloop.samplers import _pdl

try:  # Triton is optional: without it every linear is F.linear.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available() -> bool:
    return triton is not None


class SkinnyConfig(NamedTuple):
    """One launch configuration (the bench sweeps these; ``models/_linear`` keeps a table).

    Each output row's arithmetic depends on the configuration only, never on how many rows
    the call has (``block_m`` just groups them), so a row computes the same bits in a call
    of 1 row or of 32 — as a graph padded to a larger batch bucket, or a step taken at a
    larger bucket, needs to equal the unpadded call. Configurations of one bit class (the
    same summation order over K) compute the same bits too, so a shape may mix them by
    row count (models/_linear's table)."""

    dot: bool         # tl.dot (rows padded to 16) or broadcast-multiply-reduce
    block_n: int      # rows of W (output columns) per program; >= 16 with dot
    block_k: int      # dot: K per loop iteration (>= 16); broadcast: K per program, in
                      # one pass (K > block_k: cdiv(K, block_k) programs along K)
    split_k: int = 1  # dot: programs along K (> 1: fp32 partials + an ordered reduce)
    num_warps: int = 4
    num_stages: int = 3
    tile_m: int = 0   # > 0: rows per program; no tl.dot: all reduced in one 2-D
                      # reduction; tl.dot: its M (a power of two >= 16; 0: 16)
    slices: int = 1   # one-tile tl.dot: its K tile in this many slices, each its own
                      # tl.dot and accumulator (a power of two; its own bit class)
    slice_programs: bool = False  # those slices in programs of their own, the last to
                                  # finish adding them in order (the same bits)

    def block_m(self, rows: int) -> int:
        """Rows of x per program: for tl.dot 16 (padded), or ``tile_m`` where given (a
        program then reads its tile of W once for that many rows: VERIFY's 64-256 rows at
        batch 16-64, where 16 a program re-read W 4-16 times); ``tile_m`` (masked past M)
        for the one-reduction family; else up to 8 (a power of two), one after the other
        over the program's tile of W (more rows: more programs, each reading its tile of W
        again, from L2 after the first)."""
        if self.dot:
            return self.tile_m or 16
        return self.tile_m if self.tile_m else min(_pow2(rows), 8)

    def k_splits(self, k: int) -> tuple[int, int]:
        """-> (programs along K, K per program) for K = ``k``."""
        if not self.dot:
            return _cdiv(k, self.block_k), self.block_k
        split = max(1, min(self.split_k, _cdiv(k, self.block_k)))
        # Each split's K range a multiple of BLOCK_K (so no program straddles two splits).
        per = _cdiv(_cdiv(k, split), self.block_k) * self.block_k
        return _cdiv(k, per), per

    def one_pass(self, k: int) -> bool:
        """tl.dot whose BLOCK_K covers a program's K range (``ONE_PASS``: one load of W,
        before PDL's wait, and one tl.dot) for K = ``k``."""
        return self.dot and self.k_splits(k)[1] <= self.block_k

    def tag(self) -> str:
        """Compact name, e.g. ``d16x128s2w4n3`` (dot, BLOCK_N 16, BLOCK_K 128, split 2),
        ``d64x1024s1w8n1m64`` (dot over blocks of 64 rows), ``b4x2x1024s1w4n3`` (one
        reduction over 4 rows, BLOCK_N 2, BLOCK_K 1024)."""
        family = "d" if self.dot else f"b{self.tile_m}x" if self.tile_m else "v"
        rows = f"m{self.tile_m}" if self.dot and self.tile_m else ""
        slices = f"k{self.slices}" if self.slices > 1 else ""
        programs = "p" if self.slice_programs else ""
        return (f"{family}{self.block_n}x{self.block_k}s{self.split_k}"
                f"w{self.num_warps}n{self.num_stages}{rows}{slices}{programs}")

    def slices_for(self, k: int) -> int:
        """The SLICES a launch over K = ``k`` passes: ``slices`` for a one-tile tl.dot
        without split K whose slices are at least 16 wide, else 1 (its ranges unsliced).
        (``one_pass_piece`` decides the tiles the slices divide.)"""
        return 1 if self.slices <= 1 else _slices(self, k)

    def slice_grid(self, k: int) -> int:
        """The programs a row block's slices run in over K = ``k`` (``slice_programs``:
        one a slice, ``SLICE_PROGRAMS``), or 0: the slices in one program. Only where
        every slice is as wide (the down GEMM's K = 1536 as 3 x 512; K = 576's 256 + 256
        + 64 stays in one program) and reaches into K; the same bits either way."""
        return _slice_grid(self, k) if self.slice_programs else 0


class RopeWrite(NamedTuple):
    """Where a qkv product's heads go (``skinny_rope_linear``; ``_kernels.rope_cache_write``
    takes the same, less qkv): rows of positions ``start_pos`` [B] + ``pos_offset``.. in
    ``slots`` [B], pages through ``table``, rotated by ``cos`` / ``sin`` [positions, D]
    (``rope_offsets`` [T]: a draft tree's rows, rotated at their depth's position), k and
    v into ``k_cache`` / ``v_cache`` [pages, page_size, Hkv, D]."""

    start_pos: torch.Tensor
    slots: torch.Tensor
    table: torch.Tensor
    max_seq_len: int
    scratch_page: int
    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_heads: int
    pos_offset: int = 0
    rope_offsets: torch.Tensor | None = None

    def kernel_args(self, T: int) -> tuple[torch.Tensor | int, ...]:
        """The arguments every kernel that writes RoPE'd heads takes last, in this order
        (``_kernels._rope_write_kernel``, ``_skinny_rope_kernel``, ``_norm_skinny_kernel``'s
        ROPE): kc_ptr, vc_ptr, start_ptr, slot_ptr, table_ptr, cos_ptr, sin_ptr, rope_ptr
        (the start positions where no tree: not read), T, pos_offset, max_pos, s_page,
        s_off, s_table, pages_per_slot, max_seq_len, scratch_page."""
        start = self.start_pos.contiguous()
        return (self.k_cache, self.v_cache, start, self.slots.contiguous(), self.table,
                self.cos, self.sin,
                self.rope_offsets if self.rope_offsets is not None else start, T,
                self.pos_offset, self.cos.shape[0] - 1, self.k_cache.stride(0),
                self.k_cache.stride(1), self.table.stride(0), self.table.shape[1],
                self.max_seq_len, self.scratch_page)

    @staticmethod
    def unused_args(x: torch.Tensor) -> tuple[torch.Tensor | int, ...]:
        """``kernel_args``' places filled for a kernel launched without RoPE (not read)."""
        return (x,) * 8 + (1,) + (0,) * 8


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if triton is not None:

    @triton.jit
    def _silu_mul(g, u):
        """silu(g) * u in fp32 as _kernels.silu_mul computes it (g and u hold values of the
        stream's dtype): the one expression the prologue and the GLU epilogue share."""
        return g / (1.0 + tl.exp(-g)) * u

    @triton.jit
    def _load_x(rows, ks, mask, K, ACT: tl.constexpr):
        """x's elements ``ks`` of ``rows``; ACT == 1: the rows are gate_up [M, 2K]'s, and
        this is silu(gate) * up as _kernels.silu_mul computes and rounds it (the GEMM's
        input is that kernel's output, bit for bit)."""
        if ACT == 1:
            g = tl.load(rows + ks, mask=mask, other=0.0)
            u = tl.load(rows + K + ks, mask=mask, other=0.0).to(tl.float32)
            a = _silu_mul(g.to(tl.float32), u).to(g.dtype)
        else:
            a = tl.load(rows + ks, mask=mask, other=0.0)
        return a

    @triton.jit
    def _w_rows(pid_n, N, BLOCK_N: tl.constexpr, GLU: tl.constexpr):
        """-> (the program's BLOCK_N rows of W, which are in range, its output columns).
        GLU: W is [2N, K] (gate rows, then up rows) and the program's output columns are
        BLOCK_N / 2 of N: their gate rows, then the same columns' up rows, so each
        column's two sums sit in one tile (``_glu``)."""
        # (One output-column width for both returns: Triton types the branches alike.)
        width: tl.constexpr = BLOCK_N // 2 if GLU else BLOCK_N
        rc = pid_n * width + tl.arange(0, width)
        if GLU:
            c = tl.arange(0, BLOCK_N)
            col = pid_n * width + c % width
            return col + (c // width) * N, col < N, rc
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        return rn, rn < N, rc

    @triton.jit
    def _glu(acc, dtype, BLOCK_N: tl.constexpr):
        """acc [..., BLOCK_N] fp32 (``_w_rows``' GLU order: gate sums, then up sums) ->
        silu(gate) * up [..., BLOCK_N / 2] in ``dtype``: each sum rounded to ``dtype`` as
        the gate-up GEMM stores it, then _kernels.silu_mul's arithmetic and rounding, so
        the output is silu_mul(gate_up)'s, bit for bit."""
        if len(acc.shape) == 2:
            pairs = tl.permute(tl.reshape(acc, [acc.shape[0], 2, BLOCK_N // 2]), (0, 2, 1))
        else:
            pairs = tl.permute(tl.reshape(acc, [2, BLOCK_N // 2]), (1, 0))
        g, u = tl.split(pairs)
        return _silu_mul(g.to(dtype).to(tl.float32), u.to(dtype).to(tl.float32)).to(dtype)

    @triton.jit
    def _store_tile(y_ptr, rm, m_ok, rn, n_ok, rc, acc, N, stride_ym,
                    BLOCK_N: tl.constexpr, GLU: tl.constexpr):
        """acc [BM, BLOCK_N] of rows ``rm`` rounded into y (GLU: silu(gate) * up at the
        output columns ``rc``; else columns ``rn``)."""
        if GLU:
            tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rc[None, :],
                     _glu(acc, y_ptr.dtype.element_ty, BLOCK_N),
                     mask=m_ok[:, None] & (rc < N)[None, :])
        else:
            tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :],
                     acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _store_row(y_ptr, row, M, rn, n_ok, rc, acc, N, stride_ym,
                   BLOCK_N: tl.constexpr, GLU: tl.constexpr):
        """acc [BLOCK_N] of row ``row`` (stored only if < M), as ``_store_tile``."""
        if GLU:
            tl.store(y_ptr + row.to(tl.int64) * stride_ym + rc,
                     _glu(acc, y_ptr.dtype.element_ty, BLOCK_N),
                     mask=(rc < N) & (rc * 0 + row < M))
        else:
            tl.store(y_ptr + row.to(tl.int64) * stride_ym + rn,
                     acc.to(y_ptr.dtype.element_ty), mask=n_ok & (rn * 0 + row < M))

    @triton.jit
    def _one_pass_ks(k_lo, BLOCK_K: tl.constexpr, PIECE: tl.constexpr):
        """The one-tile tl.dot's (``ONE_PASS``) K offsets from k_lo: (the first BLOCK_K / 2,
        then PIECE wide) where PIECE > 0, else (all BLOCK_K, the same again). K = 576 as
        512 + 64, where one tile of 1024 runs 64 MMA steps a row block, 28 of them on zero
        padding: the two tl.dot chained through the accumulator run the same MMA steps in
        the same order as one tile, less those that add zeros, so the same bits."""
        if PIECE > 0:
            ka = k_lo + tl.arange(0, BLOCK_K // 2)
            kb = k_lo + BLOCK_K // 2 + tl.arange(0, PIECE)
        else:
            ka = k_lo + tl.arange(0, BLOCK_K)
            kb = ka
        return ka, kb

    @triton.jit
    def _slice_ks(k_lo, BLOCK_K: tl.constexpr, PIECE: tl.constexpr, SLICES: tl.constexpr):
        """A sliced one-tile tl.dot's K offsets (``SkinnyConfig.slices`` > 1), a tuple:
        _one_pass_ks' first tile in SLICES slices, then its PIECE tile in slices as wide
        (one PIECE wide where it is narrower). Each slice is its own tl.dot into its own
        accumulator (_dot_one_pass), so a row block's chain of dependent MMA steps is one
        slice's, not all of K's. (The tuples here and below grow a slice at a time; mypy
        types a tuple by its length, hence their ignores.)"""
        FIRST: tl.constexpr = BLOCK_K // 2 if PIECE > 0 else BLOCK_K
        SW: tl.constexpr = FIRST // SLICES
        ks = (k_lo + tl.arange(0, SW),)
        for s in tl.static_range(1, SLICES):
            ks = ks + (k_lo + s * SW + tl.arange(0, SW),)  # type: ignore[assignment]
        if PIECE > SW:
            for j in tl.static_range(PIECE // SW):
                ks = ks + (k_lo + FIRST + j * SW + tl.arange(0, SW),)  # type: ignore[assignment]
        elif PIECE > 0:
            ks = ks + (k_lo + FIRST + tl.arange(0, PIECE),)  # type: ignore[assignment]
        return ks

    @triton.jit
    def _load_slices(rows, ok, ks, k_hi, K, ACT: tl.constexpr):
        """A tuple: ``rows`` ([R, 1] pointers; rows ``ok``) at each of _slice_ks' offsets
        ``ks`` below k_hi, by _load_x (ACT as there: W's tiles with 0, x's with its ACT)."""
        ts = (_load_x(rows, ks[0][None, :], ok[:, None] & (ks[0] < k_hi)[None, :], K, ACT),)
        for i in tl.static_range(1, len(ks)):
            t_i = _load_x(rows, ks[i][None, :], ok[:, None] & (ks[i] < k_hi)[None, :], K, ACT)
            ts = ts + (t_i,)  # type: ignore[assignment]
        return ts

    @triton.jit
    def _w_one_pass(w_rows, n_ok, k_lo, k_hi, BLOCK_K: tl.constexpr, PIECE: tl.constexpr,
                    SLICES: tl.constexpr = 1):
        """The one-tile tl.dot's tiles of W (_one_pass_ks' split) for the K range
        [k_lo, k_hi) of W's ``w_rows`` ([BLOCK_N, 1] pointers; rows ``n_ok``); one tile
        twice where PIECE is 0. SLICES > 1: a tuple of _slice_ks' tiles, twice. Loaded
        before PDL's wait: _dot_one_pass takes them after."""
        if SLICES > 1:
            ws = _load_slices(w_rows, n_ok, _slice_ks(k_lo, BLOCK_K, PIECE, SLICES), k_hi, 0,
                              0)
            wa = ws
            wb = ws
        else:
            ka, kb = _one_pass_ks(k_lo, BLOCK_K, PIECE)
            wa = tl.load(w_rows + ka[None, :], mask=n_ok[:, None] & (ka < k_hi)[None, :],
                         other=0.0)
            if PIECE > 0:
                wb = tl.load(w_rows + kb[None, :], mask=n_ok[:, None] & (kb < k_hi)[None, :],
                             other=0.0)
            else:
                wb = wa
        return wa, wb

    @triton.jit
    def _nw_one_pass(nw_ptr, K, BLOCK_K: tl.constexpr, PIECE: tl.constexpr,
                     SLICES: tl.constexpr = 1):
        """The RMSNorm weight as _w_one_pass splits K (all of K in one program)."""
        if SLICES > 1:
            ks = _slice_ks(0, BLOCK_K, PIECE, SLICES)
            ns = (tl.load(nw_ptr + ks[0], mask=ks[0] < K, other=0.0),)
            for i in tl.static_range(1, len(ks)):
                n_i = tl.load(nw_ptr + ks[i], mask=ks[i] < K, other=0.0)
                ns = ns + (n_i,)  # type: ignore[assignment]
            na = ns
            nb = ns
        else:
            ka, kb = _one_pass_ks(0, BLOCK_K, PIECE)
            na = tl.load(nw_ptr + ka, mask=ka < K, other=0.0)
            if PIECE > 0:
                nb = tl.load(nw_ptr + kb, mask=kb < K, other=0.0)
            else:
                nb = na
        return na, nb

    @triton.jit
    def _dot_slices(x_rows, m_ok, K, k_lo, k_hi, ws, acc, ACT: tl.constexpr,
                    BLOCK_K: tl.constexpr, PIECE: tl.constexpr, SLICES: tl.constexpr,
                    NORM: tl.constexpr, ns, eps):
        """_dot_one_pass with SLICES > 1: x's slices (_slice_ks), each times its tile of W
        in a tl.dot of its own, the slices' sums added in order, then to ``acc``. Each
        tl.dot starts from a zero the compiler cannot see (0 * K): from a constant zero
        it would fold "dot + dot" into one chain of MMA steps again. NORM: the sum of
        squares over the slices in order (its own bits)."""
        xs = _load_slices(x_rows, m_ok, _slice_ks(k_lo, BLOCK_K, PIECE, SLICES), k_hi, K, ACT)
        if NORM:
            f = xs[0].to(tl.float32)
            ss = tl.sum(f * f, axis=1)
            for i in tl.static_range(1, len(xs)):
                f = xs[i].to(tl.float32)
                ss += tl.sum(f * f, axis=1)
            inv = 1.0 / tl.sqrt(ss / K + eps)
            normed = (ns[0][None, :] * (xs[0].to(tl.float32) * inv[:, None]).to(xs[0].dtype),)
            for i in tl.static_range(1, len(xs)):
                h_i = ns[i][None, :] * (xs[i].to(tl.float32) * inv[:, None]).to(xs[i].dtype)
                normed = normed + (h_i,)  # type: ignore[assignment]
            xs = normed
        zero = tl.zeros_like(acc) + K.to(tl.float32) * 0.0
        total = tl.dot(xs[0], tl.trans(ws[0]), zero, out_dtype=tl.float32)
        for i in tl.static_range(1, len(xs)):
            total += tl.dot(xs[i], tl.trans(ws[i]), zero, out_dtype=tl.float32)
        return acc + total

    @triton.jit
    def _dot_one_pass(x_rows, m_ok, K, k_lo, k_hi, wa, wb, acc, ACT: tl.constexpr,
                      BLOCK_K: tl.constexpr, PIECE: tl.constexpr, NORM: tl.constexpr, na, nb,
                      eps, SLICES: tl.constexpr = 1):
        """acc + x's rows ``x_rows`` ([BLOCK_M, 1] pointers; rows ``m_ok``) over [k_lo, k_hi)
        times _w_one_pass's tiles, transposed: x loaded here (after PDL's wait), one tl.dot
        a tile. _skinny_kernel's and _skinny_rope_kernel's product, so both give a row the
        same bits; with one tile the arithmetic of _skinny_kernel's loop when it runs
        once. NORM (the program's K range all of K): x is the residual stream, and the
        product is of its RMSNorm (weights ``na``, ``nb`` from _nw_one_pass): add_rms_norm's
        arithmetic with its sum of squares in this layout's order, x loaded once. SLICES >
        1: _dot_slices (``wa`` and ``na`` the tuples of slices)."""
        if SLICES > 1:
            acc = _dot_slices(x_rows, m_ok, K, k_lo, k_hi, wa, acc, ACT, BLOCK_K, PIECE,
                              SLICES, NORM, na, eps)
        else:
            ka, kb = _one_pass_ks(k_lo, BLOCK_K, PIECE)
            if PIECE > 0:
                xa = _load_x(x_rows, ka[None, :], m_ok[:, None] & (ka < k_hi)[None, :], K,
                             ACT)
                xb = _load_x(x_rows, kb[None, :], m_ok[:, None] & (kb < k_hi)[None, :], K,
                             ACT)
                if NORM:
                    fa = xa.to(tl.float32)
                    fb = xb.to(tl.float32)
                    inv = 1.0 / tl.sqrt((tl.sum(fa * fa, axis=1) + tl.sum(fb * fb, axis=1))
                                        / K + eps)
                    xa = na[None, :] * (fa * inv[:, None]).to(xa.dtype)
                    xb = nb[None, :] * (fb * inv[:, None]).to(xb.dtype)
                acc = tl.dot(xa, tl.trans(wa), acc, out_dtype=tl.float32)
                acc = tl.dot(xb, tl.trans(wb), acc, out_dtype=tl.float32)
            else:
                a = _load_x(x_rows, ka[None, :], m_ok[:, None] & (ka < k_hi)[None, :], K, ACT)
                if NORM:
                    fa = a.to(tl.float32)
                    inv = 1.0 / tl.sqrt(tl.sum(fa * fa, axis=1) / K + eps)
                    a = na[None, :] * (fa * inv[:, None]).to(a.dtype)
                acc += tl.dot(a, tl.trans(wa), out_dtype=tl.float32)
        return acc

    @triton.jit
    def _slice_program(x_s, w_s, acc, K, p_ptr, cnt_ptr, pid_n, pid_j, pid_m,
                       SLICE_PROGRAMS: tl.constexpr):
        """Slice ``pid_j`` of a row block's sliced one-tile tl.dot in a program of its own:
        its product (from a zero the compiler cannot see, as _dot_slices') into the fp32
        scratch [SLICE_PROGRAMS, programs along M, along N, BLOCK_M, BLOCK_N], then the
        (n, m) counter; the program that brings it to SLICE_PROGRAMS resets it and adds the
        slices' products in order, then to ``acc``: _dot_slices' sum, the same bits.
        -> (that sum, or ``acc`` in the others; how many programs finished before this
        one: SLICE_PROGRAMS - 1 in the last). The counter discipline is
        _kernels._paged_attention_kernel's "last program combines" (its module doc)."""
        BM: tl.constexpr = acc.shape[0]
        BN: tl.constexpr = acc.shape[1]
        zero = tl.zeros_like(acc) + K.to(tl.float32) * 0.0
        part = tl.dot(x_s, tl.trans(w_s), zero, out_dtype=tl.float32)
        tile = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        group = pid_m * tl.num_programs(0) + pid_n
        size = tl.num_programs(2) * tl.num_programs(0) * (BM * BN)
        at = p_ptr + group.to(tl.int64) * (BM * BN) + tile
        tl.store(at + pid_j.to(tl.int64) * size, part)
        # The barrier puts every thread's store before the release of this program's
        # increment; the last program acquires them all and reads them through L2 (.cg).
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + group, 1, sem="acq_rel", scope="gpu")
        if done == SLICE_PROGRAMS - 1:
            tl.atomic_xchg(cnt_ptr + group, 0, sem="relaxed", scope="gpu")
        last = tile * 0 + done == SLICE_PROGRAMS - 1     # (a mask of the tile's shape)
        total = tl.load(at, mask=last, other=0.0, cache_modifier=".cg")
        for j in tl.static_range(1, SLICE_PROGRAMS):
            total += tl.load(at + j * size, mask=last, other=0.0, cache_modifier=".cg")
        return acc + total, done

    # M is not specialised (Triton would compile M == 1 apart): one compile per config.
    @triton.jit(do_not_specialize=["M"])
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       k_per_split, r_ptr, nw_ptr, eps, p_ptr, cnt_ptr, ACT: tl.constexpr,
                       HAS_BIAS: tl.constexpr, DOT: tl.constexpr, SPLIT_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       TILE: tl.constexpr = False, GDC: tl.constexpr = False,
                       ONE_PASS: tl.constexpr = False, GLU: tl.constexpr = False,
                       PIECE: tl.constexpr = 0, RES: tl.constexpr = False,
                       NORM: tl.constexpr = False, SLICES: tl.constexpr = 1,
                       SLICE_PROGRAMS: tl.constexpr = 0):
        # GLU: W is a gate-up weight [2N, K] and y [M, N] is silu(gate) * up (``_glu``;
        # SPLIT_K == 1). N is y's width either way. PIECE (ONE_PASS): the K range in two
        # tiles, BLOCK_K / 2 then PIECE wide (``one_pass_piece``), not one of BLOCK_K.
        # RES (a 2-D block, SPLIT_K == 1): y = r + the product, each rounded as
        # add_rms_norm rounds the residual add (r [M, N], y's strides). NORM (ONE_PASS
        # without split K): x is the residual stream and the product is of its RMSNorm by
        # nw_ptr's weight (_dot_one_pass). SLICES (ONE_PASS): the tiles in slices, each its
        # own tl.dot (_dot_slices). SLICE_PROGRAMS (SLICES of one width, no NORM): program
        # (n, j, m) takes slice j alone (_slice_program; p_ptr its fp32 scratch, cnt_ptr
        # a zeroed counter a (n, m)), the last of them adds the slices in order and ends
        # as the one program would (the same bits).
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        if GDC:  # PDL: each path below waits once, after its weight loads, before x
            tl.extra.cuda.gdc_launch_dependents()
        rn, n_ok, rc = _w_rows(pid_n, N, BLOCK_N, GLU)
        rk = tl.arange(0, BLOCK_K)
        # This program's K range (k_per_split is a multiple of BLOCK_K).
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(K, k_lo + k_per_split)
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
        if DOT or TILE:
            # A [BLOCK_M, BLOCK_N] block of y at once (one 2-D store).
            rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            m_ok = rm < M
            if DOT:
                x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                if SLICE_PROGRAMS > 0:
                    # This program's slice of W before the wait, its slice of x after.
                    SW: tl.constexpr = (BLOCK_K // 2 if PIECE > 0 else BLOCK_K) // SLICES
                    ks = pid_k * SW + tl.arange(0, SW)
                    w_s = tl.load(w_rows + ks[None, :],
                                  mask=n_ok[:, None] & (ks < K)[None, :], other=0.0)
                    if GDC:
                        tl.extra.cuda.gdc_wait()
                    if RES:     # the stream's block, asked before the product
                        r = tl.load(r_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :],
                                    mask=m_ok[:, None] & n_ok[None, :], other=0.0)
                    x_s = _load_x(x_rows, ks[None, :], m_ok[:, None] & (ks < K)[None, :], K,
                                  ACT)
                    acc, done = _slice_program(x_s, w_s, acc, K, p_ptr, cnt_ptr, pid_n,
                                               pid_k, pid_m, SLICE_PROGRAMS)
                    # Only the last program stores.
                    m_ok = m_ok & (rm * 0 + done == SLICE_PROGRAMS - 1)
                elif ONE_PASS:
                    # W's tiles (and the norm's weight) before the wait, x after it, one
                    # tl.dot a tile.
                    wa, wb = _w_one_pass(w_rows, n_ok, k_lo, k_hi, BLOCK_K, PIECE, SLICES)
                    if NORM:
                        na, nb = _nw_one_pass(nw_ptr, K, BLOCK_K, PIECE, SLICES)
                    else:
                        na, nb = wa, wb     # (not read)
                    if GDC:
                        tl.extra.cuda.gdc_wait()
                    if RES:     # the stream's block, asked before the product
                        r = tl.load(r_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :],
                                    mask=m_ok[:, None] & n_ok[None, :], other=0.0)
                    acc = _dot_one_pass(x_rows, m_ok, K, k_lo, k_hi, wa, wb, acc, ACT, BLOCK_K,
                                        PIECE, NORM, na, nb, eps, SLICES)
                else:
                    if GDC:  # W and x interleave in the pipelined loop: the wait first
                        tl.extra.cuda.gdc_wait()
                    for k0 in range(k_lo, k_hi, BLOCK_K):
                        ks = k0 + rk
                        k_ok = ks < k_hi
                        a = _load_x(x_rows, ks[None, :], m_ok[:, None] & k_ok[None, :], K,
                                    ACT)
                        w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :],
                                    other=0.0)
                        acc += tl.dot(a, tl.trans(w), out_dtype=tl.float32)
            else:
                # The program's tile of W once and its BLOCK_M rows of x, all reduced over
                # K in one reduction; rows past M load as 0 and are not stored, so a row's
                # sum is the same whatever M. Both loads are 3-D ([1, BN, BK],
                # [BM, 1, BK]): they then share the product's layout (with num_warps <=
                # BLOCK_K / 256), so neither goes through shared memory before the multiply.
                ks = k_lo + rk
                k_ok = ks < k_hi
                w = tl.load(w_rows[None, :, :] + ks[None, None, :],
                            mask=n_ok[None, :, None] & k_ok[None, None, :],
                            other=0.0).to(tl.float32)
                if GDC:
                    tl.extra.cuda.gdc_wait()
                if RES:         # the stream's block, asked before the product
                    r = tl.load(r_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :],
                                mask=m_ok[:, None] & n_ok[None, :], other=0.0)
                x_rows = x_ptr + rm.to(tl.int64)[:, None, None] * stride_xm + ks[None, None, :]
                # x_rows already point at ks (offset 0): the PTX of the code before _load_x.
                a = _load_x(x_rows, 0, m_ok[:, None, None] & k_ok[None, None, :], K, ACT)
                acc = tl.sum(a.to(tl.float32) * w, axis=2)                  # [BM, BN]
            out_mask = m_ok[:, None] & n_ok[None, :]
            if SPLIT_K == 1:
                if HAS_BIAS:
                    acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                if RES:         # r + the product as rounded, rounded once more at the store
                    acc = r.to(tl.float32) + acc.to(y_ptr.dtype.element_ty).to(tl.float32)
                _store_tile(y_ptr, rm, m_ok, rn, n_ok, rc, acc, N, stride_ym, BLOCK_N, GLU)
            else:
                # y_ptr is the fp32 scratch [SPLIT_K, M, N]; _splitk_reduce_kernel finishes.
                part = y_ptr + (pid_k * M + rm.to(tl.int64))[:, None] * N + rn[None, :]
                tl.store(part, acc, mask=out_mask)
        else:
            # The program's tile of W once, then each of its rows in turn: a row's sum is
            # the same reduction whatever the number of rows.
            ks = k_lo + rk
            k_ok = ks < k_hi
            w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            if HAS_BIAS:
                bias = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            if GDC:
                tl.extra.cuda.gdc_wait()
            for r in tl.static_range(BLOCK_M):
                row = pid_m * BLOCK_M + r
                a_ok = k_ok & (rk * 0 + row < M)
                a = _load_x(x_ptr + row.to(tl.int64) * stride_xm, ks, a_ok, K, ACT)
                acc = tl.sum(a.to(tl.float32)[None, :] * w, axis=1)
                y_ok = n_ok & (rn * 0 + row < M)
                if SPLIT_K == 1:
                    if HAS_BIAS:
                        acc += bias
                    _store_row(y_ptr, row, M, rn, n_ok, rc, acc, N, stride_ym, BLOCK_N, GLU)
                else:
                    tl.store(y_ptr + (pid_k * M + row).to(tl.int64) * N + rn, acc, mask=y_ok)

    @triton.jit
    def _rope_w_rows(pid_n, BLOCK_N: tl.constexpr, D: tl.constexpr):
        """A qkv GEMM program's rows of W where RoPE is its epilogue: D / BLOCK_N programs a
        head, program j of head h taking BLOCK_N / 2 dims of the head's first half and
        the same dims of its second half (the pairs RoPE rotates together), so its tile
        is [first-half sums | second-half sums]; BLOCK_N = D: the head's rows in order.
        -> (W's rows, the head, the dims of the first half)."""
        HALF_N: tl.constexpr = BLOCK_N // 2
        per_head: tl.constexpr = D // BLOCK_N
        head = pid_n // per_head
        dims = (pid_n % per_head) * HALF_N + tl.arange(0, HALF_N)
        c = tl.arange(0, BLOCK_N)
        rows = head * D + (pid_n % per_head) * HALF_N + c % HALF_N + (c // HALF_N) * (D // 2)
        return rows, head, dims

    @triton.jit
    def _rope_rows(rm, m_ok, start_ptr, slot_ptr, T, pos_offset):
        """Rows ``rm`` (token t of request b, rows of [B, T]) -> (position, slot, t), as
        _kernels._rope_write_kernel finds them; loaded after PDL's wait, before the
        product, so the loads overlap it."""
        b = rm // T
        t = rm % T
        p = tl.load(start_ptr + b, mask=m_ok, other=0) + pos_offset + t
        slot = tl.load(slot_ptr + b, mask=m_ok, other=0)
        return p, slot, t

    @triton.jit
    def _rope_store(acc, rm, m_ok, p, slot, t, head, dims, table_ptr, cos_ptr, sin_ptr,
                    q_ptr, kc_ptr, vc_ptr, rope_ptr, max_pos, s_page, s_off, s_table,
                    pages_per_slot, max_seq_len, scratch_page, HQ: tl.constexpr,
                    HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                    TREE: tl.constexpr):
        """The qkv epilogue: acc [BM, 2W] fp32 (_rope_w_rows' order: head ``head``'s dims
        ``dims`` [W] of its first half, then the same of its second) of rows ``rm``, each
        sum rounded as the GEMM stores it, then _kernels._rope_write_kernel's arithmetic:
        a q or k head rotated at its row's position (TREE: its depth's) into q [M, HQ, D]
        or the row's cache page, a v head stored into its page as rounded. The same bits
        as the qkv product, then rope_cache_write."""
        W: tl.constexpr = acc.shape[1] // 2
        half: tl.constexpr = D // 2
        dtype = q_ptr.dtype.element_ty
        x1, x2 = tl.split(tl.permute(tl.reshape(acc.to(dtype), [acc.shape[0], 2, W]),
                                     (0, 2, 1)))
        index = tl.minimum(p // PAGE, pages_per_slot - 1)
        page = tl.load(table_ptr + slot * s_table + index, mask=m_ok, other=0).to(tl.int64)
        page = tl.where(p < max_seq_len, page, scratch_page)
        cell = page[:, None] * s_page + (p % PAGE)[:, None] * s_off + dims[None, :]
        ok = m_ok[:, None]
        if head >= HQ + HKV:                     # a v head: stored as the GEMM rounds it
            out = vc_ptr + cell + (head - HQ - HKV) * D
            tl.store(out, x1, mask=ok)
            tl.store(out + half, x2, mask=ok)
        else:
            if TREE:    # a draft tree's row: stored at p, rotated at its depth's position
                pos = tl.minimum(p - t + tl.load(rope_ptr + t, mask=m_ok, other=0), max_pos)
            else:
                pos = tl.minimum(p, max_pos)
            f1 = x1.to(tl.float32)
            f2 = x2.to(tl.float32)
            at = pos[:, None] * D + dims[None, :]
            c = tl.load(cos_ptr + at, mask=ok, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + at, mask=ok, other=0.0).to(tl.float32)
            o1 = (f1 * c - f2 * s).to(dtype)
            o2 = (f2 * c + f1 * s).to(dtype)
            if head < HQ:
                out = q_ptr + rm.to(tl.int64)[:, None] * (HQ * D) + head * D + dims[None, :]
            else:
                out = kc_ptr + cell + (head - HQ) * D
            tl.store(out, o1, mask=ok)
            tl.store(out + half, o2, mask=ok)

    # M, T and pos_offset vary between calls and only offset rows and positions.
    @triton.jit(do_not_specialize=["M", "T", "pos_offset"],
                do_not_specialize_on_alignment=["start_ptr", "slot_ptr", "rope_ptr"])
    def _skinny_rope_kernel(x_ptr, w_ptr, b_ptr, q_ptr, nw_ptr, M, K, stride_xm, stride_wn,
                            eps, kc_ptr, vc_ptr, start_ptr, slot_ptr, table_ptr, cos_ptr,
                            sin_ptr, rope_ptr, T, pos_offset, max_pos, s_page, s_off, s_table,
                            pages_per_slot, max_seq_len, scratch_page, HQ: tl.constexpr,
                            HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                            HAS_BIAS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                            PIECE: tl.constexpr = 0, TREE: tl.constexpr = False,
                            GDC: tl.constexpr = False, NORM: tl.constexpr = False,
                            SLICES: tl.constexpr = 1, BLOCK_N: tl.constexpr = 0,
                            tok_ptr=None, stream_ptr=None, GATHER: tl.constexpr = False):
        # The qkv GEMM as _skinny_kernel's one-tile tl.dot and _rope_store as its
        # epilogue: the same bits as skinny_linear then rope_cache_write, without the qkv
        # product's round trip through memory or the rope kernel's launch. A program's
        # output columns are BLOCK_N of one head (0: D, the whole head: q, k or v; less,
        # _rope_w_rows' pairs of a head, D / BLOCK_N programs a head: more programs for
        # the same W). NORM: x is the residual stream and the product is of its RMSNorm
        # by nw_ptr's weight (_dot_one_pass). GATHER: x_ptr is the embedding table and
        # row m's is row tok_ptr[m] of it (no embedding kernel before the first layer);
        # program 0 also stores those rows, the residual stream, at stream_ptr [M, K].
        BN: tl.constexpr = BLOCK_N if BLOCK_N > 0 else D
        if GDC:  # PDL: W (the bias, the norm's weight) before the wait; the rest after
            tl.extra.cuda.gdc_launch_dependents()
        rn, head, dims = _rope_w_rows(tl.program_id(0), BN, D)
        n_ok = rn < (HQ + 2 * HKV) * D
        wa, wb = _w_one_pass(w_ptr + rn.to(tl.int64)[:, None] * stride_wn, n_ok, 0, K,
                             BLOCK_K, PIECE, SLICES)
        if NORM:
            na, nb = _nw_one_pass(nw_ptr, K, BLOCK_K, PIECE, SLICES)
        else:
            na, nb = wa, wb     # (not read)
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn).to(tl.float32)
        if GDC:
            tl.extra.cuda.gdc_wait()
        rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = rm < M
        p, slot, t = _rope_rows(rm, m_ok, start_ptr, slot_ptr, T, pos_offset)
        if GATHER:
            x_rows = x_ptr + tl.load(tok_ptr + rm, mask=m_ok, other=0).to(tl.int64)[:, None] \
                * stride_xm
        else:
            x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
        acc = _dot_one_pass(x_rows, m_ok, K, 0, K, wa, wb,
                            tl.zeros([BLOCK_M, BN], dtype=tl.float32), 0, BLOCK_K, PIECE,
                            NORM, na, nb, eps, SLICES)
        if GATHER:
            if tl.program_id(0) == 0:
                for k0 in range(0, K, BLOCK_K):
                    rk = k0 + tl.arange(0, BLOCK_K)
                    ok = m_ok[:, None] & (rk < K)[None, :]
                    tl.store(stream_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :],
                             tl.load(x_rows + rk[None, :], mask=ok), mask=ok)
        if HAS_BIAS:
            acc += bias[None, :]
        _rope_store(acc, rm, m_ok, p, slot, t, head, dims, table_ptr, cos_ptr, sin_ptr, q_ptr,
                    kc_ptr, vc_ptr, rope_ptr, max_pos, s_page, s_off, s_table,
                    pages_per_slot, max_seq_len, scratch_page, HQ, HKV, D, PAGE, TREE)

    @triton.jit(do_not_specialize=["M", "T", "pos_offset"],
                do_not_specialize_on_alignment=["start_ptr", "slot_ptr", "rope_ptr"])
    def _norm_skinny_kernel(x_ptr, d_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, s_ptr, c_ptr, M, N, K,
                            stride_wn, stride_ym, stride_cm, eps, kc_ptr, vc_ptr, start_ptr,
                            slot_ptr, table_ptr, cos_ptr, sin_ptr, rope_ptr, T, pos_offset,
                            max_pos, s_page, s_off, s_table, pages_per_slot, max_seq_len,
                            scratch_page, HAS_DELTA: tl.constexpr,
                            HAS_COPY: tl.constexpr, HAS_BIAS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, TILE: tl.constexpr = False,
                            GDC: tl.constexpr = False, GLU: tl.constexpr = False,
                            ROPE: tl.constexpr = False, HQ: tl.constexpr = 1,
                            HKV: tl.constexpr = 1, D: tl.constexpr = 2,
                            PAGE: tl.constexpr = 1, TREE: tl.constexpr = False):
        # rms_norm(x + delta) @ W^T with all of K in one tile (BLOCK_K >= K): each row's
        # prologue is _kernels.add_rms_norm's arithmetic (x, delta [M, K] contiguous).
        # GLU: as _skinny_kernel's (W [2N, K], y [M, N] silu(gate) * up). ROPE: W is a qkv
        # weight, each program takes _rope_w_rows' pairs of one head, and _rope_store
        # (into q at y_ptr, [M, HQ, D], and the caches: skinny_norm_linear's ``rope``) is
        # the epilogue; the kc_ptr .. scratch_page arguments (RopeWrite.kernel_args) serve
        # it alone.
        pid_n = tl.program_id(0)
        if GDC:  # PDL: W and the norm weight (and bias) before the wait, x after
            tl.extra.cuda.gdc_launch_dependents()
        if ROPE:
            rn, head, dims = _rope_w_rows(pid_n, BLOCK_N, D)
            n_ok = rn < N
            rc = rn
        else:
            rn, n_ok, rc = _w_rows(pid_n, N, BLOCK_N, GLU)
        rk = tl.arange(0, BLOCK_K)
        k_ok = rk < K
        if TILE:
            # All BLOCK_M rows at once, as [BM, 1, BK] (the GEMM kernel's TILE layout):
            # their RMS (one reduction for all) and the GEMM (one reduction over K for
            # all); rows past M load as 0 and are not stored.
            w = tl.load(w_ptr + rn.to(tl.int64)[None, :, None] * stride_wn + rk[None, None, :],
                        mask=n_ok[None, :, None] & k_ok[None, None, :],
                        other=0.0).to(tl.float32)
            nw = tl.load(nw_ptr + rk[None, None, :], mask=k_ok[None, None, :], other=0.0)
            if GDC:
                tl.extra.cuda.gdc_wait()
            rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
            m_ok = rm < M
            if ROPE:
                p, slot, t = _rope_rows(rm, m_ok, start_ptr, slot_ptr, T, pos_offset)
            ok = m_ok[:, None, None] & k_ok[None, None, :]
            offs = rm.to(tl.int64)[:, None, None] * K + rk[None, None, :]
            xs = tl.load(x_ptr + offs, mask=ok, other=0.0)
            if HAS_DELTA:
                xs = (xs.to(tl.float32) + tl.load(d_ptr + offs, mask=ok, other=0.0)
                      .to(tl.float32)).to(xs.dtype)
            if pid_n == 0:
                if HAS_DELTA:
                    tl.store(s_ptr + offs, xs, mask=ok)
                if HAS_COPY:
                    tl.store(c_ptr + rm.to(tl.int64)[:, None, None] * stride_cm
                             + rk[None, None, :], xs, mask=ok)
            xf = xs.to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=2, keep_dims=True) / K + eps)
            a = nw * (xf * inv).to(xs.dtype)
            acc = tl.sum(a.to(tl.float32) * w, axis=2)                  # [BM, BN]
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if ROPE:
                _rope_store(acc, rm, m_ok, p, slot, t, head, dims, table_ptr, cos_ptr,
                            sin_ptr, y_ptr, kc_ptr, vc_ptr, rope_ptr, max_pos, s_page, s_off,
                            s_table, pages_per_slot, max_seq_len, scratch_page, HQ, HKV, D,
                            PAGE, TREE)
            else:
                _store_tile(y_ptr, rm, m_ok, rn, n_ok, rc, acc, N, stride_ym, BLOCK_N, GLU)
        else:
            w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            nw = tl.load(nw_ptr + rk, mask=k_ok, other=0.0)
            if HAS_BIAS:
                bias = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            if GDC:
                tl.extra.cuda.gdc_wait()
            for r in tl.static_range(BLOCK_M):
                row = tl.program_id(1) * BLOCK_M + r
                if ROPE:    # the row as a [1] block for _rope_store
                    rr = row + tl.arange(0, 1)
                    p, slot, t = _rope_rows(rr, rr < M, start_ptr, slot_ptr, T, pos_offset)
                ok = k_ok & (rk * 0 + row < M)
                offs = row.to(tl.int64) * K + rk
                xs = tl.load(x_ptr + offs, mask=ok, other=0.0)
                if HAS_DELTA:
                    # Rounded to the stream's dtype like the reference's ``x + y``.
                    xs = (xs.to(tl.float32) + tl.load(d_ptr + offs, mask=ok, other=0.0)
                          .to(tl.float32)).to(xs.dtype)
                if pid_n == 0:       # the one column block that stores the residual stream
                    if HAS_DELTA:
                        tl.store(s_ptr + offs, xs, mask=ok)
                    if HAS_COPY:
                        tl.store(c_ptr + row.to(tl.int64) * stride_cm + rk, xs, mask=ok)
                xf = xs.to(tl.float32)
                inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / K + eps)
                a = nw * (xf * inv).to(xs.dtype)
                acc = tl.sum(a.to(tl.float32)[None, :] * w, axis=1)
                if HAS_BIAS:
                    acc += bias
                if ROPE:
                    _rope_store(acc[None, :], rr, rr < M, p, slot, t, head, dims, table_ptr,
                                cos_ptr, sin_ptr, y_ptr, kc_ptr, vc_ptr, rope_ptr, max_pos,
                                s_page, s_off, s_table, pages_per_slot, max_seq_len,
                                scratch_page, HQ, HKV, D, PAGE, TREE)
                else:
                    _store_row(y_ptr, row, M, rn, n_ok, rc, acc, N, stride_ym, BLOCK_N, GLU)

    @triton.jit(do_not_specialize=["M"])
    def _splitk_reduce_kernel(p_ptr, b_ptr, y_ptr, M, N, stride_ym, HAS_BIAS: tl.constexpr,
                              SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                              GDC: tl.constexpr = False):
        # The partials summed in split order (deterministic), bias, one rounding.
        if GDC:  # PDL: the partials are the kernel before's output: the wait first
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
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


def glu_fits(config: SkinnyConfig, k: int) -> bool:
    """``config`` can end in the GLU epilogue (``glu=True``): each program's tile holds
    whole (gate, up) pairs and one program covers K (no split-K partials to add first)."""
    return config.block_n >= 2 and config.block_n % 2 == 0 and config.k_splits(k)[0] == 1


def residual_fits(config: SkinnyConfig, k: int) -> bool:
    """``config`` can end in the residual add (``skinny_linear(residual=...)``): one
    program covers K (no split-K partials to add first) and writes a 2-D block (the
    one-reduction family, or a one-tile tl.dot)."""
    return config.k_splits(k)[0] == 1 and (config.one_pass(k) or
                                           not config.dot and config.tile_m > 0)


def norm_prologue_fits(config: SkinnyConfig, k: int) -> bool:
    """``config`` can take the RMSNorm of a stream loaded once in its prologue
    (``skinny_linear(norm=...)``): a one-tile tl.dot over all of K."""
    return config.one_pass(k) and config.k_splits(k)[0] == 1


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  config: SkinnyConfig, *, silu_mul: bool = False, glu: bool = False,
                  residual: torch.Tensor | None = None,
                  norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype, by ``config``.
    ``silu_mul``: x is a gate-up output [..., 2K] and the product is silu(gate) * up
    (rounded to x's dtype) @ weight^T. ``glu``: weight is a gate-up weight [2I, K] (gate
    rows, then up rows) and the result is silu(gate) * up [..., I], bit for bit
    ``_kernels.silu_mul`` of the plain product (``glu_fits`` configurations).
    ``residual`` [..., N] (a ``residual_fits`` config): the result is residual + the
    product, each rounded as ``_kernels.add_rms_norm`` rounds its add (the same bits).
    ``norm`` (norm weight [K], eps; a ``norm_prologue_fits`` config): x is a residual
    stream and the product is of its RMSNorm, add_rms_norm's arithmetic but for its sum
    of squares' order (its own bits, within the sum's rounding). x's last dim and
    weight's rows must be contiguous; x, weight and bias share a dtype (the caller,
    ``models/_linear``, checks)."""
    N, K = weight.shape
    width = x.shape[-1]
    if width != (2 * K if silu_mul else K):
        raise ValueError(f"skinny_linear: x is [..., {width}], weight [{N}, {K}]"
                         f"{' (silu_mul: x must be [..., 2K])' if silu_mul else ''}")
    if glu and (silu_mul or N % 2 or not glu_fits(config, K)):
        raise ValueError(f"skinny_linear: glu needs a gate-up weight [2I, K] (got [{N}, {K}])"
                         f" and a glu_fits config (got {config.tag()}), without silu_mul")
    if residual is not None and (glu or not residual_fits(config, K)
                                 or residual.shape != (*x.shape[:-1], N)):
        raise ValueError(f"skinny_linear: residual {tuple(residual.shape)} for [..., {N}] "
                         f"needs a residual_fits config (got {config.tag()}), without glu")
    if norm is not None and (silu_mul or not norm_prologue_fits(config, K)
                             or norm[0].shape != (K,)):
        raise ValueError(f"skinny_linear: norm needs a weight [{K}] and a norm_prologue_fits "
                         f"config (got {config.tag()}), without silu_mul")
    if glu:
        N //= 2
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
    split, k_per = c.k_splits(K)
    grid = (triton.cdiv(N, c.block_n // 2 if glu else c.block_n), split, triton.cdiv(M, bm))
    b = bias if bias is not None else weight
    pdl = _pdl.launch_kw(x2)
    out = y if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    r = residual.reshape(M, N).contiguous() if residual is not None else x2
    slices = c.slices_for(K)
    # Slices in programs of their own (not with the norm: each would need all of K's sum
    # of squares): an fp32 scratch of each program's product and a counter a row block.
    programs = c.slice_grid(K) if norm is None else 0
    part, counters = x2, x2
    if programs:
        from . import _kernels  # noqa: PLC0415 (it imports this module)
        grid = (grid[0], programs, grid[2])
        part = torch.empty(programs * grid[0] * grid[2] * bm * c.block_n,
                           dtype=torch.float32, device=x.device)
        counters = _kernels._counters(x.device, grid[0] * grid[2])
    _skinny_kernel[grid](x2, weight, b, out, M, N, K, x2.stride(0), weight.stride(0),
                         y.stride(0), k_per, r, norm[0] if norm is not None else x2,
                         norm[1] if norm is not None else 0.0, part, counters,
                         ACT=int(silu_mul), HAS_BIAS=bias is not None,
                         DOT=c.dot, SPLIT_K=split, BLOCK_M=bm, BLOCK_N=c.block_n,
                         BLOCK_K=c.block_k, TILE=c.tile_m > 0 and not c.dot,
                         num_warps=c.num_warps,
                         num_stages=c.num_stages, **pdl,
                         **({"ONE_PASS": True} if c.one_pass(K) else {}),
                         **({"PIECE": piece} if (piece := one_pass_piece(c, K)) else {}),
                         **({"GLU": True} if glu else {}),
                         **({"RES": True} if residual is not None else {}),
                         **({"NORM": True} if norm is not None else {}),
                         **({"SLICES": slices} if slices > 1 else {}),
                         **({"SLICE_PROGRAMS": programs} if programs else {}))
    if split > 1:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(M * N, block),)](
            out, b, y, M, N, y.stride(0), HAS_BIAS=bias is not None, SPLIT_K=split,
            BLOCK=block, num_warps=4, **pdl)
    return y.view(*x.shape[:-1], N)


def rope_fits(config: SkinnyConfig, k: int, head_dim: int) -> bool:
    """``config`` can end a qkv GEMM over K = ``k`` in the RoPE + cache-write epilogue: a
    one-tile tl.dot without split K (``skinny_rope_linear``), or a norm-fusable broadcast
    configuration (``skinny_norm_linear(rope=...)``), either with an even BLOCK_N that
    divides the head (a program takes pairs of one head: ``_rope_w_rows``)."""
    pairs = config.block_n % 2 == 0 and head_dim % config.block_n == 0
    if config.dot:
        return config.one_pass(k) and config.k_splits(k)[0] == 1 and pairs
    return norm_fusable(config, k) and pairs


def skinny_rope_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       config: SkinnyConfig, rope: RopeWrite,
                       norm: tuple[torch.Tensor, float] | None = None,
                       gather: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [B, T, K] @ weight [(Hq + 2 Hkv) D, K]^T (+ bias) as qkv, then RoPE and the cache
    write as ``_kernels.rope_cache_write(qkv, *rope)`` does them, in one kernel (a
    ``rope_fits`` config): -> rotated q [B, T, Hq, D]; k and v go into ``rope``'s caches.
    The same bits as ``skinny_linear`` then ``rope_cache_write``. ``norm`` (weight [K],
    eps): x is the residual stream, normalised in the prologue as
    ``skinny_linear(norm=...)`` does. ``gather`` (tokens [B, T] int64, an embedding table
    [V, K]): x's rows are the table's rows of the tokens, and the kernel writes them into
    x (contiguous; its content on entry is not read): the first layer with its embedding
    lookup, no kernel of its own."""
    B, T, K = x.shape
    if gather is not None and (gather[0].shape != (B, T) or gather[1].dim() != 2
                               or gather[1].shape[1] != K or not x.is_contiguous()
                               or gather[1].stride(1) != 1):
        raise ValueError(f"skinny_rope_linear: gather tokens {tuple(gather[0].shape)} and "
                         f"table {tuple(gather[1].shape)} for x {tuple(x.shape)} (contiguous)")
    _, page_size, hkv, D = rope.k_cache.shape
    hq = rope.num_heads
    if weight.shape != ((hq + 2 * hkv) * D, K) or not config.dot \
            or not rope_fits(config, K, D) or weight.stride(1) != 1 \
            or norm is not None and norm[0].shape != (K,):
        raise ValueError(f"skinny_rope_linear: x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)} (rows contiguous) for {hq} + 2 x {hkv} heads "
                         f"of {D}, config {config.tag()}")
    x2 = x.reshape(B * T, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = B * T
    q = x.new_empty(B, T, hq, D)
    if M == 0:
        return q
    bm = config.block_m(M)
    piece = one_pass_piece(config, K)
    per_head = D // config.block_n
    # Gathering, the kernel reads the table's rows (its x) and stores them into x.
    src, tokens = (x2, x2) if gather is None else (gather[1], gather[0].reshape(M))
    _skinny_rope_kernel[((hq + 2 * hkv) * per_head, 1, triton.cdiv(M, bm))](
        src, weight, bias if bias is not None else weight, q,
        norm[0] if norm is not None else x2, M, K, src.stride(0), weight.stride(0),
        norm[1] if norm is not None else 0.0, *rope.kernel_args(T), HQ=hq, HKV=hkv, D=D,
        PAGE=page_size, HAS_BIAS=bias is not None, BLOCK_M=bm,
        **({"BLOCK_N": config.block_n} if per_head > 1 else {}),
        BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages,
        **({"PIECE": piece} if piece else {}),
        **({"SLICES": slices} if (slices := config.slices_for(K)) > 1 else {}),
        **({"TREE": True} if rope.rope_offsets is not None else {}),
        **({"NORM": True} if norm is not None else {}), tok_ptr=tokens, stream_ptr=x2,
        **({"GATHER": True} if gather is not None else {}), **_pdl.launch_kw(x2))
    return q


# SPECLOOP_SKINNY_PIECES=0: a one-tile tl.dot over K runs one BLOCK_K tile, zero padding
# included (the same bits either way: one_pass_piece).
PIECES = os.environ.get("SPECLOOP_SKINNY_PIECES", "1") != "0"


def one_pass_piece(config: SkinnyConfig, k: int) -> int:
    """The second tile's width where a one-tile tl.dot (``SkinnyConfig.one_pass``) takes
    its K range as BLOCK_K / 2 then a smaller power of two (K = 576: 512 + 64 instead of
    1024), else 0. tl.dot's MMA steps run over the tile's K in order, 16 at a time, each
    adding into the accumulator; the two tiles chained through it run the same steps in
    the same order less those over the padding, which add zero products: the same bits,
    in fewer dependent steps (a row block's MMA chain is the one-tile kernel's latency)."""
    return _piece(config, k) if PIECES else 0


@functools.lru_cache(maxsize=None)     # a table's few (config, K), asked at every launch
def _piece(config: SkinnyConfig, k: int) -> int:
    splits, _ = config.k_splits(k)
    if not config.one_pass(k) or splits > 1:    # a split's range is one whole BLOCK_K
        return 0
    half = config.block_k // 2
    if k <= half or half < 16:
        return 0
    piece = max(16, _pow2(k - half))
    return piece if piece < half else 0


@functools.lru_cache(maxsize=None)     # a table's few (config, K), asked at every launch
def _slices(config: SkinnyConfig, k: int) -> int:
    if not config.one_pass(k) or config.k_splits(k)[0] > 1:
        return 1
    return config.slices if _first_tile(config, k) // config.slices >= 16 else 1


@functools.lru_cache(maxsize=None)     # a table's few (config, K), asked at every launch
def _slice_grid(config: SkinnyConfig, k: int) -> int:
    slices = config.slices_for(k)
    if slices <= 1:
        return 0
    piece = one_pass_piece(config, k)
    width = _first_tile(config, k) // slices
    if piece % width:
        return 0
    return len(slice_edges(config, k))


def _first_tile(config: SkinnyConfig, k: int) -> int:
    """The width of a one-tile tl.dot's first tile over K = ``k`` (``_one_pass_ks``):
    BLOCK_K / 2 where a PIECE tile follows, else all of BLOCK_K."""
    return config.block_k // 2 if one_pass_piece(config, k) else config.block_k


def slice_edges(config: SkinnyConfig, k: int) -> tuple[int, ...]:
    """Where a sliced one-tile tl.dot's slices start in K = ``k`` (``_slice_ks``' tiles,
    those that reach into K), or () where it runs unsliced: two configurations with the
    same edges sum a row's products in the same order (each slice its MMA steps in order,
    the slices added in order), whatever their BLOCK_N, warps or row blocks."""
    slices = config.slices_for(k)
    if slices <= 1:
        return ()
    piece = one_pass_piece(config, k)
    first = _first_tile(config, k)
    width = first // slices
    edges = [s * width for s in range(slices)]
    if piece > width:
        edges += [first + j * width for j in range(piece // width)]
    elif piece:
        edges.append(first)
    return tuple(e for e in edges if e < k)


def prologue_fits(config: SkinnyConfig, k: int) -> bool:
    """``skinny_linear(silu_mul=True)`` may run ``config`` for an activation of K = ``k``:
    not a one-tile tl.dot (``one_pass``), whose programs hold their whole tile of W across
    PDL's wait while the prologue's silu * up sits in tl.dot's operand layout (every warp
    all of it): compiled offline for sm_90, the down GEMM's ``d32x2048s1w8n1`` with the
    prologue keeps 32 registers and spills ~31 KB a thread (255 registers, no spill
    without it: ``bench/bench_skinny_gemm.py --resources``), and the fifth session's
    one-tile down projection ran 718 us a call on the H200. The dispatcher then runs
    _kernels.silu_mul and the GEMM without the prologue: the same bits."""
    return not config.one_pass(k)


def norm_fusable(config: SkinnyConfig, k: int) -> bool:
    """``skinny_norm_linear`` runs ``config``: the broadcast path, all of K in one pass.
    (A tl.dot prologue was tried, 2026-12-01: faster alone in bench_skinny_gemm, slower in
    the step, where the separate add_rms_norm overlaps under PDL; docs/performance-history.md,
    "One-tile `tl.dot` for VERIFY's rows".)"""
    return not config.dot and config.split_k == 1 and config.block_k >= k


def skinny_norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor,
                       eps: float, weight: torch.Tensor, bias: torch.Tensor | None,
                       config: SkinnyConfig, copy_to: torch.Tensor | None = None, *,
                       glu: bool = False, rope: RopeWrite | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(x + delta, norm_weight) @ weight^T (+ bias), x + delta) for x, delta
    [..., K], weight [N, K], in one kernel: ``_kernels.add_rms_norm`` (delta None: no add;
    ``copy_to`` also receives x + delta) and the GEMM, the normed rows never stored. The
    config must be ``norm_fusable`` (one pass over K computes each row's RMS first).
    ``glu``: as ``skinny_linear``'s (the product's silu(gate) * up, [..., N / 2]).
    ``rope`` (x [B, T, K], weight a qkv weight, a ``rope_fits`` config): the product's
    RoPE and cache write as ``_kernels.rope_cache_write(product, *rope)`` does them, in
    the same kernel -> (rotated q [B, T, Hq, D], x + delta), the same bits."""
    N, K = weight.shape
    if x.shape[-1] != K or not norm_fusable(config, K) or norm_weight.shape != (K,) or \
            glu and (N % 2 or not glu_fits(config, K)) or rope is not None and (
                glu or x.dim() != 3 or not rope_fits(config, K, rope.k_cache.shape[-1])
                or N != (rope.num_heads + 2 * rope.k_cache.shape[2]) * rope.k_cache.shape[3]):
        raise ValueError(f"skinny_norm_linear: x {tuple(x.shape)}, weight [{N}, {K}], "
                         f"norm weight {tuple(norm_weight.shape)}, config {config.tag()}"
                         f"{', glu' if glu else ''}{', rope' if rope is not None else ''}")
    if glu:
        N //= 2
    if weight.stride(1) != 1:
        raise ValueError("skinny_norm_linear: weight rows must be contiguous")
    x = x.contiguous()
    M = x.numel() // K
    stream = torch.empty_like(x) if delta is not None else x
    d = delta.contiguous() if delta is not None else x
    copy_stride = 0
    if copy_to is not None:
        if copy_to.stride(-1) != 1 or copy_to.numel() != x.numel():
            raise ValueError("skinny_norm_linear: copy_to must hold x's rows, last dim "
                             "contiguous")
        copy_stride = copy_to.stride(-2) if copy_to.dim() > 1 else K
        if copy_to.dim() > 2 and copy_to.stride(-3) != copy_stride * copy_to.shape[-2]:
            raise ValueError("skinny_norm_linear: copy_to's rows must be evenly strided")
    if rope is not None:
        _, page_size, hkv, D = rope.k_cache.shape
        y = x.new_empty(*x.shape[:-1], rope.num_heads, D)       # q
        cache_args = rope.kernel_args(x.shape[1])
        rope_kw = dict(ROPE=True, HQ=rope.num_heads, HKV=hkv, D=D, PAGE=page_size,
                       **({"TREE": True} if rope.rope_offsets is not None else {}))
    else:
        y = x.new_empty(*x.shape[:-1], N)
        cache_args = RopeWrite.unused_args(x)
        rope_kw = {}
    if M == 0:
        return y, stream
    bm = config.block_m(M)
    grid = (triton.cdiv(N, config.block_n // 2 if glu else config.block_n), triton.cdiv(M, bm))
    _norm_skinny_kernel[grid](
        x, d, norm_weight, weight, bias if bias is not None else weight, y, stream,
        x if copy_to is None else copy_to, M, N, K, weight.stride(0), N, copy_stride, eps,
        *cache_args, HAS_DELTA=delta is not None, HAS_COPY=copy_to is not None,
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, TILE=config.tile_m > 0, num_warps=config.num_warps,
        num_stages=config.num_stages, **_pdl.launch_kw(x), **({"GLU": True} if glu else {}),
        **rope_kw)
    return y, stream
