"""The one dispatcher for the models' matmuls over a few rows (decode, VERIFY's K+1 tokens,
a draft head's steps): oneDNN-packed weights on the CPU, a skinny-GEMM Triton kernel on
CUDA, ``F.linear`` everywhere else.

On the CPU. A decode step's matmuls are bound by reading the weights once, whatever the
rows. On x86 CPUs (MKL, fp32) the 1-row product runs at that bound (gemv), but 2-32 rows go
through sgemm at 1.5-2.5x its cost: SmolLM2's LM head [49152, 576], one thread, 8.2 ms for
1 row, 20.5 ms for 4, 24.6 ms for 8 — so verifying K+1 tokens cost about twice a decode
step, which ate most of what speculation saves on the CPU. oneDNN's kernel on a weight
reordered once into its blocked layout takes 10.1 ms for 4 rows and 14.3 ms for 8 (bench
figures in docs/performance.md, "On the CPU"). Outside that window (1 row; prefill chunks
over 32 rows; autograd) this is ``F.linear`` itself, so a decode step without speculation
is bit-for-bit what it was (short prompts' prefill now runs packed: fp32 rounding-level
differences, as between any two GEMM kernels). bfloat16 on a CPU with native bf16 GEMMs
(``bf16_packing_available``: oneDNN's AMX / AVX512-BF16 kernels) runs packed from 1 row:
F.linear's bf16 path converts as it goes (a draft head's reduced LM head [16384, 576], one
thread: 3.8 ms for 1 row against 2.5 packed), and no bf16 product here is held to
another library's bits (the draft heads compute in it on the CPU: drafts need no
exactness).

On CUDA (bf16/fp16, 1..SKINNY_MAX_ROWS rows, a tl.dot tail up to DOT_MAX_ROWS, outside
autograd). cuBLAS's tiles for so few
rows leave most SMs idle (an H200 at batch 1: 3.7-3.9 us per SmolLM2 GEMM, whose weights
stream in ~0.3-1.5 us); ``models/_skinny``'s kernel splits N (and optionally K) finely.
Which configuration runs per (N, K) and row count is SKINNY_TABLE: per shape, row ranges
each with its configuration (e.g. ``v`` at 1 row and ``b`` for VERIFY's rows, or ``v`` at
1 row and one-tile tl.dot above, as qkv and gate-up ship), those without
tl.dot giving a row the same bits, then any sliced tl.dot ranges (``k<n>``, one bit class
of their own), then tl.dot ranges with F.linear's bits (see the table's comment), filled from
``bench/bench_skinny_gemm.py`` on the H200 (it prints the literal); shapes not in it get
``default_config``'s guess. ``SPECLOOP_SKINNY=0`` in the environment (or ``skinny =
False`` on a dispatcher, e.g. ``DecoderModel.linear``) keeps cuBLAS everywhere.
``norm_linear`` also takes the fused layer's residual add + RMSNorm into the GEMM's
prologue for the rows of a shape's non-tl.dot ranges where all of those allow
(``skinny_norm``; ``SPECLOOP_SKINNY_NORM=0`` turns it off). With the shipped table it does
for qkv at 1-4 rows (``v`` then ``b``) and gate-up at 1 row, its only callers; above those
they run tl.dot and their norms run as add_rms_norm. ``norm_linear_rope`` also takes RoPE
and the K/V cache write into the qkv GEMM's epilogue wherever its configuration allows
(``_skinny.rope_fits``; ``SPECLOOP_SKINNY_ROPE=0`` turns it off); ``out_norm_mlp`` with
``SPECLOOP_SKINNY_STREAM_NORM`` (``stream_modes``) the residual adds into the down and o
GEMMs' epilogues and the norms into the next qkv's and gate-up's one-tile tl.dot ("qkv",
"mlp", both or neither; STREAM_NORM_DEFAULT).
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import _skinny
from ._skinny import SkinnyConfig

# Rows (all leading dims) for which the packed kernel beats MKL (measured 2..32; from 64
# rows on both cost the same, and long prefill chunks keep MKL's numerics).
MIN_ROWS, MAX_ROWS = 2, 32

# Rows for which the skinny kernel may run on CUDA: the broadcast families (and the default
# guess for shapes the table lacks) up to SKINNY_MAX_ROWS; a tl.dot tail (cuBLAS's bit class,
# below) up to DOT_MAX_ROWS: VERIFY's rows at batch 32 with K = 3 are 128, at 64 with K = 3
# 256, and a tl.dot program takes a fixed block of them (16, or the tag's ``m``; grid over
# the rows), so the tail's one-tile configurations keep their per-row arithmetic at any row
# count.
SKINNY_MAX_ROWS = 32
DOT_MAX_ROWS = 256

# (N, K, silu_mul) -> ((max rows, config tag), ...) in ascending max rows, or None for
# F.linear: rows r run the first range with r <= max rows, F.linear above the last. The tags
# are SkinnyConfig.tag()'s (``d16x128s2w4n3``: tl.dot, BLOCK_N 16, BLOCK_K 128, SPLIT_K 2, 4
# warps, 3 stages; ``v``: no tl.dot, rows reduced one after the other, fastest at 1 row;
# ``b4x2x1024...``: no tl.dot, blocks of 4 rows reduced in one reduction, for VERIFY's 2-8
# rows). A shape missing from the table uses default_config up to SKINNY_MAX_ROWS rows.
#
# The invariant that makes several ranges safe: a row's bits depend only on whether its
# call falls in the shape's PREFIX or above it. An entry is a prefix of ranges without
# tl.dot, then optionally a TAIL of tl.dot ranges (a range without tl.dot after a tl.dot
# one is rejected: check_table).
#
# ALL configurations of the prefix give a row the same bits. The kernel gives a row the
# same bits whatever the number of rows in the call (models/_skinny), and configurations
# that sum over K in the same order give the same bits whatever their family, BLOCK_N or
# tile_m: one bit class. The order follows
# the compiled split of K (8 a thread x 32 lanes x BLOCK_K/256 warps; more warps go along
# N where BLOCK_N >= 2, along K where it is 1): on the H200 every ``v``/``b`` at BLOCK_K
# 1024 with 4 warps, and with 8 warps at BLOCK_N >= 2, is one class; 2 warps are another,
# ``v1x1024s1w8n3`` one of its own (the norm kernel's 1-D RMS sum puts every warp along K:
# there 8 warps differ from 4 whatever BLOCK_N). Within a class a
# graph padded to a larger batch bucket (or a chained step taken at one) equals the
# unpadded call, as with one configuration.
#
# The tail's configurations give F.linear's bits at each row count (cuBLAS's bit class; on
# the H200 the one-tile ``ONE_PASS`` tl.dot configurations of qkv and gate-up do: the
# bench's probe compares them at 32 rows, the GPU test at every row count of the tail):
# the tail is cuBLAS, run faster. F.linear above the last range was always allowed, so the class already
# changed there, to cuBLAS's; ((1, 'v...'), (32, 'd...')) gives every call the bits that
# ((1, 'v...'),) with cuBLAS above gives, the boundary where it was. (An entry of tl.dot
# ranges only has no prefix and is one class, as before: cuBLAS's or its own.)
#
# ``norm_linear`` fuses the RMSNorm into the prologue for rows in the prefix, where every
# prefix configuration is ``norm_fusable`` (they must then also be one class under the
# norm kernel); rows in the tail take add_rms_norm and the tail's GEMM, what they would
# take with F.linear there, so the norm path's bits too change only where the prefix
# ends. bench/bench_skinny_gemm.py measures the classes, mixes prefix configurations
# within one, and takes a tail only from cuBLAS's; the GPU test
# test_table_ranges_give_a_row_the_same_bits checks the shipped table (prefix rows against
# each other, tail rows against F.linear).
#
# SmolLM2-135M's and its EAGLE-3 head's, from one H200's measurements (2026-12-01:
# bench/bench_skinny_gemm.py, torch 2.11, Triton 3.6, kernels launched with PDL; timed at 1,
# 2, 3, 4, 5, 6, 8, 16 and 32 rows). The other shapes are the 13:08 run's own choice (per
# class, the fastest configuration at each timed row count, the class and row limit saving
# the most against cuBLAS). qkv and gate-up are a prefix + tail entry composed by hand from
# that day's rows (bench/results/h200_1201e_table_v1_dot.json; h200_1201e_skinny_pdl_rows,
# _dot_norm and _one_tile.json): the broadcast ``v`` at 1 row with the norm fused in its
# prologue (1.2-1.9 us, the fastest at 1 row), then one ``tl.dot`` configuration over all
# of K in one tile (``d64x1024s1w8``, ``ONE_PASS``, cuBLAS's bit class: the tail) from 2 to
# 32 rows, 2.2-2.6 us flat up to 16 rows where the broadcast class costs 2.5-5.0 at VERIFY's
# 5 (n-gram K = 4). In the engine (bench/profile_spec_gpu.py, 128 tokens, 16 held-out
# prompts a run, against the all-tl.dot table shipped before,
# bench/results/h200_1201e_table_alltldot.json, 2026-12-01 17:08-17:12, 6 runs each): no
# speculation 1,779-1,814 -> 1,981-2,020 tok/s at batch 1, speculation unchanged (eagle3
# K = 3 2,301-2,318 -> 2,287-2,323: its VERIFY rows ran one-tile tl.dot configurations of
# the same bit class before too) (docs/performance-history.md, "One-tile tl.dot for VERIFY's
# rows"). The o projection took the same tail from 9 to 32 rows on 2026-12-02 (the 13:08
# run had d64x1024 at 2.33 us for 32 rows against cuBLAS's 3.71, and its offline choice
# with the bit classes had it, bench/results/h200_1201e_table_tail_offline.json): at batch 8
# eagle3 K = 3 (32 rows) went from 10,006 to 11,279 tok/s, no speculation unchanged
# (bench/results/h200_1202i_otail_*.jsonl; a cuBLAS GEMM also breaks PDL's chain of
# Triton kernels around it), and the GPU tests passed with it (tabletests).
# Above 32 rows (VERIFY at batch 16-64 with K = 3; no speculation at batch 33-192) the
# tails go on where bench/bench_skinny_tail.py timed them below cuBLAS (2026-12-02; every
# tl.dot configuration there gave F.linear's bits at every row count 2-256, and cuBLAS a row
# the same bits at all of them). Since the one-tile tl.dot takes K = 576 as two tiles, 512 +
# 64, not one tile of 1024 padded with zeros (models/_skinny ``one_pass_piece``: the same MMA
# steps less those over the padding, the same bits), d128x1024 (8 programs for qkv's 16-row
# block) is the fastest alone: at 64 rows qkv 1.85 us against cuBLAS's 3.81, gate-up 3.98
# against 4.25, o at 128 rows 1.84 against 3.75 (bench/results/h200_1202k_skinny_tail_d128
# .json). Up to 32 rows d64x1024 stays: in the layer bench (30 layers in a chain, where a
# program's tile of W is not loaded behind the kernel before as in back-to-back calls of one
# GEMM) d128 everywhere was slower at 4 and 8 rows (12.60 / 15.31 us a layer against 12.09 /
# 13.87). The gate-up GEMM loses to cuBLAS from 96 rows (a program reads its tile of W again
# for each 16 rows) and keeps cuBLAS there. Engine (one H200 process each, 3 runs): the two
# tiles against one at batch 1 and 8, h200_1202k_pieces{0,1}_d64_b1_b8.jsonl; above 32 rows,
# batch 16 eagle3 K = 3 17,051 -> 17,933 tok/s with the first tails (d64, 4f4d73c), and
# d128 above 32 rows within the runs' spread of d64 there (h200_1202k_final_b16_b32_*.jsonl);
# the GPU tests passed with this table (tabletests).
# Since the fourteenth session the down GEMM leaves cuBLAS from 9 rows (one-tile d32x2048,
# as 1024 + 512, to 64; a looped d64x256 to 128), gate-up takes 32-row blocks (m32) to 128
# and qkv / o to 256: mostly bench_skinny_tail.py --compose's choice. Gate-up's 97-128 rows
# and the down GEMM's 65-128 are slower than cuBLAS alone and kept because a cuBLAS GEMM
# breaks PDL's chain of Triton kernels: in the engine batch 32 eagle3 K = 3 ran 1.373
# against 1.441 ms of GPU time an iteration with them. Figures, and what was not taken
# (256-row gate-up and down, a tl.dot LM head): docs/performance-history.md, "The down GEMM
# and 32-row blocks on tl.dot (fourteenth session)"; GPU tests passed with this table.
# Fifteenth session: qkv's broadcast prefix reaches 4 rows (b2x4x1024s1w2n3, v8's class, its
# norm in the prologue): batch-1 VERIFY at K = 3 takes one kernel less a layer (eagle3 K = 3
# 0.770 -> 0.743 ms of GPU time an iteration); at 5 rows it lost in the layer bench (history,
# "The norm in the qkv prologue at VERIFY's rows").
# Forty-first session: the one-tile tl.dot ranges up to 32 rows take K in two slices (``k2``,
# SkinnyConfig.slices: each its own tl.dot and accumulator, so a 16-row block's chain of
# dependent MMA steps is 16 + 4 long for K = 576, not 36; 32 + 32 + 32 for the down GEMM,
# not 96). H200, 30 layers in a chain (bench_stream_norm_gpu.py, the stream norm on): 11.81
# -> 10.58 us a layer at 16 rows, 11.88 -> 10.80 at 32, 13.01 -> 12.41 at 8, 11.81 -> 10.95
# at 4; k4 and k8 less (bench/results/h200_1205i_slices_*.jsonl). Their bits are a class of
# their own (not cuBLAS's), so they stop at 32 rows, where the stream norm's fused sum of
# squares already makes 5-32 rows a class apart from 33 and above (the down GEMM's d32x2048
# splits at 32 for it); d128 tiles with slices spill (offline sm_90: 4,752 bytes of stack).
# Forty-second session: o and down on that sliced tl.dot from 5 rows (their broadcast
# prefixes end at 4, as qkv's), so o + gate-up's stream fusion reaches 5-8 rows. H100, the
# layer chain: 11.62 -> 10.32 us a layer at 5 rows, 12.58 -> 10.39 at 8, the same at 1-4
# and 16-32; in the engine n-gram K = 4 at batch 1 0.572 -> 0.551 ms of GPU time an
# iteration, batch 8 without speculation 0.611 -> 0.536 (bench/results/h100_1205k_*).
SkinnyRanges = tuple[tuple[int, str], ...]
SKINNY_TABLE: dict[tuple[int, int, bool], SkinnyRanges | None] = {
    (960, 576, False): ((1, 'v8x1024s1w2n3'), (4, 'b2x4x1024s1w2n3'),
                        (32, 'd64x1024s1w8n1k2'), (128, 'd128x1024s1w8n1'),
                        (256, 'd128x1024s1w8n1m32')),
    (576, 576, False): ((1, 'v4x1024s1w4n3'), (2, 'b2x2x1024s1w4n3'),
                        (3, 'b2x4x1024s1w4n3'), (4, 'b2x2x1024s1w4n3'),
                        (32, 'd64x1024s1w8n1k2'),
                        (192, 'd128x1024s1w8n1'), (256, 'd128x1024s1w8n1m32')),
    (3072, 576, False): ((1, 'v4x1024s1w4n3'), (32, 'd64x1024s1w8n1k2'),
                         (128, 'd128x1024s1w8n1m32')),
    (576, 1536, True): ((1, 'v8x2048s1w8n3'), (4, 'b2x4x2048s1w8n3'),
                        (32, 'd32x2048s1w8n1k2'), (64, 'd32x2048s1w8n1'),
                        (128, 'd64x256s1w4n3')),
    (576, 1728, False): ((1, 'v2x2048s1w4n3'), (8, 'b2x2x2048s1w4n3'),
                         (16, 'b4x4x2048s1w4n3')),
    (576, 1152, False): ((1, 'v4x2048s1w4n3'), (4, 'b2x2x2048s1w4n3'),
                         (6, 'b2x4x2048s1w4n3'), (8, 'b2x2x2048s1w4n3'),
                         (16, 'b4x4x2048s1w4n3')),
    (16384, 576, False): ((1, 'v4x1024s1w4n3'),),
    (49152, 576, False): ((1, 'v8x1024s1w2n3'),),
}


def _table_from_file(path: str) -> dict[tuple[int, int, bool], SkinnyRanges | None]:
    """A table measured on this machine (``SPECLOOP_SKINNY_TABLE``: the JSON file
    bench/bench_skinny_gemm.py writes, {"N,K,silu": [[max rows, tag], ...] | null}; the
    older one-range form [tag, max rows] is read as one range), so a new device's
    configurations are tried without editing the code; it replaces the shipped table.
    Malformed entries raise ValueError here (check_table)."""
    with open(path) as f:
        raw = json.load(f)
    table: dict[tuple[int, int, bool], SkinnyRanges | None] = {}
    for key, entry in raw.items():
        n, k, silu = key.split(",")
        if entry is not None:
            if not isinstance(entry, list) or not entry:
                raise ValueError(f"{path}: {key}: want [[max rows, tag], ...], got {entry!r}")
            if isinstance(entry[0], str) and len(entry) == 2:        # [tag, max rows]
                entry = [[entry[1], entry[0]]]
            entry = tuple((r[0], r[1]) if isinstance(r, list) and len(r) == 2 else r
                          for r in entry)
        table[(int(n), int(k), silu.strip().lower() in ("1", "true"))] = entry
    check_table(table)
    return table


_TAG = re.compile(r"(?:([dv])|b(\d+)x)(\d+)x(\d+)s(\d+)w(\d+)n(\d+)(?:m(\d+))?(?:k(\d+)(p)?)?")


@functools.lru_cache(maxsize=None)     # a table's few tags, looked up on every call
def parse_config(tag: str) -> SkinnyConfig:
    """SkinnyConfig.tag()'s inverse."""
    m = _TAG.fullmatch(tag)
    if m is None:
        raise ValueError(f"not a skinny config tag: {tag!r}")
    d, tile_m, *ints, dot_m, slices, programs = m.groups()
    rows = int(tile_m or dot_m or 0)
    k_slices = int(slices or 1)
    # ``b`` blocks of at least one row; a tl.dot block (``m``) of a power of two >= 16 rows;
    # tl.dot's K tile in a power of two >= 2 of slices (``k``), optionally each in a
    # program of its own (``p``).
    if tile_m is not None and rows < 1 or \
            dot_m is not None and (d != "d" or rows < 16 or rows & (rows - 1)) or \
            slices is not None and (d != "d" or k_slices < 2 or k_slices & (k_slices - 1)):
        raise ValueError(f"not a skinny config tag: {tag!r}")
    bn, bk, split, warps, stages = map(int, ints)
    return SkinnyConfig(d == "d", bn, bk, split, warps, stages, rows, k_slices,
                        programs is not None)


def one_pass_block_k(k: int) -> int:
    """BLOCK_K for all of K in one pass: K rounded up to a power of two, 16..4096 (the
    default guess's and the bench's sweep)."""
    return min(4096, max(16, _skinny._pow2(k)))


def default_config(n: int, k: int) -> SkinnyConfig:
    """A guess for shapes the table lacks: no tl.dot, all of K in one pass (BLOCK_K = K
    rounded up to a power of two, up to 4096; such a pass is not software-pipelined, so a
    loop over K would cost a memory latency a pass), BLOCK_N as large as keeps the tile of
    W within ~64 fp32 registers a thread (1..8 rows of W)."""
    bk = one_pass_block_k(k)
    return SkinnyConfig(False, max(1, min(8, 64 * 32 * 4 // bk)), bk)


class _Shape(NamedTuple):
    """A table entry resolved: ((max rows, config), ...) ascending; ``prefix``, the max
    rows of its last range without tl.dot (0: none; tl.dot ranges after it are the tail:
    sliced ranges first, one bit class, then cuBLAS's bit class); and whether ``norm_linear`` may take the norm into the prologue
    for rows <= ``prefix`` (every prefix configuration ``norm_fusable``: one kernel family
    for those rows, so their bits agree; the tail's rows take add_rms_norm as F.linear's
    would)."""

    ranges: tuple[tuple[int, SkinnyConfig], ...]
    norm: bool
    prefix: int


def _shape_of(ranges: tuple[tuple[int, SkinnyConfig], ...], k: int) -> _Shape:
    """``ranges`` (ascending, checked) split into the prefix without tl.dot and the tail;
    ValueError where a range without tl.dot follows a tl.dot one, or where the tail's
    sliced ranges (``k<n>``) are not one class right after the prefix: the same slice
    edges (``_skinny.slice_edges``), before any unsliced tl.dot range (cuBLAS's bits), so
    a row's bits still depend only on which of the three its call falls in."""
    prefix, tail, unsliced = 0, False, False
    edges: tuple[int, ...] = ()
    for max_rows, cfg in ranges:
        if cfg.dot:
            tail = True
            own = _skinny.slice_edges(cfg, k)
            if own and (unsliced or edges and own != edges):
                raise ValueError(f"skinny ranges {[(m, c.tag()) for m, c in ranges]}: "
                                 f"{cfg.tag()} after a tl.dot range of another bit class "
                                 "(sliced ranges, of one slicing, come right after the "
                                 "prefix)")
            edges = edges or own
            unsliced = unsliced or not own
        elif tail:
            raise ValueError(f"skinny ranges {[(m, c.tag()) for m, c in ranges]}: "
                             f"{cfg.tag()} after a tl.dot range (tl.dot ranges, in cuBLAS's "
                             "bit class or a sliced one, may only end an entry)")
        else:
            prefix = max_rows
    fusable = prefix > 0 and all(_skinny.norm_fusable(c, k) for m, c in ranges
                                 if m <= prefix)
    return _Shape(ranges, fusable, prefix)


def _resolve(entry: SkinnyRanges, k: int) -> _Shape:
    """``entry`` checked (ValueError if malformed) and parsed, for K = ``k``."""
    try:
        return _resolve_cached(entry, k)
    except TypeError:           # unhashable: lists where tuples belong
        raise ValueError(f"skinny table entry {entry!r}: want ((max rows, tag), ...)") \
            from None


def _resolve_uncached(entry: SkinnyRanges, k: int) -> _Shape:
    if not isinstance(entry, tuple) or not entry:
        raise ValueError(f"skinny table entry {entry!r}: want ((max rows, tag), ...)")
    ranges, last = [], 0
    for r in entry:
        if not (isinstance(r, tuple) and len(r) == 2 and type(r[0]) is int
                and isinstance(r[1], str)):
            raise ValueError(f"skinny table entry {entry!r}: {r!r} is not (max rows, tag)")
        cfg = parse_config(r[1])
        limit = DOT_MAX_ROWS if cfg.dot else SKINNY_MAX_ROWS
        if not last < r[0] <= limit:
            raise ValueError(f"skinny table entry {entry!r}: max rows must ascend strictly "
                             f"within 1..{SKINNY_MAX_ROWS} (a tl.dot range's within "
                             f"1..{DOT_MAX_ROWS})")
        last = r[0]
        ranges.append((r[0], cfg))
    return _shape_of(tuple(ranges), k)


# An entry checked once, looked up on every call (check_table has checked every table the
# dispatcher reads: the shipped one at import, a file's as it loads).
_resolve_cached = functools.lru_cache(maxsize=None)(_resolve_uncached)


def check_table(table: dict[tuple[int, int, bool], SkinnyRanges | None]) -> None:
    """Every entry well formed (ValueError if not): None, or ((max rows, tag), ...) with
    1 <= max rows <= SKINNY_MAX_ROWS (DOT_MAX_ROWS for tl.dot) strictly ascending, tags
    that parse, and no range
    without tl.dot after a tl.dot one (the tl.dot tail stands in for cuBLAS: the table's
    comment)."""
    for (n, k, silu), entry in table.items():
        if not (type(n) is int and type(k) is int and n > 0 and k > 0 and type(silu) is bool):
            raise ValueError(f"skinny table key {(n, k, silu)!r}: want (N, K, silu_mul)")
        if entry is not None:
            # Past the cache: its key (entry, k) equals for (True, tag) and (1, tag), so an
            # entry resolved before would let a malformed one through.
            _resolve_uncached(entry, k)


def _shape(n: int, k: int, silu_mul: bool) -> _Shape | None:
    """The shape's ranges (default_config for every row if the table lacks it), or None
    (the table says F.linear)."""
    key = (n, k, silu_mul)
    entry = SKINNY_TABLE.get(key)
    if entry is None:
        return None if key in SKINNY_TABLE else _default_shape(default_config, n, k)
    return _resolve(entry, k)


# The guess made once per shape, not on every call; keyed on the guessing function too, so
# a replaced default_config (tests patch it) is the one asked.
@functools.lru_cache(maxsize=None)
def _default_shape(guess: Callable[[int, int], SkinnyConfig], n: int, k: int) -> _Shape:
    return _shape_of(((SKINNY_MAX_ROWS, guess(n, k)),), k)


def skinny_config(rows: int, n: int, k: int, silu_mul: bool = False, *,
                  norm: bool = False) -> SkinnyConfig | None:
    """The configuration for ``rows`` x [N, K]: the first of the shape's ranges covering
    ``rows`` (the prefix's configurations give a row the same bits, the tl.dot tail's
    F.linear's), or None where F.linear runs (the table says cuBLAS, or more rows than its
    last range). ``norm``: for ``norm_linear``'s fused RMSNorm, None also for rows in the
    tail or above, and where not every prefix configuration is ``norm_fusable`` (then the
    prefix's rows all take the separate norm kernel, so a row's bits do not depend on the
    range it falls in)."""
    if not 1 <= rows <= DOT_MAX_ROWS:
        return None
    shape = _shape(n, k, silu_mul)
    if shape is None or norm and not (shape.norm and rows <= shape.prefix):
        return None
    for max_rows, cfg in shape.ranges:
        if rows <= max_rows:
            return cfg
    return None


check_table(SKINNY_TABLE)
if os.environ.get("SPECLOOP_SKINNY_TABLE"):
    SKINNY_TABLE = _table_from_file(os.environ["SPECLOOP_SKINNY_TABLE"])


# SPECLOOP_SKINNY_STREAM_NORM's default (stream_modes): which stream fusions run.
STREAM_NORM_DEFAULT = "1"


class StreamModes(NamedTuple):
    """Which stream fusions a dispatcher runs (``stream_modes``)."""

    qkv: bool = False       # down's residual add, the next qkv's norm prologue
    mlp: bool = False       # o's residual add, gate-up's norm prologue (o on tl.dot)
    mlp_b: bool = False     # the same on o's b-family rows where down feeds qkv (5-8 rows)


def stream_modes(value: str) -> StreamModes:
    """SPECLOOP_SKINNY_STREAM_NORM's value -> StreamModes: "0" none, "1" / "all" qkv and
    mlp, else a comma-separated list of "qkv", "mlp" and "mlp-b" (which implies mlp: o and
    gate-up fused on o's b-family rows too, where the down GEMM feeds the next qkv; untimed
    on an H100)."""
    v = value.strip().lower().replace(" ", "")
    if v in ("0", ""):
        return StreamModes()
    if v in ("1", "all"):
        return StreamModes(qkv=True, mlp=True)
    names = set(v.split(","))
    if not names <= {"qkv", "mlp", "mlp-b"}:
        raise ValueError(f"SPECLOOP_SKINNY_STREAM_NORM={value!r}: want 0, 1, or a list of "
                         "qkv, mlp and mlp-b")
    return StreamModes(qkv="qkv" in names, mlp=bool(names & {"mlp", "mlp-b"}),
                       mlp_b="mlp-b" in names)


def _under_autograd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                    ) -> bool:
    """The product is recorded for backward (training): F.linear's, not a kernel's."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                        (bias is not None and bias.requires_grad))


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_linear_pointwise")


@functools.cache
def bf16_packing_available() -> bool:
    """oneDNN multiplies bf16 natively on this CPU (AMX or AVX512-BF16); elsewhere it
    would emulate them, slower than float32."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return packing_available() and check is not None and bool(check())


def skinny_available() -> bool:
    """The skinny kernel may run: Triton imports and ``SPECLOOP_SKINNY`` is not 0."""
    return _skinny.available() and os.environ.get("SPECLOOP_SKINNY", "1") != "0"


class PackedLinear:
    """``F.linear`` that, for CPU float32 inputs of MIN_ROWS..MAX_ROWS rows (bfloat16:
    1..MAX_ROWS, where ``bf16_packing_available``) outside autograd, multiplies by a
    oneDNN-packed copy of the weight, packed on first use (``enabled``), and for CUDA
    bf16/fp16 inputs of the rows SKINNY_TABLE covers (at most DOT_MAX_ROWS) runs the
    skinny-GEMM kernel (``skinny``).

    One cache per model (no module-level state). An entry holds the weight view it was
    packed from, so its storage stays alive and its address cannot be reused by another
    tensor; the weight's version counter (bumped by every in-place write: load, copy_, an
    optimizer step) must still match, or the weight is repacked.
    """

    def __init__(self, *, enabled: bool | None = None, skinny: bool | None = None) -> None:
        self.enabled = packing_available() if enabled is None else enabled
        self.skinny = skinny_available() if skinny is None else skinny
        # The RMSNorm before a GEMM in its prologue too (norm_linear), where the table allows
        # (the shipped one: qkv and gate-up at 1 row); SPECLOOP_SKINNY_NORM=0 keeps
        # the separate norm kernels (H200, batch 1, the third session's table: 1,332 ->
        # 1,578 tok/s with it).
        self.skinny_norm = self.skinny and os.environ.get("SPECLOOP_SKINNY_NORM", "1") != "0"
        # SwiGLU in the gate-up GEMM's epilogue, the down GEMM without its prologue
        # (norm_mlp); SPECLOOP_SKINNY_GLU=0 keeps the prologue path (the same bits).
        self.glu = self.skinny and os.environ.get("SPECLOOP_SKINNY_GLU", "1") != "0"
        # RoPE and the K/V cache write in the qkv GEMM's epilogue wherever its rows'
        # configuration allows (norm_linear_rope: the norm's broadcast kernel or a one-tile
        # tl.dot); SPECLOOP_SKINNY_ROPE=0 keeps the rope kernel after the GEMM (the same
        # bits).
        self.rope = self.skinny and os.environ.get("SPECLOOP_SKINNY_ROPE", "1") != "0"
        # The residual stream into the GEMMs' epilogues and the RMSNorms into the next
        # one-tile tl.dot's prologue, in two places, SPECLOOP_SKINNY_STREAM_NORM naming
        # which (stream_modes): "qkv", the down GEMM adds the MLP's output to the stream
        # where the next layer's qkv GEMM normalises the stream as it loads it
        # (takes_stream: its one-tile tl.dot with RoPE, 5-32 rows with the shipped table);
        # "mlp", the o GEMM adds attention's output where it runs its one-tile tl.dot
        # (5-32 rows) and gate-up normalises that stream as it loads it (out_norm_mlp).
        # The stream's bits are the same; the norm's sum of squares adds in another order.
        modes = stream_modes(os.environ.get("SPECLOOP_SKINNY_STREAM_NORM",
                                            STREAM_NORM_DEFAULT)) \
            if self.skinny else StreamModes()
        self.qkv_stream, self.mlp_stream, self.mlp_stream_b = modes
        # The first layer's qkv GEMM loads the tokens' embeddings itself where it
        # normalises the stream as loaded (gathers_embeddings): no embedding kernel
        # before it. SPECLOOP_GATHER_EMBEDDINGS=0 keeps that kernel (the same bits).
        self.gather_embeddings = self.skinny and \
            os.environ.get("SPECLOOP_GATHER_EMBEDDINGS", "1") != "0"
        # Tests: the skinny kernel also on CPU tensors (Triton's interpreter runs it there).
        self.skinny_on_cpu = False
        # (data_ptr, shape, stride) -> (the weight, its version when packed, the packing)
        self._packed: dict[tuple[int, tuple[int, ...], tuple[int, ...]],
                           tuple[torch.Tensor, int, torch.Tensor]] = {}

    @property
    def stream_norm(self) -> bool:
        """Both stream fusions on (``qkv_stream`` and ``mlp_stream``); setting it sets both
        (and turns ``mlp_stream_b`` off)."""
        return self.qkv_stream and self.mlp_stream

    @stream_norm.setter
    def stream_norm(self, on: bool) -> None:
        self.qkv_stream = self.mlp_stream = on
        self.mlp_stream_b = False

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        config = self._skinny_config(x, weight, bias, silu_mul=False)
        if config is not None:
            return _skinny.skinny_linear(x, weight, bias, config)
        if not self._applies(x, weight, bias):
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._pack(weight), bias, "none", [], "")

    def silu_mul_linear(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """gate_up [..., 2I] (gate, up), weight [H, I] -> (silu(gate) * up) @ weight^T: one
        skinny kernel where it runs and its configuration takes the silu-mul prologue
        (``_skinny.prologue_fits``), else the fused path's silu_mul kernel and the GEMM
        (that configuration's, or this dispatcher's): the same bits either way (the MLP's
        down projection of ``DecoderModel._fused_layer`` where ``norm_mlp`` could not put
        SwiGLU in the gate-up GEMM)."""
        config = self._skinny_config(gate_up, weight, None, silu_mul=True)
        if config is not None and _skinny.prologue_fits(config, weight.shape[1]):
            return _skinny.skinny_linear(gate_up, weight, None, config, silu_mul=True)
        from . import _kernels  # noqa: PLC0415  (Triton: the fused path's module)
        if config is not None:      # a one-tile tl.dot: silu_mul apart (prologue_fits)
            return _skinny.skinny_linear(_kernels.silu_mul(gate_up), weight, None, config)
        return self(_kernels.silu_mul(gate_up), weight)

    def norm_linear(self, x: torch.Tensor, delta: torch.Tensor | None,
                    norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None = None, capture: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (rms_norm(x + delta, norm_weight) @ weight^T (+ bias), x + delta): the fused
        layer's residual add + RMSNorm and the GEMM after it (``_kernels.add_rms_norm``'s
        contract: delta None, no add; ``capture`` also receives x + delta). One skinny
        kernel where ``skinny_norm`` is on, the rows fall in the shape's prefix (its ranges
        without tl.dot) and every prefix configuration takes K in one pass
        (``skinny_config(norm=True)``); else the norm kernel, then this dispatcher (the
        tl.dot tail or F.linear above the prefix)."""
        config = self._norm_config(x, delta, norm_weight, weight, bias)
        if config is not None:
            return _skinny.skinny_norm_linear(x, delta, norm_weight, eps, weight, bias,
                                              config, capture)
        from . import _kernels  # noqa: PLC0415  (Triton: the fused path's module)
        h, stream = _kernels.add_rms_norm(x, delta, norm_weight, eps, capture)
        return self(h, weight, bias), stream

    def norm_linear_rope(self, x: torch.Tensor, delta: torch.Tensor | None,
                         norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                         bias: torch.Tensor | None, capture: torch.Tensor | None,
                         rope: _skinny.RopeWrite,
                         gather: tuple[torch.Tensor, torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm_linear`` on x [B, T, H] with the qkv weight, then
        ``_kernels.rope_cache_write(qkv, *rope)`` -> (rotated q [B, T, Hq, D], x + delta).
        Where ``rope`` is on and the rows run a ``rope_fits`` configuration, RoPE and the
        cache write are the GEMM's epilogue: with the norm in its prologue too (a
        norm-fusable broadcast configuration, pairs of one head a program: the shipped
        table's qkv at 1-4 rows; ``skinny_norm_linear(rope=...)``), or after the norm
        kernel (a one-tile tl.dot of one head a program: 5-32 rows;
        ``skinny_rope_linear``; with no delta or capture where ``takes_stream``, x is the
        whole stream and that kernel normalises it as it loads it, no norm kernel). The
        same bits either way but for that norm's sum of squares. ``gather`` (tokens
        [B, T], the embedding table): x is to hold the tokens' embeddings, written here
        (the first layer): by the qkv GEMM as it loads them where it normalises the stream
        as loaded (``gathers_embeddings``), else by indexing first."""
        from . import _kernels  # noqa: PLC0415  (Triton: the fused path's module)
        plan = self._qkv_form(x, delta, norm_weight, weight, bias, rope.k_cache.shape[-1])
        # The stream, normed as loaded: the one-tile tl.dot with no delta or capture.
        as_loaded = delta is None and capture is None and \
            self._normed_as_loaded(plan, weight, norm_weight)
        if gather is not None and not as_loaded:
            torch.index_select(gather[1], 0, gather[0].reshape(-1), out=x.view(-1, x.shape[-1]))
            gather = None
        if plan is not None:
            form, config = plan
            if form == "norm":          # norm prologue and rope epilogue
                return _skinny.skinny_norm_linear(x, delta, norm_weight, eps, weight, bias,
                                                  config, capture, rope=rope)
            if as_loaded:
                return _skinny.skinny_rope_linear(x, weight, bias, config, rope,
                                                  norm=(norm_weight, eps), gather=gather), x
            h, stream = _kernels.add_rms_norm(x, delta, norm_weight, eps, capture)
            return _skinny.skinny_rope_linear(h, weight, bias, config, rope), stream
        qkv, stream = self.norm_linear(x, delta, norm_weight, eps, weight, bias, capture)
        return _kernels.rope_cache_write(qkv, *rope), stream

    def gathers_embeddings(self, x: torch.Tensor, norm_weight: torch.Tensor,
                           weight: torch.Tensor, bias: torch.Tensor | None, head_dim: int
                           ) -> bool:
        """The first layer's qkv GEMM on rows x [B, T, H] (no delta, no capture) loads
        the embeddings itself (``norm_linear_rope``'s ``gather``): where it normalises
        the stream as loaded (``takes_stream``; ``gather_embeddings``)."""
        return self.gather_embeddings and self.takes_stream(x, norm_weight, weight, bias, head_dim)

    def takes_stream(self, x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None, head_dim: int) -> bool:
        """``norm_linear_rope`` on these rows with no delta and no capture would normalise
        the stream as the qkv GEMM loads it (``qkv_stream``: its one-tile tl.dot with
        RoPE, no norm-fusable prefix there): the GEMM before it should then add its
        product to the stream (``out_norm_mlp``'s ``feeds_stream``)."""
        return self._normed_as_loaded(self._qkv_form(x, None, norm_weight, weight, bias,
                                                     head_dim), weight, norm_weight)

    def _qkv_form(self, x: torch.Tensor, delta: torch.Tensor | None,
                  norm_weight: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  head_dim: int) -> tuple[str, SkinnyConfig] | None:
        """How ``norm_linear_rope`` runs these rows: ("norm", its config) the norm's
        broadcast kernel with RoPE, ("dot", its config) the one-tile tl.dot with RoPE,
        or None: the rope kernel after ``norm_linear``."""
        if not self.rope or x.dim() != 3:
            return None
        k = weight.shape[1]
        fused = self._norm_config(x, delta, norm_weight, weight, bias)
        if fused is not None:
            return ("norm", fused) if _skinny.rope_fits(fused, k, head_dim) else None
        config = self._skinny_config(x, weight, bias, silu_mul=False)
        if config is not None and config.dot and _skinny.rope_fits(config, k, head_dim):
            return "dot", config
        return None

    def _normed_as_loaded(self, plan: tuple[str, SkinnyConfig] | None, weight: torch.Tensor,
                          norm_weight: torch.Tensor) -> bool:
        """Whether the qkv ``plan`` (``_qkv_form``'s, with no delta or capture) normalises
        the stream as its one-tile tl.dot loads it."""
        return plan is not None and plan[0] == "dot" and self.qkv_stream and \
            norm_weight.dim() == 1 and _skinny.norm_prologue_fits(plan[1], weight.shape[1])

    def out_norm_mlp(self, x: torch.Tensor, o: torch.Tensor, w_o: torch.Tensor,
                     norm_weight: torch.Tensor, eps: float, w_gate_up: torch.Tensor,
                     w_down: torch.Tensor, feeds_stream: bool = False
                     ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The layer after attention: -> (the MLP's output, x + o @ w_o^T), as
        ``norm_mlp(x, self(o, w_o), ...)``. With ``mlp_stream``, where the o GEMM runs
        its one-tile tl.dot (which takes the residual add in its epilogue,
        ``_skinny.residual_fits``) and the gate-up GEMM's configuration a norm prologue
        with SwiGLU (``norm_prologue_fits``, ``glu_fits``), the o GEMM writes the stream
        and the gate-up GEMM normalises it as it loads it: no add_rms_norm between them
        (on the b-family rows of o, 2-8 with the shipped table, an H100 timed that
        slower: bench/bench_stream_norm_gpu.py; ``mlp_stream_b`` fuses them there too
        where ``feeds_stream``, for an A/B). ``feeds_stream`` (the next GEMM
        ``takes_stream``): where the down GEMM's configuration takes the residual add,
        -> (None, the stream after the MLP). The stream's bits are the same; the norm's
        sum of squares adds in another order."""
        if self.mlp_stream and self.glu and norm_weight.dim() == 1 and \
                self._norm_config(x, None, norm_weight, w_gate_up, None) is None:
            c_o = self._skinny_config(o, w_o, None, silu_mul=False)
            c_gu = self._skinny_config(x, w_gate_up, None, silu_mul=False)
            k = w_gate_up.shape[1]
            if c_o is not None and c_gu is not None \
                    and (c_o.dot or self.mlp_stream_b and feeds_stream) \
                    and _skinny.residual_fits(c_o, w_o.shape[1]) \
                    and _skinny.norm_prologue_fits(c_gu, k) and _skinny.glu_fits(c_gu, k):
                stream = _skinny.skinny_linear(o, w_o, None, c_o, residual=x)
                act = _skinny.skinny_linear(stream, w_gate_up, None, c_gu, glu=True,
                                            norm=(norm_weight, eps))
                return self._down_after(act, stream, w_down, feeds_stream)
        return self.norm_mlp(x, self(o, w_o), norm_weight, eps, w_gate_up, w_down,
                             feeds_stream)

    def _down_after(self, act: torch.Tensor, stream: torch.Tensor, w_down: torch.Tensor,
                    feeds_stream: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The down GEMM on the activation -> (its output, the stream), or, where
        ``feeds_stream`` and its configuration takes the residual add, (None, the stream
        after the MLP): the next GEMM normalises that stream, no delta."""
        c_down = self._down_config(act, w_down)
        if feeds_stream and c_down is not None and \
                _skinny.residual_fits(c_down, w_down.shape[1]):
            return None, _skinny.skinny_linear(act, w_down, None, c_down, residual=stream)
        return self._down(act, w_down, c_down), stream

    def _down_config(self, act: torch.Tensor, w_down: torch.Tensor) -> SkinnyConfig | None:
        """The down GEMM's configuration on silu(gate) * up (``norm_mlp``'s activation):
        the silu entry's, without the prologue."""
        return self._skinny_config(act, w_down, None, silu_mul=True, activated=True)

    def _down(self, act: torch.Tensor, w_down: torch.Tensor,
              config: SkinnyConfig | None) -> torch.Tensor:
        """The down GEMM on the activation by ``_down_config``'s ``config`` (None: F.linear)."""
        if config is not None:
            return _skinny.skinny_linear(act, w_down, None, config)
        return self(act, w_down)

    def norm_mlp(self, x: torch.Tensor, delta: torch.Tensor | None,
                 norm_weight: torch.Tensor, eps: float, w_gate_up: torch.Tensor,
                 w_down: torch.Tensor, feeds_stream: bool = False
                 ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """-> (the MLP's output, x + delta): rms_norm(x + delta) through the gate-up GEMM
        (``w_gate_up`` [2I, H]: gate rows, then up rows), SwiGLU and the down GEMM
        (``w_down`` [H, I]). Where ``glu`` is on and the skinny kernel runs the gate-up GEMM
        on a configuration that holds whole (gate, up) pairs, SwiGLU is that GEMM's
        epilogue and the down GEMM reads the activation on its own configurations
        (SKINNY_TABLE's silu entry) without the prologue, which recomputed silu * up in
        every program (H200, SmolLM2: ~1 us a layer less at 4-5 rows; n-gram K = 4 at
        batch 1 +6.5 % tok/s). Either way the bits of ``norm_linear`` then
        ``silu_mul_linear``, the path taken otherwise. ``feeds_stream``: as
        ``out_norm_mlp``'s (on the GLU path)."""
        if self.glu:
            activated = self._norm_glu(x, delta, norm_weight, eps, w_gate_up)
            if activated is not None:
                return self._down_after(*activated, w_down, feeds_stream)
        gate_up, stream = self.norm_linear(x, delta, norm_weight, eps, w_gate_up)
        return self.silu_mul_linear(gate_up, w_down), stream

    def _norm_glu(self, x: torch.Tensor, delta: torch.Tensor | None,
                  norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``norm_linear`` with SwiGLU in the GEMM's epilogue -> (silu(gate) * up, x +
        delta), or None where the GEMM's configuration cannot take it (F.linear, split K,
        an odd BLOCK_N): the caller then takes the path without."""
        n, k = weight.shape
        if n % 2:
            return None
        fused = self._norm_config(x, delta, norm_weight, weight, None)
        if fused is not None:
            if not _skinny.glu_fits(fused, k):
                return None
            return _skinny.skinny_norm_linear(x, delta, norm_weight, eps, weight, None, fused,
                                              glu=True)
        config = self._skinny_config(x, weight, None, silu_mul=False)
        if config is None or not _skinny.glu_fits(config, k):
            return None
        from . import _kernels  # noqa: PLC0415  (Triton: the fused path's module)
        h, stream = _kernels.add_rms_norm(x, delta, norm_weight, eps)
        return _skinny.skinny_linear(h, weight, None, config, glu=True), stream

    def _norm_config(self, x: torch.Tensor, delta: torch.Tensor | None,
                     norm_weight: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> SkinnyConfig | None:
        """The configuration that runs ``norm_linear``'s norm in the GEMM's prologue, or
        None (the separate norm kernel)."""
        if self.skinny_norm and norm_weight.dim() == 1 and \
                (delta is None or delta.dtype == x.dtype and delta.shape == x.shape):
            return self._skinny_config(x, weight, bias, silu_mul=False, norm=True)
        return None

    def _skinny_config(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       *, silu_mul: bool, norm: bool = False,
                       activated: bool = False) -> SkinnyConfig | None:
        """``activated``: x is silu(gate) * up already [..., K] (``norm_mlp``), run on the
        silu entry's configurations (``silu_mul`` True) without the prologue."""
        if not self.skinny or x.dtype not in (torch.bfloat16, torch.float16) \
                or weight.dtype != x.dtype or weight.dim() != 2 or weight.stride(1) != 1 \
                or not (x.device.type == "cuda" or self.skinny_on_cpu and x.device.type == "cpu"):
            return None
        if bias is not None and (bias.dtype != x.dtype or bias.dim() != 1 or bias.stride(0) != 1):
            return None
        n, k = weight.shape
        if x.shape[-1] != (2 * k if silu_mul and not activated else k):
            return None
        if _under_autograd(x, weight, bias):
            return None
        return skinny_config(x.numel() // max(x.shape[-1], 1), n, k, silu_mul, norm=norm)

    def _applies(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> bool:
        if not self.enabled or x.device.type != "cpu" or weight.dtype != x.dtype \
                or weight.dim() != 2 \
                or weight.is_inference():    # no version counter to notice a rewrite
            return False
        if x.dtype == torch.float32:
            low = MIN_ROWS      # 1 row: MKL's gemv, F.linear's bits
        elif x.dtype == torch.bfloat16 and bf16_packing_available():
            low = 1
        else:
            return False
        rows = x.numel() // max(x.shape[-1], 1)
        if not low <= rows <= MAX_ROWS:
            return False
        if _under_autograd(x, weight, bias):
            return False
        return bias is None or bias.dtype == x.dtype

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), tuple(weight.shape), weight.stride())
        entry = self._packed.get(key)
        if entry is None or entry[1] != weight._version:
            with torch.inference_mode(False), torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(
                    weight.detach().contiguous(), None)
            entry = self._packed[key] = (weight, weight._version, packed)
        return entry[2]

    def clear(self) -> None:
        self._packed.clear()

    # A copied (or pickled) model has weights of its own: it starts with an empty cache
    # (packed tensors are opaque and cannot be copied anyway).
    def __deepcopy__(self, memo: dict[int, object]) -> "PackedLinear":
        clone = PackedLinear(enabled=self.enabled, skinny=self.skinny)
        clone.skinny_norm, clone.skinny_on_cpu = self.skinny_norm, self.skinny_on_cpu
        clone.glu = self.glu
        return clone

    def __getstate__(self) -> dict[str, object]:
        return {"enabled": self.enabled, "skinny": self.skinny, "skinny_norm": self.skinny_norm,
                "glu": self.glu, "skinny_on_cpu": self.skinny_on_cpu, "_packed": {}}
