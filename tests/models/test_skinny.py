"""The skinny-GEMM kernel (models/_skinny) and its dispatch (models/_linear).

The kernel runs under Triton's interpreter in a child process (tests/interpreted.py): it
equals a float64 reference within the inputs' rounding for 1..17 rows with tl.dot (and
40: several row blocks), 1, 3 and 9 rows without (rows one after the other in blocks of
8), N and K off the block sizes, with bias, K split over programs or not, and the
silu-mul-down variant; twice the same input gives the same bits, and a row gives the same
bits whatever the number of rows in the call. The same for the one-reduction (``b``) family,
1..17 rows, its RMSNorm prologue included. The RMSNorm-prologue variant equals
add_rms_norm then the GEMM. The interpreter's tl.dot (and elementwise products) multiply
bf16 tensors as their raw 16-bit integers (it stores bf16 as uint16), so tl.dot
configurations and the RMSNorm prologue are checked in fp16 and fp32 here and in bf16 by
the GPU tests below, which also check the row-count invariance on the hardware. The
dispatcher's choices (table, window, switches) run in-process.
"""

import importlib
import subprocess

import pytest
import torch
import torch.nn.functional as F

from specloop.models import _linear
from specloop.models._linear import (DOT_MAX_ROWS, SKINNY_MAX_ROWS, SKINNY_TABLE, PackedLinear,
                                     default_config, parse_config, skinny_config)
from specloop.models._skinny import SkinnyConfig

from ..interpreted import run_interpreted

# The float64 check both kernel children run (prepended to their source).
CHECK_SOURCE = r"""import torch

def check_against_float64(y, x, w, bias, act, dtype, eps, where):
    # y == x @ w.T (+ bias) in float64 within y's rounding, fp32 summation over K and
    # (act: x is gate-up) the silu-mul operand's rounding, as _kernels.silu_mul rounds it.
    assert y.dtype == dtype and y.shape == (x.shape[0], w.shape[0]), where
    K = w.shape[1]
    if act:
        g, u = x[:, :K].float(), x[:, K:].float()
        a = (g / (1.0 + torch.exp(-g)) * u).to(dtype).double()
    else:
        a = x.double()
    ref = a @ w.double().T + (0 if bias is None else bias.double())
    scale = a.abs() @ w.double().abs().T
    bound = eps * ref.abs() + (eps if act else 1e-5) * scale + 1e-6
    assert ((y.double() - ref).abs() <= bound).all(), where

def norm_linear_checked(x, d, nw, w, bias, cfg, dtype, eps):
    # skinny_norm_linear: the stream (and its copy) == _kernels.add_rms_norm's bits, y
    # within the normed operand's rounding; -> y.
    from specloop.models import _kernels
    from specloop.models._skinny import skinny_norm_linear
    M, K = x.shape[0], w.shape[1]
    copy = torch.zeros(M, 2 * K, dtype=dtype)[:, K:]
    y, stream = skinny_norm_linear(x, d, nw, 1e-5, w, bias, cfg, copy)
    h, want = _kernels.add_rms_norm(x, d, nw, 1e-5)
    assert torch.equal(stream, want) and torch.equal(copy, want)
    assert (stream is x) == (d is None)
    ref = h.double() @ w.double().T + (0 if bias is None else bias.double())
    scale = h.double().abs() @ w.double().abs().T
    assert ((y.double() - ref).abs() <= eps * ref.abs() + eps * scale + 1e-6).all(), \
        (dtype, cfg, M)
    return y
"""

# A check the GLU, RoPE and stream children share (prepended to their source).
REFUSED_SOURCE = r"""
def refused(call, word, where):
    # call() raises a ValueError whose message names ``word``
    try:
        call()
    except ValueError as e:
        assert word in str(e), (where, str(e))
    else:
        raise AssertionError(where)
"""
KERNEL_CHILD = CHECK_SOURCE + r"""
import torch
import torch.nn.functional as F
from specloop.models._skinny import SkinnyConfig, skinny_linear

torch.manual_seed(0)
# Broadcast: K over 3 programs (partials, the last short), all of K in one pass, K over 2;
# tl.dot: a loop over K, split 2 ways, and all of K in one tile (ONE_PASS).
configs = [SkinnyConfig(False, 8, 32), SkinnyConfig(False, 8, 128), SkinnyConfig(False, 4, 64),
           SkinnyConfig(True, 16, 32), SkinnyConfig(True, 32, 16, split_k=2),
           SkinnyConfig(True, 16, 128), SkinnyConfig(True, 16, 128, tile_m=32)]
N, K = 19, 83                      # neither a multiple of any block
w32, b32 = torch.randn(N, K), torch.randn(N)
gu32 = torch.randn(40, 2 * K) * 2
# The broadcast configs (BLOCK_N 4 and 8) take W's first 11 rows: still several programs
# along N, the last partial, at about 60% of the programs of N = 19 (each one slow to
# interpret). tl.dot (BLOCK_N 16) keeps N = 19: two programs along N, the second partial.
NV = 11
# Per dtype: the relative error of one rounding to it (the interpreter's fp32 -> bf16
# cast truncates: 2^-7; CUDA's rounds to nearest), for y and for the silu-mul operand.
for dtype, eps in ((torch.float32, 1e-6), (torch.float16, 2.0 ** -10), (torch.bfloat16, 2.0 ** -7)):
    for ci, cfg in enumerate(configs):
        # fp32 runs every config; fp16 the tl.dot ones, bf16 the first (the interpreter's
        # bf16 tl.dot: see the module doc; the broadcast path is slow to interpret).
        if dtype != torch.float32 and (cfg.dot != (dtype == torch.float16) or ci in (1, 2)):
            continue
        w, b = (w32.to(dtype), b32.to(dtype)) if cfg.dot else (w32[:NV].to(dtype),
                                                               b32[:NV].to(dtype))
        # tl.dot: rows 1..17 spread over the two configs, 40 = 3 row blocks. Broadcast
        # (rows one after the other in blocks of up to 8; slow to interpret): 1, 3, a
        # block and a row.
        if cfg.dot and cfg.tile_m:     # blocks of 32 rows: one partial, two (40)
            cases = [(17, False), (40, True)]
        elif cfg.dot:
            cases = [(M, act) for M in sorted({16, 17, 40, *range(1 + ci % 2, 18, 2)})
                     for act in (False, True)]
        else:
            cases = [(1, False), (3, True), (9, False)]
        for M, act in cases:
            x = gu32[:M].to(dtype) if act else gu32[:M, :K].to(dtype)
            bias = None if act or M % 2 else b
            y = skinny_linear(x, w, bias, cfg, silu_mul=act)
            check_against_float64(y, x, w, bias, act, dtype, eps, (dtype, cfg, M, act))
            if M in (9, 17):   # the same bits twice, and a row's whatever the rows
                assert torch.equal(y, skinny_linear(x, w, bias, cfg, silu_mul=act))
                for m in (1, 3):
                    assert torch.equal(y[:m], skinny_linear(x[:m], w, bias, cfg,
                                                            silu_mul=act)), (cfg, m)
# RMSNorm (after a residual add) in the prologue: == _kernels.add_rms_norm then the GEMM,
# the stream (and its copy) bit for bit, y within the rounding of the normed operand. Not
# bf16: the interpreter multiplies bf16 tensors as their raw bits there too (w * normed).
from specloop.models import _kernels
from specloop.models._skinny import skinny_norm_linear
for dtype, eps in ((torch.float32, 1e-6), (torch.float16, 2.0 ** -10)):
    w, b = w32[:NV].to(dtype), b32[:NV].to(dtype)       # broadcast: NV rows (above)
    nw = (torch.rand(K) + 0.5).to(dtype)
    for cfg in (SkinnyConfig(False, 8, 128), SkinnyConfig(False, 4, 128, num_warps=2)):
        for M, with_delta, bias in ((1, True, None), (3, False, b), (9, True, b)):
            x = (gu32[:M, :K] * 3).to(dtype)
            d = gu32[:M, K:].to(dtype) if with_delta else None
            y = norm_linear_checked(x, d, nw, w, bias, cfg, dtype, eps)
            assert torch.equal(y, skinny_norm_linear(x, d, nw, 1e-5, w, bias, cfg)[0])
# Leading dims, a strided x (rows of a wider tensor), and x rows > 32 in row blocks.
x = torch.randn(2, 3, 2 * K)[..., :K]
cfg = SkinnyConfig(False, 8, 32)
torch.testing.assert_close(skinny_linear(x, w32, b32, cfg), F.linear(x, w32, b32),
                           rtol=1e-5, atol=1e-5)
print("ok")
"""


@pytest.mark.xdist_group("interpreted")   # one interpreter server (tests/interpreted.py)
@pytest.mark.skipif(not _linear._skinny.available(), reason="needs Triton")
def test_skinny_kernel_equals_float64_reference_interpreted():
    run_interpreted(KERNEL_CHILD)


@pytest.fixture
def skinny_launches(monkeypatch) -> list:
    """The skinny kernels' launches, recorded (each launch's meta keywords), not run."""
    from specloop.models import _skinny
    launches: list = []

    class Recorder:       # kernel[grid](*args, **meta) without running anything
        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append(meta)
    monkeypatch.setattr(_skinny, "_skinny_kernel", Recorder())
    monkeypatch.setattr(_skinny, "_splitk_reduce_kernel", Recorder())
    return launches


@pytest.mark.skipif(not _linear._skinny.available(), reason="needs Triton")
def test_skinny_launcher_takes_one_pass_where_block_k_covers_a_programs_k(skinny_launches):
    """skinny_linear launches the tl.dot path's one-tile form (ONE_PASS: W before PDL's
    wait, one tl.dot) exactly where one BLOCK_K covers a program's K range, with or without
    split-K; the pipelined loop elsewhere; the broadcast families never. (The interpreted
    test above gives both forms the same arithmetic: only the launch tells them apart.)"""
    from specloop.models import _skinny
    launches = skinny_launches
    w, x = torch.zeros(40, 576).half(), torch.zeros(3, 576).half()
    for tag, one_pass in (("d16x1024s1w4n1", True), ("d64x1024s1w8n2", True),
                          ("d16x128s8w4n3", True),      # 5 splits of one BLOCK_K each
                          ("d16x64s1w4n3", False), ("d16x512s1w4n3", False),
                          ("d16x128s2w4n3", False),     # 2 splits of 384: loops
                          ("v2x1024s1w4n3", False), ("b2x2x1024s1w4n3", False)):
        launches.clear()
        _skinny.skinny_linear(x, w, None, parse_config(tag))
        assert launches[0].get("ONE_PASS", False) is one_pass, tag


@pytest.mark.skipif(not _linear._skinny.available(), reason="needs Triton")
def test_one_tile_dot_takes_k_as_two_tiles_where_it_pads_a_quarter(skinny_launches,
                                                                  monkeypatch):
    """A one-tile tl.dot whose K range fills at most 3/4 of its power-of-two BLOCK_K runs
    it as BLOCK_K / 2 then the smallest power of two covering the rest (PIECE: K = 576 as
    512 + 64): the launcher passes it, SPECLOOP_SKINNY_PIECES=0 (``PIECES``) keeps one tile,
    and loops, split ranges of one BLOCK_K and the broadcast families never take it."""
    from specloop.models import _skinny
    launches = skinny_launches
    for k, tag, piece in ((576, "d64x1024s1w8n1", 64), (576, "d128x1024s1w8n1", 64),
                          (1152, "d64x2048s1w8n1", 128), (520, "d16x1024s1w4n1", 16),
                          (1024, "d64x1024s1w8n1", 0),        # fills its tile
                          (900, "d64x1024s1w8n1", 0),         # 512 + 512: no gain
                          (1728, "d64x2048s1w8n1", 0),        # 1024 + 1024
                          (576, "d16x128s8w4n3", 0),          # splits of one BLOCK_K
                          (576, "d16x64s1w4n3", 0),           # the loop
                          (576, "v4x1024s1w4n3", 0), (576, "b2x2x1024s1w4n3", 0)):
        cfg = parse_config(tag)
        assert _skinny.one_pass_piece(cfg, k) == piece, (k, tag)
        launches.clear()
        _skinny.skinny_linear(torch.zeros(3, k).half(), torch.zeros(40, k).half(), None, cfg)
        assert launches[0].get("PIECE", 0) == piece, (k, tag)
    monkeypatch.setattr(_skinny, "PIECES", False)
    assert _skinny.one_pass_piece(parse_config("d64x1024s1w8n1"), 576) == 0


def test_sliced_one_tile_dot_launches_its_slices_only_where_they_fit(skinny_launches):
    """``k<n>`` (``SkinnyConfig.slices``): a one-tile tl.dot without split K passes SLICES
    where its first tile's slices are at least 16 wide; loops, split K, the broadcast
    families and too-narrow slices launch unsliced (SLICES absent: the kernel's default 1,
    the shipped kernels unchanged); the tag round-trips."""
    from specloop.models import _skinny
    launches = skinny_launches
    for k, tag, slices in ((576, "d64x1024s1w8n1k4", 4), (576, "d64x1024s1w8n1k8", 8),
                           (1536, "d32x2048s1w8n1k4", 4), (576, "d64x1024s1w8n1", 1),
                           (576, "d16x64s1w4n3k4", 1),          # the loop over K
                           (576, "d16x128s8w4n3k2", 1),         # split K
                           (64, "d16x64s1w4n1k4", 4),           # 64 / 4 = 16: fits
                           (32, "d16x32s1w4n1k4", 1)):          # 32 / 4 = 8: too narrow
        cfg = parse_config(tag)
        assert cfg.tag() == tag
        assert cfg.slices_for(k) == slices, (k, tag)
        launches.clear()
        _skinny.skinny_linear(torch.zeros(3, k).half(), torch.zeros(40, k).half(), None, cfg)
        assert launches[0].get("SLICES", 1) == slices, (k, tag)
    for bad in ("v8x1024s1w2n3k4", "b2x4x1024s1w4n3k2", "d64x1024s1w8n1k3",
                "d64x1024s1w8n1k1"):
        with pytest.raises(ValueError, match="not a skinny config tag"):
            parse_config(bad)


SLICES_CHILD = CHECK_SOURCE + r"""
import torch
from specloop.models._skinny import SkinnyConfig, skinny_linear
torch.manual_seed(0)
# K = 100 in a 128 tile (4 slices of 32), K = 200 as 128 + 128 (PIECE 128: 2 + 2 slices
# of 64 with 2 slices), K = 150 as 128 + 32 (the piece narrower than a slice: one of 32).
N = 19
for K, bk in ((100, 128), (200, 256), (150, 256)):
    w32, b32 = torch.randn(N, K), torch.randn(N)
    x32 = torch.randn(17, K) * 2
    nw = (torch.rand(K) + 0.5)
    for dtype, eps in ((torch.float32, 1e-6), (torch.float16, 2.0 ** -10)):
        w, b, nwd = w32.to(dtype), b32.to(dtype), nw.to(dtype)
        for slices in (2, 4):
            cfg = SkinnyConfig(True, 16, bk, slices=slices)
            assert cfg.slices_for(K) == slices
            y17 = None
            for M in (1, 5, 16, 17):
                x = x32[:M].to(dtype)
                bias = b if M % 2 else None
                y = skinny_linear(x, w, bias, cfg)
                check_against_float64(y, x, w, bias, False, dtype, eps, (K, dtype, slices, M))
                if M == 17:      # a row's bits whatever the rows in the call
                    for m in (1, 5, 16):
                        assert torch.equal(y[:m], skinny_linear(x[:m], w, bias, cfg)), m
                # the residual epilogue and the norm prologue take the slices too
                r = x32[:M, :N].to(dtype)
                yr = skinny_linear(x, w, None, cfg, residual=r)
                check_against_float64(yr - r, x, w, None, False, dtype, 2 * eps, ("res", M))
                yn = skinny_linear(x, w, None, cfg, norm=(nwd, 1e-5))
                xf = x.double()
                h = xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + 1e-5) * nwd.double()
                ref = h @ w.double().T
                scale = h.abs() @ w.double().abs().T
                assert ((yn.double() - ref).abs() <= 2 * eps * (ref.abs() + scale)
                        + 1e-5).all(), ("norm", K, dtype, slices, M)
                # Each slice in a program of its own (``p``), the last adding them in
                # order: the one program's bits, with the bias, the residual and GLU;
                # called twice (the counters each call leaves zero). K = 150 in two
                # slices (64, 64, then the piece's 32) is not of one width: one program,
                # as without ``p``; in four, five programs of 32.
                cp = cfg._replace(slice_programs=True)
                want = {100: slices, 200: slices, 150: 0 if slices == 2 else 5}[K]
                assert cp.slice_grid(K) == want, (K, slices, cp.slice_grid(K))
                wg = torch.cat((w, w.flip(0)))[:2 * 9]
                for _ in range(2):
                    assert torch.equal(skinny_linear(x, w, bias, cp), y), (K, slices, M)
                    assert torch.equal(skinny_linear(x, w, None, cp, residual=r), yr)
                    assert torch.equal(skinny_linear(x, wg, None, cp, glu=True),
                                       skinny_linear(x, wg, None, cfg, glu=True))
                # (with the norm the slices stay in one program: each needs all of K)
                assert torch.equal(skinny_linear(x, w, None, cp, norm=(nwd, 1e-5)), yn)
print("ok")
"""


@pytest.mark.xdist_group("interpreted")   # one interpreter server (tests/interpreted.py)
@pytest.mark.skipif(not _linear._skinny.available(), reason="needs Triton")
def test_sliced_one_tile_dot_equals_float64_reference_interpreted():
    """A sliced one-tile tl.dot (each slice of K its own tl.dot and accumulator, summed in
    order) equals the float64 reference within the inputs' rounding (fp32, fp16), with the
    bias, the residual epilogue and the norm prologue, its PIECE tile in slices or one,
    and gives a row the same bits whatever the rows in the call; with its slices in
    programs of their own (``p``) the same bits as in one program."""
    run_interpreted(SLICES_CHILD)

TILE_CHILD = CHECK_SOURCE + r"""
import torch
from specloop.models import _kernels
from specloop.models._skinny import SkinnyConfig, skinny_linear, skinny_norm_linear

torch.manual_seed(0)
# Neither a multiple of any block; N = 11 still gives every config (BLOCK_N 2, 4, 8)
# several programs along N, the last partial (19 did the same with ~1.7x the programs,
# each slow to interpret).
N, K = 11, 83
w32, b32 = torch.randn(N, K), torch.randn(N)
gu32 = torch.randn(17, 2 * K) * 2
# One reduction over blocks of 4 / 8 rows: all of K in one pass; K over 3 programs (fp32
# partials + the ordered reduce); K over 2 programs, one row of W a program.
configs = [SkinnyConfig(False, 2, 128, tile_m=4), SkinnyConfig(False, 4, 32, tile_m=8),
           SkinnyConfig(False, 8, 64, tile_m=4, num_warps=2)]
for dtype, eps in ((torch.float32, 1e-6), (torch.float16, 2.0 ** -10),
                   (torch.bfloat16, 2.0 ** -7)):
    w, b = w32.to(dtype), b32.to(dtype)
    for ci, cfg in enumerate(configs):
        # fp32: rows 1..17 spread over the configs (one, several and a partial row block),
        # with and without bias, plain and silu-mul; fp16 / bf16 (the interpreter's
        # fp32 -> bf16 cast truncates): a few. (Each program is slow to interpret.)
        rows = range(1 + ci, 18, 3) if dtype == torch.float32 else (ci + 1, 9)
        for M in sorted({*rows, 17} if dtype == torch.float32 else rows):
            for act in ((False, True) if M == 17 else (M % 2 == 0,)):
                x = gu32[:M].to(dtype) if act else gu32[:M, :K].to(dtype)
                bias = None if act or (M + ci) % 2 else b
                y = skinny_linear(x, w, bias, cfg, silu_mul=act)
                check_against_float64(y, x, w, bias, act, dtype, eps, (dtype, cfg, M, act))
                if M == 17 and dtype == torch.float32:
                    # The same bits twice, and a row's whatever the rows in the call.
                    assert torch.equal(y, skinny_linear(x, w, bias, cfg, silu_mul=act))
                    for m in (1, 2, 3, 4, 5, 8, 9, 16):
                        assert torch.equal(y[:m], skinny_linear(x[:m], w, bias, cfg,
                                                                silu_mul=act)), (cfg, m, act)
# The RMSNorm prologue over a block of rows: the stream and its copy == add_rms_norm's bits,
# y within the normed operand's rounding, a row's y whatever the rows (fp32, fp16: the
# interpreter multiplies bf16 as raw bits there).
for dtype, eps in ((torch.float32, 1e-6), (torch.float16, 2.0 ** -10)):
    w, b = w32.to(dtype), b32.to(dtype)
    nw = (torch.rand(K) + 0.5).to(dtype)
    for cfg in (SkinnyConfig(False, 2, 128, tile_m=4),
                SkinnyConfig(False, 4, 128, num_warps=2, tile_m=8)):
        ys = {}
        for M, with_delta, bias in ((1, True, None), (2, False, b), (3, True, b),
                                    (5, True, None), (9, False, b), (17, True, b),
                                    (4, True, None)):
            x = (gu32[:M, :K] * 3).to(dtype)
            d = gu32[:M, K:].to(dtype) if with_delta else None
            y = norm_linear_checked(x, d, nw, w, bias, cfg, dtype, eps)
            key = (with_delta, bias is None)      # a row's bits: == the 17-row call's
            if key not in ys:
                ys[key] = skinny_norm_linear((gu32[:17, :K] * 3).to(dtype),
                                             gu32[:17, K:].to(dtype) if with_delta
                                             else None, nw, 1e-5, w, bias, cfg)[0]
            assert torch.equal(y, ys[key][:M]), (dtype, cfg, M)
print("ok")
"""


@pytest.mark.xdist_group("interpreted")   # one interpreter server (tests/interpreted.py)
@pytest.mark.skipif(not _linear._skinny.available(), reason="needs Triton")
def test_one_reduction_tile_equals_float64_reference_interpreted():
    """The ``b`` family (a block of rows reduced over K in one reduction; models/_skinny):
    float64 reference for 1..17 rows, N and K off the blocks, bias, silu-mul, K over several
    programs, the RMSNorm prologue; each row's bits whatever the rows in the call."""
    run_interpreted(TILE_CHILD)


LAYER_CHILD = r"""
import sys, torch
from specloop.models import PageTable, load_model, _kernels, _linear, _skinny

model = load_model(sys.argv[1], dtype=torch.float16).model
model.kernels = True
V = model.args.vocab_size
calls = {}
def counting(module, name):
    fn = getattr(module, name)
    def counted(*a, **k):
        calls[name] = calls.get(name, 0) + 1
        if name == "skinny_linear" and a[3].dot:
            calls["tl.dot"] = calls.get("tl.dot", 0) + 1
        if k.get("glu"):
            calls["glu"] = calls.get("glu", 0) + 1
        return fn(*a, **k)
    setattr(module, name, counted)
for module, name in ((_skinny, "skinny_linear"), (_skinny, "skinny_norm_linear"),
                     (_skinny, "skinny_rope_linear"), (_kernels, "rope_cache_write"),
                     (_kernels, "silu_mul"), (_kernels, "add_rms_norm")):
    counting(module, name)
L, H = model.args.num_layers, model.args.hidden_size
qkv_n = (model.args.num_heads + 2 * model.args.num_kv_heads) * model.args.head_dim
gate_up_n = 2 * model.args.intermediate_size
out = {}
# "dot": the shipped table's form for qkv and gate-up from 2 rows (the fifth session's at
# every row count), one-tile tl.dot (ONE_PASS: BLOCK_K covers K), which takes no norm
# prologue: add_rms_norm runs before them.
# glu: SwiGLU in the gate-up GEMM's epilogue, the down GEMM without its prologue (the same
# bits as without: checked below). rope: with tl.dot of one head a program (d16: the tiny
# model's head_dim), RoPE and the cache write in the qkv GEMM's epilogue (the same bits).
for skinny, norm, dot, glu, rope in ((False, False, False, False, False),
                                     (True, False, False, False, False),
                                     (True, False, False, True, False),
                                     (True, True, False, False, False),
                                     (True, True, False, True, False),
                                     (True, True, False, True, True),
                                     (True, True, True, False, False),
                                     (True, True, True, True, False),
                                     (True, True, True, True, True),
                                     (True, True, True, True, "stream")):
    # "stream": rope too, and ``stream_norm`` with o on tl.dot: the residual add after
    # attention in o's epilogue, the norm in gate-up's prologue.
    stream = rope == "stream"
    model.linear.skinny = model.linear.skinny_on_cpu = skinny
    model.linear.skinny_norm, model.linear.glu, model.linear.rope = norm, glu, bool(rope)
    model.linear.stream_norm = stream
    for n in (qkv_n, gate_up_n, H):
        if dot and (n != H or stream):
            _linear.SKINNY_TABLE[(n, H, False)] = ((32, f"d16x{H}s1w4n1"),)
        else:
            _linear.SKINNY_TABLE.pop((n, H, False), None)
    down = (H, model.args.intermediate_size, True)      # a 2-D block: the residual add fits
    if stream:
        _linear.SKINNY_TABLE[down] = ((32, "b2x4x64s1w2n3"),)
    else:
        _linear.SKINNY_TABLE.pop(down, None)
    calls.clear()
    pages = PageTable(2, 64, 4)
    cache = model.make_cache(2, 64, pages=pages)
    for slot in range(2):
        pages.resize(slot, 12)
    tokens = torch.tensor([[1], [5]]) % V
    # Features captured after every layer (layer 0's by layer 1's norm: norm_linear's copy).
    hidden, feats = model(tokens, torch.tensor([0, 5]), torch.tensor([0, 1]), cache,
                          capture=tuple(range(L)))
    out[skinny, norm, dot, glu, rope] = torch.cat([hidden, feats], dim=-1).float()
    if dot:      # qkv and gate-up on tl.dot after add_rms_norm, o, silu-down; the final norm
        want = {"skinny_linear": 4 * L, "tl.dot": 2 * L, "add_rms_norm": 2 * L + 1}
    elif norm:   # qkv and gate-up with their norms, o, silu-down; the final norm
        want = {"skinny_norm_linear": 2 * L, "skinny_linear": 2 * L, "add_rms_norm": 1}
    elif skinny:  # 3 GEMMs + the fused silu-down a layer: no silu_mul
        want = {"skinny_linear": 4 * L, "add_rms_norm": 2 * L + 1}
    else:
        want = {"silu_mul": L, "add_rms_norm": 2 * L + 1}
    want["rope_cache_write"] = L
    if glu:      # the same kernels, the gate-up one with the epilogue
        want["glu"] = L
    if rope and dot:    # qkv's GEMM, RoPE and the cache write as one kernel
        want.update({"skinny_linear": 3 * L, "tl.dot": L, "skinny_rope_linear": L})
        del want["rope_cache_write"]
    elif rope:          # the norm, qkv's GEMM, RoPE and the cache write as one kernel
        del want["rope_cache_write"]
    if stream:          # o and gate-up on tl.dot, gate-up's norm kernels gone, and the
        # down GEMM adds to the stream: qkv's norm kernel only where a layer's input is
        # captured (its copy; every layer but the first here), and the final norm
        want.update({"tl.dot": 2 * L, "add_rms_norm": L})
    assert calls == want, (skinny, norm, dot, glu, rope, calls)
    assert feats.abs().sum() > 0
    if stream:          # without capture: the final norm alone
        calls.clear()
        alone = model(tokens, torch.tensor([0, 5]), torch.tensor([0, 1]),
                      model.make_cache(2, 64, pages=pages))
        assert calls["add_rms_norm"] == 1, calls
        torch.testing.assert_close(alone.float(), hidden.float(), rtol=2e-2, atol=2e-2)
        # Only the first layer's output captured: the down GEMM before a captured layer
        # leaves its output to that layer's norm kernel (which stores the copy), the last
        # layer's to the final norm; the others add it to the stream themselves.
        calls.clear()
        first = model(tokens, torch.tensor([0, 5]), torch.tensor([0, 1]),
                      model.make_cache(2, 64, pages=pages), capture=(0,))
        assert calls["add_rms_norm"] == 2, calls
        torch.testing.assert_close(first[1].float(), feats[..., :H].float(), rtol=2e-2,
                                   atol=2e-2)
for key in ((True, False, False), (True, True, False), (True, True, True)):
    torch.testing.assert_close(out[key + (False, False)], out[False, False, False, False, False],
                               rtol=2e-2, atol=2e-2)
    assert torch.equal(out[key + (True, False)], out[key + (False, False)]), key
for dot in (False, True):
    assert torch.equal(out[True, True, dot, True, True], out[True, True, dot, True, False])
torch.testing.assert_close(out[True, True, True, True, "stream"],
                           out[False, False, False, False, False], rtol=2e-2, atol=2e-2)
print("ok")
"""


GLU_CHILD = REFUSED_SOURCE + r"""
import torch
from specloop.models import _kernels
from specloop.models._skinny import SkinnyConfig, glu_fits, skinny_linear, skinny_norm_linear

torch.manual_seed(0)
# fp16: the interpreter's bf16 add of the norm's delta is not the GPU's. I = 20 (was 48;
# each program is slow to interpret): every config still has several programs along I, and
# the tl.dot ones (8 and 16 output columns a program) now also end in a partial tile of
# (gate, up) pairs, which 48 never did. K = 64 as before: BLOCK_K 64 is one pass (no
# PIECE: K fills the tile), BLOCK_K 32 a loop.
K, I = 64, 20
w = (torch.randn(2 * I, K) * 0.2).half()
wd = (torch.randn(K, I) * 0.2).half()
nw = (1 + 0.1 * torch.randn(K)).half()
configs = [SkinnyConfig(False, 4, 64, num_warps=2),                  # rows one by one
           SkinnyConfig(False, 2, 64, tile_m=2, num_warps=2),          # one reduction
           SkinnyConfig(True, 16, 64, num_warps=4),                    # one pass
           SkinnyConfig(True, 32, 32, num_warps=4, num_stages=2)]     # K in a loop
# The down GEMM (N = K = 64): 8 columns a program (was 4), half the programs; which
# config does not matter to the check (the same one with and without the prologue).
down = SkinnyConfig(False, 8, 64, tile_m=2, num_warps=2)
for rows in (1, 5):
    x, d = torch.randn(rows, K).half(), torch.randn(rows, K).half()
    for c in configs:
        gate_up = skinny_linear(x, w, None, c)
        act = skinny_linear(x, w, None, c, glu=True)
        assert torch.equal(act, _kernels.silu_mul(gate_up)), (rows, c.tag())
        if not c.dot:       # the norm prologue, then the epilogue; the stream unchanged
            g2, s2 = skinny_norm_linear(x, d, nw, 1e-5, w, None, c)
            a2, s3 = skinny_norm_linear(x, d, nw, 1e-5, w, None, c, glu=True)
            assert torch.equal(a2, _kernels.silu_mul(g2)) and torch.equal(s2, s3), c.tag()
        # The down GEMM on the activation equals it with the silu prologue.
        assert torch.equal(skinny_linear(act, wd, None, down),
                           skinny_linear(gate_up, wd, None, down, silu_mul=True)), c.tag()
# Configurations that cannot hold whole (gate, up) pairs, or split K, are refused.
for c in (SkinnyConfig(False, 1, 64), SkinnyConfig(False, 4, 32),
          SkinnyConfig(True, 16, 32, split_k=2)):
    assert not glu_fits(c, K), c.tag()
    refused(lambda: skinny_linear(x, w, None, c, glu=True), "glu", c.tag())
print("ok")
"""


ROPE_CHILD = REFUSED_SOURCE + r"""
import torch
from specloop.models import _kernels
from specloop.models._skinny import (RopeWrite, SkinnyConfig, one_pass_piece, rope_fits,
                                     skinny_linear, skinny_norm_linear, skinny_rope_linear)

torch.manual_seed(0)
# fp16 (the interpreter's bf16 products are not the GPU's). 3 q heads and 1 kv head of
# D = 16; pages of 4 positions, 3 slots of 6 pages, max_seq_len 20 (positions past it go to
# the scratch page); both requests' rows cross page boundaries.
HQ, HKV, D, P, S = 3, 1, 16, 4, 20
N = (HQ + 2 * HKV) * D
cos = torch.randn(40, D).float()
sin = torch.randn(40, D).float()
table = torch.randperm(18).to(torch.int32).view(3, 6)
scratch = 18


def same_as_rope_kernel(epilogue, apart, starts, slots, pos_offset, tree, where):
    # epilogue(rope) and apart(rope) (the product, then rope_cache_write) -> (q, ...) on
    # copies of one random cache: every output and both caches bit for bit.
    kc0 = torch.randn(19, P, HKV, D).half()
    vc0 = torch.randn(19, P, HKV, D).half()
    outs = []
    for run in (apart, epilogue):
        kc, vc = kc0.clone(), vc0.clone()
        outs.append(tuple(run(RopeWrite(torch.tensor(starts), torch.tensor(slots), table, S,
                                        scratch, cos, sin, kc, vc, HQ, pos_offset, tree)))
                    + (kc, vc))
    for u, v in zip(*outs):
        assert torch.equal(u, v), where
    q, kc, vc = outs[1][0], outs[1][-2], outs[1][-1]
    assert q.shape[-2:] == (HQ, D), where
    assert not torch.equal(kc, kc0) and not torch.equal(vc, vc0), where


for K, bk in ((48, 64), (64, 64)):    # K = 48 in BLOCK_K 64: two tiles (PIECE 16); 64: one
    cfg = SkinnyConfig(True, D, bk, num_warps=4, num_stages=1)
    assert rope_fits(cfg, K, D) and bool(one_pass_piece(cfg, K)) == (K == 48)
    w = (torch.randn(N, K) * 0.2).half()
    bias = torch.randn(N).half()
    for T, starts, tree, b in ((5, [3, 14], None, None), (9, [0, 17], None, bias),
                               (17, [2, 1], torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 4,
                                                          4, 4, 5, 5, 6]), None)):
        x = torch.randn(2, T, K).half()
        same_as_rope_kernel(
            lambda rope: (skinny_rope_linear(x, w, b, cfg, rope),),
            lambda rope: (_kernels.rope_cache_write(skinny_linear(x, w, b, cfg), *rope),),
            starts, [2, 0], 1, tree, (K, T, tree is not None, b is not None))
# With the norm in the prologue too (broadcast configs: rows one by one, and one reduction
# over 2 rows), pairs of one head a program: q, caches, the stream and its copy as the norm
# GEMM then the rope kernel.
K = 64
w = (torch.randn(N, K) * 0.2).half()
nw = (1 + 0.1 * torch.randn(K)).half()


def norm_then_rope(x, d, b, cfg, rope):
    copy = torch.zeros(*x.shape[:-1], 2 * K).half()[..., K:]
    qkv, stream = skinny_norm_linear(x, d, nw, 1e-5, w, b, cfg, copy)
    return _kernels.rope_cache_write(qkv, *rope), stream, copy


def norm_rope(x, d, b, cfg, rope):
    copy = torch.zeros(*x.shape[:-1], 2 * K).half()[..., K:]
    return skinny_norm_linear(x, d, nw, 1e-5, w, b, cfg, copy, rope=rope) + (copy,)


for cfg in (SkinnyConfig(False, 4, 64, num_warps=2), SkinnyConfig(False, 8, 64, tile_m=2),
            SkinnyConfig(False, 2, 64, tile_m=2, num_warps=2)):
    assert rope_fits(cfg, K, D), cfg.tag()
    for T, starts, tree, b in ((1, [3, 19], None, None), (3, [2, 14], None, bias),
                               (4, [5, 0], torch.tensor([0, 1, 1, 2]), None)):
        x, d = torch.randn(2, T, K).half(), torch.randn(2, T, K).half()
        same_as_rope_kernel(lambda rope: norm_rope(x, d, b, cfg, rope),
                            lambda rope: norm_then_rope(x, d, b, cfg, rope),
                            starts, [1, 2], 0, tree, (cfg.tag(), T, tree is not None))
# Not one head (or pairs of one) a program, split K, a one-tile tl.dot in the norm form, or
# a broadcast config without the norm form: refused.
cache = torch.zeros(19, P, HKV, D).half()
any_rope = RopeWrite(torch.tensor([0]), torch.tensor([0]), table, S, scratch, cos, sin, cache,
                     cache, HQ)
for c in (SkinnyConfig(False, 3, 64), SkinnyConfig(False, 32, 64)):
    assert not rope_fits(c, 64, D), c.tag()
refused(lambda: skinny_norm_linear(torch.zeros(1, 1, 64).half(), None, nw, 1e-5, w, None,
                                   SkinnyConfig(False, 32, 64), rope=any_rope),
        "rope", "a 32-column program of 16-dim heads")
for c in (SkinnyConfig(True, 32, 64), SkinnyConfig(True, D, 32, split_k=2),
          SkinnyConfig(False, D, 64)):
    assert not rope_fits(c, 64, D) or not c.dot, c.tag()
    refused(lambda: skinny_rope_linear(torch.zeros(1, 1, 64).half(),
                                       torch.zeros(N, 64).half(), None, c, any_rope),
            "skinny_rope_linear", c.tag())
# The one-tile tl.dot over part of a head a program (pairs of it: D / BLOCK_N programs a
# head, more programs for the same W): heads of D = 32 (same_as_rope_kernel reads these
# names), BLOCK_N 16 and 32, the norm in the prologue and K in two slices too.
D = 32
N = (HQ + 2 * HKV) * D
cos = torch.randn(40, D).float()
sin = torch.randn(40, D).float()
K = 48
w = (torch.randn(N, K) * 0.2).half()
nw = (1 + 0.1 * torch.randn(K)).half()
bias = torch.randn(N).half()
for cfg in (SkinnyConfig(True, 16, 64, num_warps=4, num_stages=1),
            SkinnyConfig(True, 32, 64, num_warps=4, num_stages=1),
            SkinnyConfig(True, 16, 64, num_warps=4, num_stages=1, slices=2)):
    assert rope_fits(cfg, K, D), cfg.tag()
    for T, starts, tree, b, norm in ((5, [3, 14], None, bias, None),
                                     (6, [2, 1], torch.tensor([0, 1, 1, 2, 2, 3]), None,
                                      (nw, 1e-5))):
        x = torch.randn(2, T, K).half()
        same_as_rope_kernel(
            lambda rope: (skinny_rope_linear(x, w, b, cfg, rope, norm=norm),),
            lambda rope: (_kernels.rope_cache_write(skinny_linear(x, w, b, cfg, norm=norm),
                                                    *rope),),
            starts, [2, 0], 1, tree, (cfg.tag(), T, tree is not None))
        # The first layer's lookup in the kernel (``gather``): rows of an embedding table
        # by token, written into the stream too; its content on entry not read.
        if norm is not None:
            emb = torch.randn(23, K).half()
            tok = torch.randint(0, 23, (2, T))
            stream = torch.full((2, T, K), float("nan")).half()
            same_as_rope_kernel(
                lambda rope: (skinny_rope_linear(stream, w, b, cfg, rope, norm=norm,
                                                 gather=(tok, emb)), stream),
                lambda rope: (skinny_rope_linear(emb[tok], w, b, cfg, rope, norm=norm),
                              emb[tok]),
                starts, [2, 0], 1, tree, (cfg.tag(), T, "gather"))
refused(lambda: skinny_rope_linear(torch.zeros(2, 3, K).half(), w, None, cfg, any_rope,
                                   norm=(nw, 1e-5), gather=(torch.zeros(2, 4).long(),
                                                            torch.zeros(9, K).half())),
        "gather tokens (2, 4)", "x (2, 3, 48)")
print("ok")
"""


@pytest.mark.xdist_group("interpreted")   # one interpreter server (tests/interpreted.py)
@pytest.mark.skipif(not _linear._skinny.available(), reason="needs Triton")
def test_rope_epilogue_equals_gemm_then_rope_kernel_interpreted():
    """RoPE and the K/V cache write in the qkv GEMM's epilogue (``skinny_rope_linear``):
    q and both caches bit for bit ``skinny_linear`` then ``_kernels.rope_cache_write``
    (fp16, Triton's interpreter), for K in two tiles and in one, 5 / 9 / 17 rows a request
    (17: two row blocks), two requests whose rows cross page boundaries and run past
    max_seq_len (the scratch page), a bias, and a draft tree's rows rotated at their
    depths; with the RMSNorm in the prologue too (``skinny_norm_linear(rope=...)``,
    broadcast configurations of pairs of one head a program, rows one by one and in one
    reduction: the stream and its copy too); the one-tile tl.dot over pairs of part of a
    head a program (BLOCK_N 16 of heads of 32), in slices and with the norm too;
    configurations that are not one head (or pairs of one) a program are refused."""
    run_interpreted(ROPE_CHILD)


STREAM_CHILD = REFUSED_SOURCE + r"""
import torch
from specloop.models import _kernels, _linear, _skinny
from specloop.models._linear import PackedLinear
from specloop.models._skinny import (RopeWrite, SkinnyConfig, norm_prologue_fits,
                                     residual_fits, skinny_linear, skinny_rope_linear)

calls = []      # the dispatcher's skinny_linear calls: which of residual / norm each took


def counted(*a, **k):
    calls.append(sorted(n for n in ("residual", "norm") if k.get(n) is not None))
    return skinny_linear(*a, **k)


_skinny.skinny_linear = counted
torch.manual_seed(0)
# fp16 (the interpreter's bf16 products are not the GPU's). H = 48 as 32 + 16 (two tiles,
# PIECE 16) in BLOCK_K 64, or one tile of 64 (BLOCK_K 64 with H = 64).
for H, I in ((48, 24), (64, 16)):
    x, o = torch.randn(9, H).half(), torch.randn(9, H).half()
    wo = (torch.randn(H, H) * 0.2).half()
    wgu = (torch.randn(2 * I, H) * 0.2).half()
    nw = (1 + 0.1 * torch.randn(H)).half()
    # The residual add in the epilogue: add_rms_norm's stream, bit for bit (a 2-D block
    # of the one-reduction family, and the one-tile tl.dot).
    for c in (SkinnyConfig(False, 4, 64, tile_m=2, num_warps=2),
              SkinnyConfig(True, 16, 64, num_warps=4, num_stages=1)):
        assert residual_fits(c, H), c.tag()
        for m in (1, 5, 9):
            y = skinny_linear(o[:m], wo, None, c, residual=x[:m])
            want = _kernels.add_rms_norm(x[:m], skinny_linear(o[:m], wo, None, c), nw, 1e-5)[1]
            assert torch.equal(y, want), (H, c.tag(), m)
    # The norm in the one-tile tl.dot's prologue (with SwiGLU): within fp16 rounding of
    # add_rms_norm then the GEMM; a row's bits whatever the rows in the call.
    c = SkinnyConfig(True, 16, 64, num_warps=4, num_stages=1)
    assert norm_prologue_fits(c, H)
    act = skinny_linear(x, wgu, None, c, glu=True, norm=(nw, 1e-5))
    h = _kernels.add_rms_norm(x, None, nw, 1e-5)[0]
    want = skinny_linear(h, wgu, None, c, glu=True)
    torch.testing.assert_close(act.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert (act != want).float().mean() < 0.2          # mostly the same bits
    for m in (1, 4):
        assert torch.equal(skinny_linear(x[:m], wgu, None, c, glu=True, norm=(nw, 1e-5)),
                           act[:m]), (H, m)
    # out_norm_mlp: the stream as norm_mlp's, the MLP within its rounding (the dispatcher's
    # calls counted; the table's entries and the wrapper end with this child process).
    wd = (torch.randn(H, I) * 0.2).half()
    _linear.SKINNY_TABLE.update({(H, H, False): ((16, "d16x64s1w4n1"),),
                                 (2 * I, H, False): ((16, "d16x64s1w4n1"),),
                                 (H, I, True): ((16, "b2x4x64s1w2n3"),)})
    for stream_norm in (True, False):
        lin = PackedLinear(skinny=True)
        lin.skinny_on_cpu, lin.stream_norm, lin.skinny_norm = True, stream_norm, True
        calls.clear()
        mlp, stream = lin.out_norm_mlp(x[:5], o[:5], wo, nw, 1e-5, wgu, wd,
                                       feeds_stream=stream_norm)
        if stream_norm:      # o, gate-up and (a b-family config) down fused
            assert calls == [["residual"], ["norm"], ["residual"]], calls
            assert mlp is None
            fused = stream
        else:
            assert all(c == [] for c in calls), calls
            torch.testing.assert_close(fused.float(),
                                       _kernels.add_rms_norm(stream, mlp, nw, 1e-5)[1].float(),
                                       rtol=2e-2, atol=2e-2)
    # o on a b-family config: o and gate-up fuse only with mlp_stream_b, and only where
    # the down GEMM feeds the next qkv; the stream as before within rounding. (H = 64:
    # there gate-up's shape [32, 64] is not o's.)
    _linear.SKINNY_TABLE[(H, H, False)] = ((16, "b2x4x64s1w2n3"),)
    cases = ((False, True, [[], [], ["residual"]]), (True, False, [[], [], []]),
             (True, True, [["residual"], ["norm"], ["residual"]])) if 2 * I != H else ()
    for b_rows, feeds, want in cases:
        lin = PackedLinear(skinny=True)
        lin.skinny_on_cpu, lin.stream_norm, lin.skinny_norm = True, True, True
        lin.mlp_stream_b = b_rows
        calls.clear()
        mlp, stream = lin.out_norm_mlp(x[:5], o[:5], wo, nw, 1e-5, wgu, wd,
                                       feeds_stream=feeds)
        assert calls == want, (b_rows, feeds, calls)
        after = stream if mlp is None else _kernels.add_rms_norm(stream, mlp, nw, 1e-5)[1]
        torch.testing.assert_close(after.float(), fused.float(), rtol=2e-2, atol=2e-2)
# qkv's norm in the RoPE kernel's prologue: add_rms_norm then the kernel, within rounding.
HQ, HKV, D = 2, 1, 16
wq = (torch.randn((HQ + 2 * HKV) * D, 64) * 0.2).half()
nw = (1 + 0.1 * torch.randn(64)).half()
xq = torch.randn(1, 5, 64).half()
cos, sin = torch.randn(40, D).float(), torch.randn(40, D).float()
c = SkinnyConfig(True, D, 64, num_warps=4, num_stages=1)
qs = []
for norm in (True, False):
    kc, vc = torch.zeros(4, 16, HKV, D).half(), torch.zeros(4, 16, HKV, D).half()
    rope = RopeWrite(torch.tensor([3]), torch.tensor([0]), torch.arange(4, dtype=torch.int32)
                     .view(1, 4), 32, 3, cos, sin, kc, vc, HQ)
    h = xq if norm else _kernels.add_rms_norm(xq, None, nw, 1e-5)[0]
    qs.append((skinny_rope_linear(h, wq, None, c, rope, norm=(nw, 1e-5) if norm else None),
               kc, vc))
for u, v in zip(*qs):
    torch.testing.assert_close(u.float(), v.float(), rtol=2e-2, atol=2e-2)
    assert u.abs().sum() > 0
# Split K, or the broadcast row path (no 2-D block): no residual add; a looped tl.dot or a
# broadcast config: no norm prologue.
for c in (SkinnyConfig(True, 16, 32, split_k=2), SkinnyConfig(False, 4, 64)):
    assert not residual_fits(c, 64), c.tag()
    refused(lambda: skinny_linear(x, wo, None, c, residual=x), "residual", c.tag())
for c in (SkinnyConfig(True, 16, 32), SkinnyConfig(False, 4, 64, tile_m=2)):
    assert not norm_prologue_fits(c, 64), c.tag()
print("ok")
"""


@pytest.mark.xdist_group("interpreted")   # one interpreter server (tests/interpreted.py)
@pytest.mark.skipif(not _linear._skinny.available(), reason="needs Triton")
def test_stream_norm_epilogue_and_prologue_interpreted():
    """``stream_norm`` (``SPECLOOP_SKINNY_STREAM_NORM=1``): the residual add in a GEMM's
    epilogue gives add_rms_norm's stream bit for bit (one-reduction and one-tile tl.dot
    blocks, 1 / 5 / 9 rows, K in two tiles and one); the RMSNorm of a stream in the
    one-tile tl.dot's prologue (with SwiGLU) is add_rms_norm then the GEMM within fp16
    rounding, a row's bits whatever the rows in the call, in the RoPE kernel too;
    ``out_norm_mlp`` takes them where the table allows (o, gate-up and down fused: the
    stream after the MLP within rounding of ``norm_mlp``'s); configurations that cannot
    take them are refused (fp16, Triton's interpreter)."""
    run_interpreted(STREAM_CHILD)


@pytest.mark.xdist_group("interpreted")   # one interpreter server (tests/interpreted.py)
@pytest.mark.skipif(not _linear._skinny.available(), reason="needs Triton")
def test_glu_epilogue_is_silu_mul_of_the_product_interpreted():
    """SwiGLU in the gate-up GEMM's epilogue (``glu``): for the broadcast, one-reduction
    and tl.dot (one pass and looped) paths, and after the norm prologue, the output is
    ``_kernels.silu_mul`` of the plain product bit for bit (fp16, Triton's interpreter),
    and the down GEMM on it equals the down GEMM with the silu prologue on the product;
    configurations that cannot take it are refused."""
    run_interpreted(GLU_CHILD)


@pytest.fixture(scope="module")
def narrow_llama(tmp_path_factory):
    """tiny_dirs' llama with an MLP of 48 (not 128): the gate-up GEMM's N 96 (not 256) is 12
    programs of the dispatcher's default BLOCK_N 8 (not 32, each slow to interpret); its
    and the down GEMM's configs are of the same families (no tl.dot, K in one pass), and
    qkv, o and the layer's structure are unchanged."""
    from specloop.models.testing import write_tiny_checkpoint
    return write_tiny_checkpoint(tmp_path_factory.mktemp("narrow") / "llama",
                                 family="llama", intermediate=48)


@pytest.mark.xdist_group("interpreted")   # one interpreter server (tests/interpreted.py)
@pytest.mark.skipif(not _linear._skinny.available(), reason="needs Triton")
def test_fused_layer_on_skinny_kernel_interpreted(narrow_llama):
    """The fused decoder layer through the dispatcher's skinny path (fp16, CPU, Triton's
    interpreter): the GEMMs run on the kernel, silu_mul does not, with ``skinny_norm`` the
    layer's two norm kernels do not either, and the hidden states and captured features
    match the cuBLAS-shaped path's (F.linear + silu_mul + add_rms_norm) within fp16
    rounding. Also with the shipped table's form for qkv and gate-up from 2 rows (one-tile
    tl.dot: add_rms_norm before them, no prologue, ``skinny_norm`` on). Each also with
    ``glu`` (SwiGLU in the gate-up GEMM's epilogue, ``norm_mlp``): the same kernels, the
    same bits; and with RoPE + the cache write in the qkv GEMM's epilogue
    (``norm_linear_rope``, after the norm prologue or on the one-tile tl.dot): one
    kernel fewer a layer, the same bits; and with ``stream_norm`` (o on tl.dot with the
    residual add, gate-up's norm in its prologue): one more fewer, within fp16 rounding. (``logits`` makes the
    same dispatcher call; the GPU tests cover it.)"""
    run_interpreted(LAYER_CHILD, str(narrow_llama))


def test_stream_modes_name_the_fusions_and_refuse_others(monkeypatch):
    """SPECLOOP_SKINNY_STREAM_NORM: 0 / 1 / a list of qkv, mlp, mlp-b set (qkv_stream,
    mlp_stream, mlp_stream_b) on every new dispatcher (``stream_norm`` sets the first
    two); any other value is refused by name."""
    M = _linear.StreamModes
    assert _linear.stream_modes("0") == M()
    assert _linear.stream_modes("qkv") == M(qkv=True)
    assert _linear.stream_modes(" MLP ") == M(mlp=True)
    assert _linear.stream_modes("1") == _linear.stream_modes("qkv, mlp") == M(True, True)
    assert _linear.stream_modes("qkv,mlp-b") == M(True, True, True)
    for bad in ("yes", "qkv,o", "2"):
        with pytest.raises(ValueError, match=f"SPECLOOP_SKINNY_STREAM_NORM='{bad}'"):
            _linear.stream_modes(bad)
    monkeypatch.setattr(_linear, "skinny_available", lambda: True)
    monkeypatch.setenv("SPECLOOP_SKINNY_STREAM_NORM", "mlp")
    lin = PackedLinear()
    assert (lin.qkv_stream, lin.mlp_stream, lin.stream_norm) == (False, True, False)
    lin.stream_norm = True
    assert (lin.qkv_stream, lin.mlp_stream, lin.mlp_stream_b) == (True, True, False)
    assert not PackedLinear(skinny=False).mlp_stream     # cuBLAS: nothing to fuse into
    monkeypatch.delenv("SPECLOOP_SKINNY_STREAM_NORM")
    assert PackedLinear().stream_norm == (_linear.STREAM_NORM_DEFAULT == "1")


def test_table_tags_parse_and_round_trip():
    _linear.check_table(SKINNY_TABLE)
    for (n, k, _), entry in SKINNY_TABLE.items():
        assert n > 0 and k > 0
        for max_rows, tag in entry or ():
            cfg = parse_config(tag)
            assert cfg.tag() == tag
            assert 1 <= max_rows <= (DOT_MAX_ROWS if cfg.dot else SKINNY_MAX_ROWS)
            assert not cfg.dot or min(cfg.block_n, cfg.block_k) >= 16
    for tag, cfg in (("b4x2x1024s1w4n3", SkinnyConfig(False, 2, 1024, 1, 4, 3, tile_m=4)),
                     ("b8x1x2048s2w8n2", SkinnyConfig(False, 1, 2048, 2, 8, 2, tile_m=8)),
                     ("v2x1024s1w4n3", SkinnyConfig(False, 2, 1024, 1, 4, 3))):
        assert parse_config(tag) == cfg and cfg.tag() == tag
        assert cfg.block_m(1) == (cfg.tile_m or 1) and cfg.block_m(32) == (cfg.tile_m or 8)
    # tl.dot: blocks of 16 rows, or of ``m`` rows (a power of two >= 16).
    for tag, cfg in (("d64x1024s1w8n1", SkinnyConfig(True, 64, 1024, 1, 8, 1)),
                     ("d64x1024s1w8n1m64", SkinnyConfig(True, 64, 1024, 1, 8, 1, tile_m=64))):
        assert parse_config(tag) == cfg and cfg.tag() == tag
        assert cfg.block_m(1) == cfg.block_m(200) == (cfg.tile_m or 16)
    for bad in ("d16x128", "b0x2x1024s1w4n3", "b4x1024s1w4n3", "bx4x2x1024s1w4n3",
                "d64x1024s1w8n1m8", "d64x1024s1w8n1m48", "v4x1024s1w4n3m64",
                "b4x2x1024s1w4n3m32"):
        with pytest.raises(ValueError):
            parse_config(bad)


def test_skinny_config_row_ranges_and_window(monkeypatch):
    """Rows r run the first range with r <= its max rows (F.linear above the last);
    default_config for shapes not listed; with ``norm`` (norm_linear's fused RMSNorm) only
    for rows in the prefix (the ranges without tl.dot), where every prefix configuration
    is norm-fusable."""
    v, b2, b4 = "v8x64s1w4n3", "b2x2x64s1w4n3", "b4x4x64s1w4n3"
    monkeypatch.setitem(SKINNY_TABLE, (100, 50, False), ((1, v), (4, b2), (8, b4)))
    monkeypatch.setitem(SKINNY_TABLE, (100, 60, False), None)
    monkeypatch.setitem(SKINNY_TABLE, (100, 70, False), ((2, v), (16, "d16x64s1w4n3")))
    monkeypatch.setitem(SKINNY_TABLE, (100, 64, False), ((1, v), (2, b2), (16, "d16x64s1w4n3")))
    monkeypatch.setitem(SKINNY_TABLE, (100, 40, False), ((16, "d16x64s1w4n3"),))
    want = {1: v, 2: b2, 3: b2, 4: b2, 5: b4, 6: b4, 7: b4, 8: b4}
    for rows, tag in want.items():
        assert skinny_config(rows, 100, 50) == parse_config(tag), rows
        assert skinny_config(rows, 100, 50, norm=True) == parse_config(tag), rows
    assert skinny_config(9, 100, 50) is None                  # beyond the last range
    assert skinny_config(9, 100, 50, norm=True) is None
    assert all(skinny_config(r, 100, 60) is None for r in (1, 4, 32))   # cuBLAS
    # A tl.dot tail (F.linear's bits) after a prefix: the norm is fused for the prefix's
    # rows where all of the prefix is fusable (K = 64); a prefix whose BLOCK_K 64 does not
    # cover K = 70 fuses none; the tail's rows and those above take the separate norm
    # kernel and the tail's plain GEMM (or F.linear); tl.dot ranges alone: never fused.
    assert skinny_config(2, 100, 70) == parse_config(v)
    assert skinny_config(3, 100, 70) == parse_config("d16x64s1w4n3")
    assert skinny_config(17, 100, 70) is None
    assert all(skinny_config(r, 100, 70, norm=True) is None for r in (1, 2, 3, 16))
    for rows, tag, fused in ((1, v, True), (2, b2, True), (3, "d16x64s1w4n3", False),
                             (16, "d16x64s1w4n3", False), (17, None, False)):
        want_cfg = parse_config(tag) if tag else None
        assert skinny_config(rows, 100, 64) == want_cfg, rows
        assert skinny_config(rows, 100, 64, norm=True) == (want_cfg if fused else None), rows
    assert skinny_config(1, 100, 40) == parse_config("d16x64s1w4n3")
    assert all(skinny_config(r, 100, 40, norm=True) is None for r in (1, 16, 17))
    assert skinny_config(2, 100, 50, silu_mul=True) == default_config(100, 50)
    assert skinny_config(SKINNY_MAX_ROWS, 64, 64) == default_config(64, 64)
    assert skinny_config(SKINNY_MAX_ROWS, 64, 64, norm=True) == default_config(64, 64)
    assert skinny_config(SKINNY_MAX_ROWS + 1, 64, 64) is None
    # A tl.dot tail may reach DOT_MAX_ROWS (VERIFY's rows at batch 32-64); the default
    # guess and the broadcast ranges stop at SKINNY_MAX_ROWS.
    monkeypatch.setitem(SKINNY_TABLE, (100, 80, False),
                        ((1, v), (DOT_MAX_ROWS, "d16x128s1w4n3")))
    for rows in (2, SKINNY_MAX_ROWS + 1, 128, DOT_MAX_ROWS):
        assert skinny_config(rows, 100, 80) == parse_config("d16x128s1w4n3"), rows
        assert skinny_config(rows, 100, 80, norm=True) is None, rows
    assert skinny_config(DOT_MAX_ROWS + 1, 100, 80) is None
    assert skinny_config(0, 64, 64) is None
    assert skinny_config(0, 100, 50) is None
    for n, k in ((576, 576), (49152, 576), (64, 1536), (576, 3000)):
        cfg = default_config(n, k)
        # One pass over K, the tile of W within ~64 fp32 a thread.
        assert not cfg.dot and cfg.split_k == 1 and cfg.block_k >= k
        assert cfg.block_n * cfg.block_k <= 64 * 32 * cfg.num_warps


@pytest.mark.parametrize("entry", [
    ((4, "v8x64s1w4n3"), (2, "b2x2x64s1w4n3")),          # not ascending
    ((2, "v8x64s1w4n3"), (2, "b2x2x64s1w4n3")),          # not strictly
    ((0, "v8x64s1w4n3"),),                                # no rows
    ((SKINNY_MAX_ROWS + 1, "v8x64s1w4n3"),),              # past the kernel's window
    ((1, "v8x64s1w4n3"), (SKINNY_MAX_ROWS + 1, "b2x2x64s1w4n3")),   # past it, no tl.dot
    ((DOT_MAX_ROWS + 1, "d16x64s1w4n3"),),                # past the tl.dot tail's
    ((4, "v8x64"),),                                      # a tag that does not parse
    (("v8x64s1w4n3", 4),),                                # (tag, rows): the wrong order
    ((1, "d16x64s1w4n3"), (4, "v8x64s1w4n3")),            # no tl.dot after tl.dot
    ((1, "v8x64s1w4n3"), (2, "d16x64s1w4n3"), (4, "b2x2x64s1w4n3")),
    ((True, "v8x64s1w4n3"),),
    ("v8x64s1w4n3", 4),                                   # the old one-config form
    (),
    [[4, "v8x64s1w4n3"]],                                 # lists
    ((1, "v8x64s1w4n3"), (4, "d16x64s1w4n1"), (8, "d16x64s1w4n1k2")),   # sliced after
    ((1, "v8x64s1w4n3"), (4, "d16x64s1w4n1k2"), (8, "d16x64s1w4n1k4")),  # two slicings
])
def test_malformed_table_entries_raise(monkeypatch, entry):
    monkeypatch.setitem(SKINNY_TABLE, (100, 50, False), entry)
    with pytest.raises(ValueError):
        skinny_config(1, 100, 50)
    with pytest.raises(ValueError):
        _linear.check_table({(100, 50, False): entry})


def test_sliced_ranges_one_class_after_the_prefix():
    """The tail's sliced ranges (``k<n>``) may differ in BLOCK_N, warps and row blocks,
    not in where their slices start (``slice_edges``: the same order of sums), and come
    before the unsliced ranges; K = 576's d64 and d128 tiles in two slices agree."""
    from specloop.models import _skinny
    assert _skinny.slice_edges(parse_config("d64x1024s1w8n1k2"), 576) == (0, 256, 512)
    assert _skinny.slice_edges(parse_config("d128x1024s1w8n1m32k2"), 576) == (0, 256, 512)
    assert _skinny.slice_edges(parse_config("d32x2048s1w8n1k2"), 1536) == (0, 512, 1024)
    assert _skinny.slice_edges(parse_config("d64x1024s1w8n1"), 576) == ()
    assert _skinny.slice_edges(parse_config("d64x1024s1w8n1k4"), 576) == (0, 128, 256, 384,
                                                                          512)
    _linear.check_table({(960, 576, False): (
        (4, "b2x4x1024s1w2n3"), (16, "d64x1024s1w8n1k2"), (32, "d128x1024s1w8n1m32k2"),
        (64, "d128x1024s1w8n1"))})
    for (n, k, silu), entry in SKINNY_TABLE.items():    # the shipped table's slicings
        for max_rows, tag in entry or ():
            assert parse_config(tag).slices == 1 or max_rows <= 32, (n, k, silu, tag)


def test_check_table_is_not_fooled_by_the_resolve_cache():
    """check_table checks every entry itself: the dispatcher's cache of resolved entries
    keys (1, tag) and (True, tag) alike, so a malformed entry equal to one resolved before
    was let through."""
    _linear._resolve(((1, "v8x64s1w4n3"),), 50)
    with pytest.raises(ValueError):
        _linear.check_table({(100, 50, False): ((True, "v8x64s1w4n3"),)})


def test_norm_linear_fuses_only_where_every_range_is_fusable(monkeypatch):
    """PackedLinear.norm_linear: the RMSNorm in the GEMM's prologue, by the range's
    configuration, for rows in the shape's prefix (its ranges without tl.dot) where every
    prefix configuration is norm-fusable; rows in a tl.dot tail (F.linear's bits) take
    add_rms_norm then the tail's GEMM, as F.linear's would; a prefix with a configuration
    that is not fusable takes add_rms_norm then its own ranges for all of its rows (so no
    row's bits depend on its range); tl.dot ranges alone are never fused; beyond the last
    range add_rms_norm and F.linear. (The kernels are stand-ins: this is the dispatch.)"""
    from specloop.models import _kernels
    calls: list = []

    def fused(x, d, nw, eps, w, b, cfg, capture=None):
        calls.append(("fused", cfg.tag()))
        return F.linear(x, w, b), x

    def gemm(x, w, b, cfg, silu_mul=False):
        calls.append(("gemm", cfg.tag()))
        return F.linear(x, w, b)

    def norm(x, d, nw, eps, capture=None):
        calls.append(("norm",))
        return x, x
    monkeypatch.setattr(_linear._skinny, "skinny_norm_linear", fused)
    monkeypatch.setattr(_linear._skinny, "skinny_linear", gemm)
    monkeypatch.setattr(_kernels, "add_rms_norm", norm)
    v64, b64, d64 = "v2x64s1w4n3", "b2x2x64s1w4n3", "d16x64s1w4n3"
    v32, d32 = "v2x32s1w4n3", "d16x32s1w4n3"
    monkeypatch.setitem(SKINNY_TABLE, (24, 64, False), ((1, v64), (4, b64)))
    monkeypatch.setitem(SKINNY_TABLE, (24, 32, False), ((1, v32), (2, b64), (4, d32),
                                                        (8, "d32x32s1w4n1")))
    monkeypatch.setitem(SKINNY_TABLE, (24, 48, False), ((1, v32), (4, d64)))  # 32 < K
    monkeypatch.setitem(SKINNY_TABLE, (24, 16, False), ((4, d32),))
    lin = PackedLinear(skinny=True)
    lin.skinny_on_cpu = lin.skinny_norm = True
    for k, rows, want in ((64, 1, [("fused", v64)]), (64, 2, [("fused", b64)]),
                          (64, 4, [("fused", b64)]), (64, 5, [("norm",)]),
                          # prefix v, b fused; tail d32 / d32x32 after add_rms_norm
                          (32, 1, [("fused", v32)]), (32, 2, [("fused", b64)]),
                          (32, 3, [("norm",), ("gemm", d32)]),
                          (32, 4, [("norm",), ("gemm", d32)]),
                          (32, 8, [("norm",), ("gemm", "d32x32s1w4n1")]), (32, 9, [("norm",)]),
                          (48, 1, [("norm",), ("gemm", v32)]),
                          (48, 4, [("norm",), ("gemm", d64)]), (48, 5, [("norm",)]),
                          (16, 1, [("norm",), ("gemm", d32)]), (16, 5, [("norm",)])):
        calls.clear()
        x = torch.randn(rows, k).half()
        lin.norm_linear(x, torch.zeros_like(x), torch.ones(k).half(), 1e-5,
                        torch.randn(24, k).half())
        assert calls == want, (k, rows, calls)


def test_silu_mul_prologue_only_where_its_configuration_takes_it(monkeypatch):
    """PackedLinear.silu_mul_linear (the down GEMM where norm_mlp could not put SwiGLU in
    the gate-up GEMM): the silu-mul prologue on broadcast and looped tl.dot
    configurations; on a one-tile tl.dot, which spills with it (sm_90: 31 KB a thread for
    d32x2048 at K = 1536, ``_skinny.prologue_fits``), the silu_mul kernel and then that
    configuration without the prologue (the same bits); beyond the last range silu_mul and
    the dispatcher on the activation (F.linear here). (The kernels are stand-ins: this is
    the dispatch.)"""
    from specloop.models import _kernels
    calls: list = []

    def gemm(x, w, b, cfg, silu_mul=False):
        calls.append(("gemm", cfg.tag(), silu_mul))
        k = w.shape[1]
        return F.linear(x[..., :k] if silu_mul else x, w, b)

    def silu_mul(gate_up):
        calls.append(("silu_mul",))
        return gate_up[..., :gate_up.shape[-1] // 2]
    monkeypatch.setattr(_linear._skinny, "skinny_linear", gemm)
    monkeypatch.setattr(_kernels, "silu_mul", silu_mul)
    v, one_tile, looped = "v2x32s1w4n3", "d16x32s1w4n1", "d16x16s1w4n3"
    assert _linear._skinny.prologue_fits(_linear.parse_config(looped), 32)
    assert not _linear._skinny.prologue_fits(_linear.parse_config(one_tile), 32)
    monkeypatch.setitem(SKINNY_TABLE, (24, 32, True), ((2, v), (4, one_tile), (8, looped)))
    monkeypatch.setitem(SKINNY_TABLE, (24, 32, False), None)   # the activation's: F.linear
    lin = PackedLinear(skinny=True)
    lin.skinny_on_cpu = True
    for rows, want in ((1, [("gemm", v, True)]), (2, [("gemm", v, True)]),
                       (3, [("silu_mul",), ("gemm", one_tile, False)]),
                       (4, [("silu_mul",), ("gemm", one_tile, False)]),
                       (6, [("gemm", looped, True)]), (9, [("silu_mul",)])):
        calls.clear()
        out = lin.silu_mul_linear(torch.randn(rows, 64).half(), torch.randn(24, 32).half())
        assert calls == want and out.shape == (rows, 24), (rows, calls)


def test_cpu_fp32_never_takes_the_skinny_path(monkeypatch):
    """On the CPU the dispatcher is what it was (packed for 2..32 fp32 rows, F.linear else);
    the kernel is not even asked, in any dtype."""
    def boom(*a, **k):
        raise AssertionError("skinny kernel on the CPU")
    monkeypatch.setattr(_linear._skinny, "skinny_linear", boom)
    lin = PackedLinear(skinny=True)
    w = torch.randn(48, 40)
    for rows in (1, 4, 40):
        x = torch.randn(rows, 40)
        want = F.linear(x, w)
        got = lin(x, w)
        if lin.enabled and 2 <= rows <= 32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, want)
    xb, wb = torch.randn(3, 40).bfloat16(), w.bfloat16()
    assert torch.equal(lin(xb, wb), F.linear(xb, wb))


def test_switch_and_copies(monkeypatch):
    monkeypatch.setenv("SPECLOOP_SKINNY", "0")
    assert not PackedLinear().skinny and not _linear.skinny_available()
    monkeypatch.setenv("SPECLOOP_SKINNY", "1")
    assert PackedLinear().skinny == _linear._skinny.available()
    import copy
    import pickle
    assert PackedLinear().skinny_norm == _linear._skinny.available()   # on by default
    monkeypatch.setenv("SPECLOOP_SKINNY_NORM", "0")
    assert not PackedLinear().skinny_norm
    assert not PackedLinear(skinny=False).skinny_norm
    lin = PackedLinear(skinny=False)
    lin.skinny_on_cpu = lin.skinny_norm = True
    for clone in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
        assert clone.skinny is False and clone.skinny_on_cpu is True and clone.skinny_norm


# ---- CUDA (the lead runs `pytest -m gpu`) ----------------------------------------------

# SmolLM2-135M's GEMMs and its EAGLE-3 head's (fc3, fc, the 16k draft LM head), and the
# target's LM head: (N, K, silu_mul).
SMOLLM2_SHAPES = [(960, 576, False), (576, 576, False), (3072, 576, False), (576, 1536, True),
                  (576, 1728, False), (576, 1152, False), (16384, 576, False),
                  (49152, 576, False)]


def tile_config(n: int, k: int, tile_m: int = 4, block_n: int = 2) -> SkinnyConfig:
    """A ``b`` configuration as the bench sweeps them: all of K in one pass, BLOCK_K / 256
    warps."""
    bk = min(4096, max(16, 1 << max(0, (k - 1).bit_length())))
    return SkinnyConfig(False, block_n, bk, 1, max(1, min(16, bk // 256)), tile_m=tile_m)


@pytest.mark.gpu
def test_skinny_matches_f_linear_bf16_cuda():
    """Every configuration the table (each range) or the default picks for SmolLM2's
    shapes, 1..32 rows: within bf16 rounding of F.linear (on the silu_mul kernel's output for the fused
    down), the same bits twice, and each row's bits whatever the number of rows."""
    from specloop.models import _kernels
    from specloop.models._skinny import skinny_linear

    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = [(n, k, act, cfg) for n, k, act in SMOLLM2_SHAPES
             for cfg in {skinny_config(r, n, k, act) or default_config(n, k)
                         for r in range(1, SKINNY_MAX_ROWS + 1)}]     # every range's
    # The one-reduction family too (whatever the table holds): 2, 4 and 8 rows a block.
    cases += [(n, k, act, tile_config(n, k, tile_m, bn)) for n, k, act in SMOLLM2_SHAPES
              for tile_m, bn in ((2, 4), (4, 2), (8, 1))]
    for n, k, act, cfg in cases:
        w = (torch.randn(n, k, device="cuda", generator=gen) * 0.05).bfloat16()
        bias = (torch.randn(n, device="cuda", generator=gen)).bfloat16()
        x = torch.randn(32, 2 * k if act else k, device="cuda", generator=gen).bfloat16()
        b = None if act else bias
        y32 = skinny_linear(x, w, b, cfg, silu_mul=act)
        assert torch.equal(y32, skinny_linear(x, w, b, cfg, silu_mul=act))
        ref = F.linear(_kernels.silu_mul(x) if act else x, w, b)
        torch.testing.assert_close(y32.float(), ref.float(), rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"{(n, k, act, cfg.tag())}: {m}")
        for rows in (1, 2, 3, 4, 5, 8, 9, 13, 16, 17, 31):
            y = skinny_linear(x[:rows], w, b, cfg, silu_mul=act)
            assert torch.equal(y, y32[:rows]), (n, k, act, rows, cfg.tag())


@pytest.mark.gpu
def test_table_ranges_give_a_row_the_same_bits(monkeypatch):
    """The shipped table's invariant: a shape's row ranges may run different
    configurations only if a row's bits depend on nothing but the class its call falls in:
    the prefix (the ranges without tl.dot), the sliced tl.dot ranges after it (``k<n>``,
    at most 32 rows: where the stream norm's fused sum of squares is a class of its own
    already), or the unsliced tl.dot tail above (cuBLAS's bits). Through the dispatcher,
    for every shape in the table (and the file's, under SPECLOOP_SKINNY_TABLE): calls of M
    rows in a class equal, row by row, the call of the class's most rows: the plain
    kernel, and for shapes without silu the RMSNorm path (``norm_linear``: fused where
    every prefix configuration is norm-fusable, else add_rms_norm and the same ranges);
    each call of the unsliced tail's rows equals F.linear's (on _kernels.silu_mul's output
    for silu; with the norm, add_rms_norm then F.linear), bit for bit, as if cuBLAS ran
    there, and a sliced range's does not (another summation order). On the bench's probe inputs (products
    cancelling in pairs: two summation orders differ in most outputs), so a table mixing
    bit classes fails. Then the prefix's configurations directly against each other on
    those inputs, and on the norm kernel also on ``norm_probe_rows`` (a different RMS
    summation shows only where it flips a normed element's rounding: ~6 randn rows in
    10,000, ~5% of those)."""
    from pathlib import Path

    from specloop.models import _kernels
    from specloop.models._skinny import skinny_linear, skinny_norm_linear
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    import bench_skinny_gemm as bench

    lin = PackedLinear(skinny=True)
    lin.skinny_norm = True
    checked = 0
    sliced_differ: list[bool] = []
    for (n, k, act), entry in SKINNY_TABLE.items():
        if entry is None:
            continue
        shape = _linear._resolve(entry, k)
        limit = entry[-1][0]
        group = shape.prefix or limit     # the prefix's class: rows 1..group

        def last_of(m):
            """The class of m rows' most rows: the prefix's, or the last range after it
            of the same slicing (a sliced class ends by 32 rows)."""
            if m <= group:
                return group
            top, sliced = m, skinny_config(m, n, k, act).slices > 1
            for max_rows, tag in entry:
                if max_rows >= m and (parse_config(tag).slices > 1) == sliced:
                    top = max_rows
                elif max_rows >= m:
                    break
            assert not sliced or top <= 32, (n, k, act, m)
            return top
        for x, w, nw in bench.probe_inputs(n, k, act, "cuda", torch.bfloat16, rows=limit):
            d = torch.zeros_like(x) if not act else None

            def call(m):
                if act:
                    return lin.silu_mul_linear(x[:m], w), None
                return lin(x[:m], w), lin.norm_linear(x[:m], d[:m], nw, 1e-5, w)[0]
            tops = {}
            for m in range(1, limit + 1):
                cfg = skinny_config(m, n, k, act)
                top = last_of(m)
                if top not in tops:
                    tops[top] = call(top)
                y_all, yn_all = tops[top]
                where = (n, k, act, m, cfg.tag(), group, top, limit)
                y, yn = call(m)
                assert torch.equal(y, y_all[:m]), where
                if not act and (m <= group or cfg.slices > 1):
                    assert torch.equal(yn, yn_all[:m]), ("norm",) + where
                if m > group:
                    assert cfg.dot, where
                    ref = F.linear(_kernels.silu_mul(x[:m]) if act else x[:m], w)
                    if cfg.slices == 1:         # as if cuBLAS ran there
                        assert torch.equal(y, ref), ("tail",) + where
                    else:                       # another summation order: seen below
                        sliced_differ.append(not torch.equal(y, ref))
                    if not act and cfg.slices == 1:
                        h, _ = _kernels.add_rms_norm(x[:m], d[:m], nw, 1e-5)
                        assert torch.equal(yn, F.linear(h, w)), ("tail norm",) + where
                checked += 1
        configs = sorted({cfg for m, cfg in shape.ranges if m <= group}, key=repr)
        inputs = bench.probe_inputs(n, k, act, "cuda", torch.bfloat16)
        for x, w, _ in inputs:
            ys = [skinny_linear(x, w, None, cfg, silu_mul=act) for cfg in configs]
            assert all(torch.equal(y, ys[0]) for y in ys), ("plain", n, k, act, configs)
        if not act and skinny_config(1, n, k, norm=True) is not None:
            _, w1, nw1 = bench.probe_inputs(n, k, act, "cuda", torch.bfloat16, rows=1)[0]
            inputs.append((bench.norm_probe_rows(k, bench.NORM_PROBE_ROWS,
                                                 torch.bfloat16).cuda(), w1, nw1))
            for x, w, nw in inputs:
                ys = [skinny_norm_linear(x, torch.zeros_like(x), nw, 1e-5, w, None, cfg)[0]
                      for cfg in configs]
                assert all(torch.equal(y, ys[0]) for y in ys), ("norm", n, k, configs)
    assert checked > 0
    # The sliced class is not cuBLAS's (the probe shows it in most calls)
    assert not sliced_differ or sum(sliced_differ) > len(sliced_differ) // 2, sliced_differ
    # The probe tells classes apart: 2 and 4 warps at BLOCK_K 1024 sum in different orders
    # (the H200's LM head, 8 x 49,152 randn outputs), and the pairs input shows it on qkv's
    # few outputs, in most of them (randn alone: ~1 output in 5,000).
    (_, _, _), (x, w, _) = bench.probe_inputs(960, 576, False, "cuda", torch.bfloat16)
    w2, w4 = (skinny_linear(x, w, None, parse_config(t)) for t in ("v2x1024s1w2n3",
                                                                   "v2x1024s1w4n3"))
    assert (w2 != w4).float().mean() > 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [False, True], ids=["default", "tile"])
def test_decoder_on_skinny_kernel_bf16_cuda(tiny_dirs, monkeypatch, tile):
    """The fused decoder (bf16) with the skinny path, and with the norms in the GEMMs'
    prologue too: its error against an fp32 forward is no worse than cuBLAS's (as
    test_fused_kernels_match_reference_bf16), and captured steps of 2, 4 and 8 rows (decode,
    VERIFY) replay to the eager call's bits. ``tile``: every GEMM on the one-reduction
    family (the tiny model's shapes are not in the table: default_config serves them)."""
    from specloop.models import load_model

    if tile:
        monkeypatch.setattr(_linear, "default_config", lambda n, k: tile_config(n, k))

    model = load_model(tiny_dirs["qwen2"], dtype=torch.bfloat16, device="cuda").model  # bias
    fp32 = load_model(tiny_dirs["qwen2"], dtype=torch.float32, device="cuda").model
    fp32.kernels = False
    V, B, S = model.args.vocab_size, 2, 64
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, V, (B, 9), generator=gen).cuda()
    slots = torch.arange(B, device="cuda")
    zeros = torch.zeros(B, dtype=torch.long, device="cuda")

    def logits(m, tokens, start, cache):
        return m.logits(m(tokens, start, slots, cache, kv_len=S))

    for T in (1, 2, 4):
        tokens = torch.randint(0, V, (B, T), generator=gen).cuda()
        start = torch.full((B,), 9, dtype=torch.long, device="cuda")
        out = {}
        for name, m, skinny, norm in (("fp32", fp32, False, False),
                                      ("cublas", model, False, False),
                                      ("skinny", model, True, False),
                                      ("skinny+norm", model, True, True)):
            m.linear.skinny, m.linear.skinny_norm = skinny, norm
            cache = m.make_cache(B, S)
            logits(m, prompt, zeros, cache)
            out[name] = logits(m, tokens, start, cache)
        err_cublas = (out["cublas"] - out["fp32"]).abs().max().item()
        for name in ("skinny", "skinny+norm"):
            err = (out[name] - out["fp32"]).abs().max().item()
            assert err <= 1.5 * err_cublas + 1e-3, (T, name, err, err_cublas)

        model.linear.skinny = model.linear.skinny_norm = True
        cache, eager_cache = model.make_cache(B, S), model.make_cache(B, S)
        for c in (cache, eager_cache):
            logits(model, prompt, zeros, c)
        static = tokens.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                logits(model, static, start, model.make_cache(B, S))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = logits(model, static, start, cache)
        for i in range(3):
            step = torch.randint(0, V, (B, T), generator=gen).cuda()
            static.copy_(step)
            start.fill_(9 + i * T)
            graph.replay()
            eager = logits(model, step, start.clone(), eager_cache)
            assert torch.equal(captured, eager), (T, i)


@pytest.mark.gpu
def test_two_tiles_give_the_one_tiles_bits_bf16_cuda(monkeypatch):
    """A one-tile tl.dot over K = 576 as two tiles (512 + 64, ``one_pass_piece``) gives
    the bits of one 1024-wide tile, plain and with SwiGLU in the epilogue, on the bench's
    probe inputs (products cancelling in pairs: another summation order changes most
    outputs), for the shipped tail's configurations at 1..64 and 128 rows."""
    from pathlib import Path

    from specloop.models import _skinny
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    import bench_skinny_gemm as bench

    for n, glu in ((960, False), (576, False), (3072, True)):
        for x, w, _ in bench.probe_inputs(n, 576, False, "cuda", torch.bfloat16, rows=128):
            for tag in ("d64x1024s1w8n1", "d128x1024s1w8n1"):
                cfg = parse_config(tag)
                assert _skinny.one_pass_piece(cfg, 576) == 64
                for m in (*range(1, 65), 128):
                    two = _skinny.skinny_linear(x[:m], w, None, cfg, glu=glu)
                    monkeypatch.setattr(_skinny, "PIECES", False)
                    one = _skinny.skinny_linear(x[:m], w, None, cfg, glu=glu)
                    monkeypatch.setattr(_skinny, "PIECES", True)
                    assert torch.equal(two, one), (n, glu, tag, m)



@pytest.mark.gpu
def test_sliced_one_tile_dot_bf16_cuda():
    """The sliced one-tile tl.dot (``k2``/``k4``/``k8``) on SmolLM2's VERIFY shapes in bf16:
    within bf16 rounding of F.linear at 5..32 rows, a row's bits whatever the rows in the
    call, the same bits as a CUDA graph's replay; SwiGLU's epilogue, the residual epilogue
    and the qkv kernel with RoPE + the cache write take the slices and stay within
    rounding of the unsliced path; narrower tiles (d32, d16) give d64's sliced bits; the
    down GEMM's slices in programs of their own (``p``) its one program's bits, eager and
    replayed in a CUDA graph, with the residual add."""
    from specloop.models import _skinny
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    def close(a, b, where):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -6, atol=2e-2, msg=where)

    for n, k, tags in ((960, 576, ("d64x1024s1w8n1k2", "d64x1024s1w8n1k4", "d64x1024s1w8n1k8")),
                       (3072, 576, ("d64x1024s1w8n1k4",)),
                       (576, 1536, ("d32x2048s1w8n1k2", "d32x2048s1w8n1k4",
                                    "d32x2048s1w8n1k2p", "d16x2048s1w8n1k2p"))):
        w, x = rand(n, k, scale=0.05), rand(32, k)
        for tag in tags:
            if tag.endswith("p"):    # the slices in programs of their own: k2's bits
                cfg, one = parse_config(tag), parse_config("d32x2048s1w8n1k2")
                assert cfg.slice_grid(k) == 3
                r = rand(32, n)
                for m in (5, 16, 32, 32):   # (twice: the counters each call leaves zero)
                    assert torch.equal(_skinny.skinny_linear(x[:m], w, None, cfg),
                                       _skinny.skinny_linear(x[:m], w, None, one)), (tag, m)
                    assert torch.equal(
                        _skinny.skinny_linear(x[:m], w, None, cfg, residual=r[:m]),
                        _skinny.skinny_linear(x[:m], w, None, one, residual=r[:m])), tag
                static, graph = x.clone(), torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = _skinny.skinny_linear(static, w, None, cfg, residual=r)
                for _ in range(3):
                    static.copy_(rand(32, k))
                    graph.replay()
                    assert torch.equal(out, _skinny.skinny_linear(static, w, None, one,
                                                                  residual=r)), tag
                continue
            cfg = parse_config(tag)
            assert cfg.slices_for(k) == cfg.slices
            full = _skinny.skinny_linear(x, w, None, cfg)
            close(full, F.linear(x, w), (tag, n, k))
            for m in (5, 8, 16, 31):
                assert torch.equal(_skinny.skinny_linear(x[:m], w, None, cfg), full[:m]), (tag, m)
            static = x[:16].clone()
            graph = torch.cuda.CUDAGraph()
            _skinny.skinny_linear(static, w, None, cfg)          # compiled before capture
            with torch.cuda.graph(graph):
                out = _skinny.skinny_linear(static, w, None, cfg)
            static.copy_(x[16:])
            graph.replay()
            assert torch.equal(out, full[16:]), tag
            if n == 3072:
                plain = parse_config(tag)._replace(slices=1)
                close(_skinny.skinny_linear(x, w, None, cfg, glu=True),
                      _skinny.skinny_linear(x, w, None, plain, glu=True), (tag, "glu"))
            if n == k or n == 576:
                r = rand(32, n)
                close(_skinny.skinny_linear(x, w, None, cfg, residual=r),
                      r.float() + F.linear(x, w).float(), (tag, "residual"))
    # qkv with RoPE and the cache write in the epilogue, sliced against unsliced.
    HQ, HKV, D, H, P = 9, 3, 64, 576, 16
    inv = 1.0 / 100000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D)
    emb = torch.arange(2048, device="cuda").float()[:, None] * inv[None, :]
    emb = torch.cat((emb, emb), -1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    w, nw = rand((HQ + 2 * HKV) * D, H, scale=0.05), 1 + rand(H, scale=0.1)
    table = torch.randperm(64, device="cuda").to(torch.int32).view(4, 16)
    kc0, vc0 = rand(65, P, HKV, D), rand(65, P, HKV, D)
    x = rand(2, 8, H)
    outs = []
    for tag in ("d64x1024s1w8n1", "d64x1024s1w8n1k4"):
        kc, vc = kc0.clone(), vc0.clone()
        rope = _skinny.RopeWrite(torch.tensor([13, 250], device="cuda"),
                                 torch.tensor([3, 1], device="cuda"), table, 256, 64, cos,
                                 sin, kc, vc, HQ)
        q = _skinny.skinny_rope_linear(x, w, None, parse_config(tag), rope, norm=(nw, 1e-5))
        outs.append((q, kc, vc))
    for a, b in zip(*outs):
        close(a, b, "rope")
    assert not torch.equal(outs[0][0], outs[1][0])       # another summation order ran
    # Narrower tiles (more programs for the same W: bench/tables/narrow_*.json) give the
    # sliced class's bits: qkv with RoPE (half, a quarter of a head a program), o with the
    # residual add, gate-up with GLU.
    sliced = ("d64x1024s1w8n1k2", "d32x1024s1w8n1k2", "d16x1024s1w8n1k2")
    outs = []
    for tag in sliced:
        kc, vc = kc0.clone(), vc0.clone()
        rope = _skinny.RopeWrite(torch.tensor([13, 250], device="cuda"),
                                 torch.tensor([3, 1], device="cuda"), table, 256, 64, cos,
                                 sin, kc, vc, HQ)
        outs.append((_skinny.skinny_rope_linear(x, w, None, parse_config(tag), rope,
                                                norm=(nw, 1e-5)), kc, vc))
    for tag, got in zip(sliced[1:], outs[1:]):
        assert all(torch.equal(a, b) for a, b in zip(outs[0], got)), tag
    xs, r = rand(16, H), rand(16, H)
    for wt, kw in ((rand(H, H, scale=0.05), {"residual": r}),
                   (rand(2 * 1536, H, scale=0.05), {"glu": True})):
        want = _skinny.skinny_linear(xs, wt, None, parse_config(sliced[0]), **kw)
        for tag in sliced[1:]:
            assert torch.equal(_skinny.skinny_linear(xs, wt, None, parse_config(tag), **kw),
                               want), (tag, kw.keys())

@pytest.mark.gpu
def test_glu_path_gives_the_prologue_paths_bits_bf16_cuda(monkeypatch):
    """``norm_mlp`` with SwiGLU in the gate-up GEMM's epilogue equals it with SwiGLU in the
    down GEMM's prologue, bit for bit, at every row count 1..32 on SmolLM2's MLP shapes
    (the shipped table, bf16, random weights), with and without the norm in the prologue;
    the epilogue form runs at 1 row (the norm kernel) and from 2 rows (one-tile tl.dot)."""
    from specloop.models import _skinny

    H, I = 576, 1536
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    x, d, nw = rand(32, H), rand(32, H), (1 + rand(H, scale=0.1))
    wgu, wd = rand(2 * I, H, scale=0.05), rand(H, I, scale=0.05)
    glu_rows = []
    for name in ("skinny_linear", "skinny_norm_linear"):
        fn = getattr(_skinny, name)

        def counted(*a, fn=fn, **k):
            if k.get("glu"):
                glu_rows.append(a[0].shape[0])
            return fn(*a, **k)
        monkeypatch.setattr(_skinny, name, counted)
    for norm in (False, True):
        lins = []
        for glu in (True, False):
            lin = PackedLinear(skinny=True)
            lin.skinny_norm, lin.glu = norm, glu
            lins.append(lin)
        for m in range(1, 33):
            (y1, s1), (y0, s0) = (lin.norm_mlp(x[:m], d[:m], nw, 1e-5, wgu, wd) for lin in lins)
            assert torch.equal(y1, y0) and torch.equal(s1, s0), (norm, m)
    assert 1 in glu_rows and max(glu_rows) == 32, glu_rows


@pytest.mark.gpu
def test_stream_norm_gives_norm_mlps_stream_within_rounding_bf16_cuda(monkeypatch):
    """``out_norm_mlp`` with both stream fusions and ``feeds_stream`` on SmolLM2's o /
    gate-up / down shapes (the shipped table, bf16, random weights) at 1..32 rows: from 2
    rows the down GEMM adds the residual (its stream bit for bit add_rms_norm's where o
    runs its b-family rows), from 9 (o's one-tile tl.dot; counted) o and gate-up fused
    too, the stream after the MLP within bf16 rounding of ``norm_mlp(x, o @ w_o^T)``'s
    stream plus its output; at 1 row ``norm_mlp`` itself."""
    from specloop.models import _kernels, _skinny

    H, I = 576, 1536
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    x, o, nw = rand(32, H), rand(32, H), 1 + rand(H, scale=0.1)
    wo, wgu, wd = rand(H, H, scale=0.05), rand(2 * I, H, scale=0.05), rand(H, I, scale=0.05)
    fused_rows = []
    real = _skinny.skinny_linear

    def counted(x, *a, **k):
        if k.get("norm") is not None:
            fused_rows.append(x.shape[0])
        return real(x, *a, **k)
    monkeypatch.setattr(_skinny, "skinny_linear", counted)
    lins = []
    for on in (True, False):
        lin = PackedLinear(skinny=True)
        lin.stream_norm = on
        lins.append(lin)
    for m in range(1, 33):
        (y1, s1), (y0, s0) = (lin.out_norm_mlp(x[:m], o[:m], wo, nw, 1e-5, wgu, wd,
                                               feeds_stream=True) for lin in lins)
        if m == 1:
            assert torch.equal(y1, y0) and torch.equal(s1, s0)
            continue
        assert y1 is None, m
        after = _kernels.add_rms_norm(s0, y0, nw, 1e-5)[1]
        torch.testing.assert_close(s1.float(), after.float(), rtol=3e-2, atol=3e-2)
        if not _linear.skinny_config(m, H, H).dot:   # o's b-family rows: only down fused
            assert torch.equal(s1, after), m
    # Gate-up's norm prologue where o runs its one-tile tl.dot (9-32 rows).
    assert fused_rows == [m for m in range(2, 33) if _linear.skinny_config(m, H, H).dot], \
        fused_rows


@pytest.mark.gpu
def test_stream_norm_decoder_close_and_replay_equals_eager_bf16_cuda(tiny_dirs, monkeypatch):
    """The fused bf16 decoder (tiny llama, 2 requests x 5 tokens: VERIFY's shape) with
    ``stream_norm`` and the table putting qkv, o and gate-up on the one-tile tl.dot and
    down on a 2-D block (so every residual add and norm but the final one is fused):
    hidden states within bf16 rounding of the default path's, and a CUDA graph's replay
    gives the eager call's bits (hidden states and the KV cache written)."""
    from specloop.models import load_model

    model = load_model(tiny_dirs["llama"], dtype=torch.bfloat16, device="cuda").model
    a = model.args
    H, I = a.hidden_size, a.intermediate_size
    qkv_n = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
    for n in (qkv_n, 2 * I, H):
        monkeypatch.setitem(_linear.SKINNY_TABLE, (n, H, False),
                            ((32, f"d{a.head_dim}x{_pow2(H)}s1w4n1"),))
    monkeypatch.setitem(_linear.SKINNY_TABLE, (H, I, True),
                        ((32, f"b2x4x{_pow2(I)}s1w4n3"),))
    B, T, S = 2, 5, 256
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, a.vocab_size, (B, 40), generator=gen).cuda()
    tokens = torch.randint(0, a.vocab_size, (B, T), generator=gen).cuda()
    slots = torch.tensor([0, 1], device="cuda")
    start = torch.tensor([40, 40], device="cuda")
    outs = {}
    for on in (False, True):
        model.linear.stream_norm = on
        cache = model.make_cache(B, S)
        model(prompt, torch.zeros(B, dtype=torch.long, device="cuda"), slots, cache)
        outs[on] = model(tokens, start, slots, cache, kv_len=S).float()
        if on:
            eager_k = cache.k.clone()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                model(tokens, start, slots, cache, kv_len=S)       # warm-up
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                static = model(tokens, start, slots, cache, kv_len=S)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static.float(), outs[True])
            assert torch.equal(cache.k, eager_k)
    torch.testing.assert_close(outs[True], outs[False], rtol=3e-2, atol=3e-2)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _rope_tables_cuda(D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A real cos / sin table of 2048 positions (theta 1e5), bf16, as DecoderModel keeps it."""
    inv = 1.0 / 100000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D)
    angles = torch.arange(2048, device="cuda").float()[:, None] * inv[None, :]
    emb = torch.cat((angles, angles), -1)
    return emb.cos().bfloat16(), emb.sin().bfloat16()


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [True, False])
def test_rope_epilogue_gives_the_rope_kernels_bits_bf16_cuda(monkeypatch, pdl):
    """``norm_linear_rope`` on SmolLM2's qkv shape (the shipped table, bf16, random weights,
    a real cos / sin table): q, the stream and both caches bit for bit with the epilogue
    and without (the GEMM then ``rope_cache_write``) at every row count 1..32 (counted: the
    norm prologue's broadcast kernels at 1-4 rows, the one-tile tl.dot from 5), one request
    and two of 4..16 rows whose rows cross pages, a draft tree's rows, with PDL on and
    off."""
    from specloop.models import _kernels, _skinny

    monkeypatch.setattr(_skinny._pdl, "_ENV_ON", pdl)
    HQ, HKV, D, H, P = 9, 3, 64, 576, 16
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    cos, sin = _rope_tables_cuda(D)
    w, nw = rand((HQ + 2 * HKV) * D, H, scale=0.05), 1 + rand(H, scale=0.1)
    table = torch.randperm(64, device="cuda").to(torch.int32).view(4, 16)
    kc0, vc0 = rand(65, P, HKV, D), rand(65, P, HKV, D)
    fused_rows = []
    real_dot, real_norm = _skinny.skinny_rope_linear, _skinny.skinny_norm_linear

    def dot_counted(x, *a, **k):
        fused_rows.append(x.shape[0] * x.shape[1])
        return real_dot(x, *a, **k)

    def norm_counted(x, *a, **k):
        if k.get("rope") is not None:
            fused_rows.append(-x.shape[0] * x.shape[1])
        return real_norm(x, *a, **k)
    monkeypatch.setattr(_skinny, "skinny_rope_linear", dot_counted)
    monkeypatch.setattr(_skinny, "skinny_norm_linear", norm_counted)
    shapes = [(1, m, None) for m in range(1, 33)] + [(2, t, None) for t in (4, 5, 8, 16)]
    tree = torch.tensor([0, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3], device="cuda")
    shapes += [(1, 16, tree), (2, 16, tree)]
    for B, T, offsets in shapes:
        x, d = rand(B, T, H), rand(B, T, H)
        start = torch.tensor([13, 250][:B], device="cuda")
        slots = torch.tensor([3, 1][:B], device="cuda")
        out = []
        for on in (True, False):
            lin = PackedLinear(skinny=True)
            lin.rope = on
            kc, vc = kc0.clone(), vc0.clone()
            rope = _skinny.RopeWrite(start, slots, table, 256, 64, cos, sin, kc, vc, HQ, 0,
                                     offsets)
            q, stream = lin.norm_linear_rope(x, d, nw, 1e-5, w, None, None, rope)
            out.append((q, stream, kc, vc))
        for a, b in zip(*out):
            assert torch.equal(a, b), (B, T, offsets is not None)
    # 1-4 rows: the norm prologue's broadcast kernels (counted negative), 5-32: tl.dot.
    assert sorted({abs(r) for r in fused_rows}) == list(range(1, 33)), fused_rows
    assert max(r for r in fused_rows if r < 0) == -1 and min(fused_rows) == -4, fused_rows
    assert min(r for r in fused_rows if r > 0) == 5, fused_rows
    # The reference path's rotation, for scale: the epilogue rotates, not just copies.
    q = out[0][0]
    assert not torch.equal(q, (_kernels.add_rms_norm(x, d, nw, 1e-5)[0] @ w.T)[..., :HQ * D]
                           .view_as(q))


@pytest.mark.gpu
def test_first_layer_lookup_gives_the_embedding_kernels_bits_bf16_cuda(monkeypatch):
    """``norm_linear_rope(gather=...)`` (the first layer looking the tokens up itself) on
    SmolLM2's qkv shape (the shipped table, bf16, random weights and embedding table): q,
    the stream it writes and both caches bit for bit against the lookup first, at every
    row count 1..32, one request and two, a draft tree's rows; the kernel gathers at 5-32
    rows (the stream normed as loaded), below that the lookup runs first."""
    from specloop.models import _skinny

    HQ, HKV, D, H, P, V = 9, 3, 64, 576, 16, 1000
    gen = torch.Generator(device="cuda").manual_seed(1)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    cos, sin = _rope_tables_cuda(D)
    w, nw, embed = rand((HQ + 2 * HKV) * D, H, scale=0.05), 1 + rand(H, scale=0.1), rand(V, H)
    table = torch.randperm(64, device="cuda").to(torch.int32).view(4, 16)
    kc0, vc0 = rand(65, P, HKV, D), rand(65, P, HKV, D)
    gathered = []
    real = _skinny.skinny_rope_linear

    def counted(x, *a, **k):
        if k.get("gather") is not None:
            gathered.append(x.shape[0] * x.shape[1])
        return real(x, *a, **k)
    monkeypatch.setattr(_skinny, "skinny_rope_linear", counted)
    lin = PackedLinear(skinny=True)
    tree = torch.tensor([0, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3], device="cuda")
    shapes = [(1, m, None) for m in range(1, 33)] + [(2, t, None) for t in (4, 5, 16)]
    shapes += [(1, 16, tree), (2, 16, tree)]
    for B, T, offsets in shapes:
        tokens = torch.randint(0, V, (B, T), device="cuda", generator=gen)
        start = torch.tensor([13, 250][:B], device="cuda")
        slots = torch.tensor([3, 1][:B], device="cuda")
        assert lin.gathers_embeddings(embed[tokens], nw, w, None, D) == (B * T >= 5)
        out = []
        for gather in (True, False):
            kc, vc = kc0.clone(), vc0.clone()
            rope = _skinny.RopeWrite(start, slots, table, 256, 64, cos, sin, kc, vc, HQ, 0,
                                     offsets)
            x = torch.full((B, T, H), float("nan"), device="cuda").bfloat16() if gather \
                else embed[tokens]
            q, stream = lin.norm_linear_rope(x, None, nw, 1e-5, w, None, None, rope,
                                             (tokens, embed) if gather else None)
            out.append((q, stream, kc, vc))
        for a, b in zip(*out):
            assert torch.equal(a, b), (B, T, offsets is not None)
        assert torch.equal(out[0][1], embed[tokens])
    assert sorted(set(gathered)) == list(range(5, 33)), gathered


@pytest.mark.gpu
def test_skinny_norm_linear_matches_add_rms_norm_bf16_cuda():
    """The RMSNorm prologue in bf16 on the GPU (the interpreter cannot check bf16 there):
    the stream and its copy equal add_rms_norm's bits, y is F.linear of its h within bf16
    rounding, for SmolLM2's qkv and gate-up at 1..4 rows."""
    from specloop.models import _kernels
    from specloop.models._skinny import norm_fusable, skinny_norm_linear

    gen = torch.Generator(device="cuda").manual_seed(0)
    for n in (960, 3072):
        w = (torch.randn(n, 576, device="cuda", generator=gen) * 0.05).bfloat16()
        nw = (torch.rand(576, device="cuda", generator=gen) + 0.5).bfloat16()
        for rows, tile in ((1, False), (2, False), (3, False), (4, False), (9, False),
                           (1, True), (3, True), (4, True), (9, True)):
            cfg = skinny_config(rows, n, 576) or default_config(n, 576)
            if not norm_fusable(cfg, 576):
                cfg = default_config(n, 576)
            if tile:            # the one-reduction family, whatever the table holds
                cfg = tile_config(n, 576)
            x = (torch.randn(rows, 576, device="cuda", generator=gen) * 3).bfloat16()
            d = torch.randn(rows, 576, device="cuda", generator=gen).bfloat16()
            copy = torch.zeros(rows, 2 * 576, device="cuda", dtype=torch.bfloat16)[:, 576:]
            y, stream = skinny_norm_linear(x, d, nw, 1e-5, w, None, cfg, copy)
            h, want = _kernels.add_rms_norm(x, d, nw, 1e-5)
            assert torch.equal(stream, want) and torch.equal(copy, want)
            torch.testing.assert_close(y.float(), F.linear(h, w).float(), rtol=2e-2, atol=2e-2)


def test_skinny_table_file_replaces_the_shipped_table(tmp_path):
    """SPECLOOP_SKINNY_TABLE's file (bench/bench_skinny_gemm.py's skinny_table.json) parses
    to the table's own form: ranges as tuples, cuBLAS (null) entries kept, silu flags as
    booleans, the older [tag, max rows] as one range; a malformed file raises."""
    import json
    from specloop.models._linear import _table_from_file
    path = tmp_path / "skinny_table.json"
    path.write_text(json.dumps({"960,576,0": [[1, "v2x1024s1w4n3"], [8, "b4x4x1024s1w4n3"]],
                                "576,1536,1": None, "576,576,0": ["v8x1024s1w4n3", 16]}))
    table = _table_from_file(str(path))
    assert table == {(960, 576, False): ((1, "v2x1024s1w4n3"), (8, "b4x4x1024s1w4n3")),
                     (576, 1536, True): None, (576, 576, False): ((16, "v8x1024s1w4n3"),)}
    for bad in ({"960,576,0": [[8, "v2x1024s1w4n3"], [1, "b4x4x1024s1w4n3"]]},
                {"960,576,0": [[8, "v2x1024s1w4n3", 3]]}, {"960,576,0": []},
                {"960,576,0": "v2x1024s1w4n3"}, {"960,576,0": [[33, "v2x1024s1w4n3"]]}):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError):
            _table_from_file(str(path))


def _bench(monkeypatch):
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    return importlib.import_module("bench_skinny_gemm")


@pytest.mark.skipif(not _linear._skinny.available(), reason="needs Triton")
def test_bench_resources_lists_what_the_dispatcher_launches(monkeypatch):
    """bench/bench_skinny_gemm.py --resources: the kernels a table entry may launch (a silu
    entry's prologue only where ``prologue_fits``: not on its one-tile tl.dot; gate-up's
    GLU epilogue; the norm kernel in a fusable prefix), and one offline sm_90 compile read
    back through ptxas -v."""
    bench = _bench(monkeypatch)
    from specloop.models._linear import _resolve
    silu = _resolve(((2, "v2x64s1w4n3"), (8, "d16x64s1w4n1")), 64)
    assert [(m, c.tag(), w) for m, c, w in bench.launched_variants(silu, 24, 64, True)] == [
        (2, "v2x64s1w4n3", {}), (2, "v2x64s1w4n3", {"act": True}), (8, "d16x64s1w4n1", {})]
    gate_up = _resolve(((1, "v2x64s1w4n3"), (8, "d16x64s1w4n1")), 64)
    assert [(m, c.tag(), w) for m, c, w in bench.launched_variants(gate_up, 24, 64, False)] \
        == [(1, "v2x64s1w4n3", {}), (1, "v2x64s1w4n3", {"glu": True}),
            (1, "v2x64s1w4n3", {"norm": True}), (1, "v2x64s1w4n3", {"norm": True, "glu": True}),
            (8, "d16x64s1w4n1", {}), (8, "d16x64s1w4n1", {"glu": True})]
    # Triton 3.9 warns where this is unset; on (Triton's default) as the device compiles.
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        use = bench.kernel_resources(bench.compile_offline(
            _linear.parse_config("b2x2x64s1w4n3"), 64))
    except (ImportError, OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"no offline sm_90 toolchain here: {exc}")    # no CUDA backend / ptxas
    assert use["registers"] > 0 and use["stack"] == use["spill_stores"] == 0, use


def test_bench_sweep_and_chooser(monkeypatch):
    """bench/bench_skinny_gemm.py: every swept config's tag parses back; the ``b`` configs
    keep BLOCK_K / 256 warps at most (loads in the product's layout) and <= 128 fp32
    products a thread. The chooser: per bit class the fastest config at each timed row
    count (the previous range's kept within 1%), never two classes in one shape even where
    another class is fastest at some rows, a class's rows stopping at its first failure,
    ranges merged, the row limit saving the most, cuBLAS when nothing saves >= 3%."""
    bench = _bench(monkeypatch)
    for k in (576, 1152, 1536, 1728):
        configs = bench.sweep(k)
        assert any(c.tile_m for c in configs) and any(not c.tile_m and not c.dot
                                                    for c in configs)
        for c in configs:
            assert parse_config(c.tag()) == c
            if c.tile_m:
                assert c.num_warps <= c.block_k // 256 and c.block_k >= k
                assert c.tile_m * c.block_n * c.block_k <= 128 * 32 * c.num_warps
        # tl.dot over all of K in one tile only up to BLOCK_K 1024 (2048 spills: the sweep's
        # comment): K = 576's, not 1152..1728's.
        assert any(c.dot and c.block_k >= k for c in configs) == (k <= 1024), k
    cublas = {1: 3.8, 2: 3.8, 4: 3.9, 8: 4.0, 16: 4.2, 32: 4.5}
    times = {"v2": {1: 2.5, 2: 3.0, 4: 4.0, 8: 6.0, 16: 9.0, 32: 15.0},
             "b2": {1: 2.7, 2: 2.7, 4: 2.8, 8: 3.6, 16: 5.0, 32: 8.0},
             "b4": {1: 3.0, 2: 3.0, 4: 2.79, 8: 3.2, 16: 4.1, 32: 7.0},
             "w2": {1: 2.4, 2: 2.6, 4: 2.6, 8: 9.0, 16: 9.0, 32: 9.0},
             "b8": {1: "mismatch", 2: 1.0, 4: 1.0, 8: 1.0}}
    classes = {"v2": "A", "b2": "A", "b4": "A", "w2": "B", "b8": "C", "other": "A"}
    ranges, saved = bench.choose(cublas, times, classes)
    # w2 (class B) is fastest at 1, 2 and 4 rows but A saves more over all: A alone. 4 rows:
    # b2 kept (2.8 within 1% of b4's 2.79); 16 rows: b4 saves 0.05 at weight 1/2.
    assert ranges == ((1, "v2"), (4, "b2"), (16, "b4"))
    assert saved == pytest.approx(1.3 + 1.1 + 1.1 + 0.8 + 0.05)
    # Class B alone: 3 rows fast, then 5 us slower at 8 (stops at 4); C: fails at 1 row.
    assert bench.choose(cublas, times, {"w2": "B"}) == (((4, "w2"),), pytest.approx(3.9))
    assert bench.choose(cublas, times, {"b8": "C"}) == (None, 0.0)
    assert bench.choose(cublas, times, {"v2": None, "b2": None}) == (None, 0.0)
    assert bench.choose(cublas, {"v": {r: 0.99 * t for r, t in cublas.items()}},
                        {"v": "A"}) == (None, 0.0)
    # norm shapes: cuBLAS + add_rms_norm; a fusable config its norm kernel's time (or,
    # unmeasured, its own), a tl.dot config + add_rms_norm.
    base, eff = bench.effective({1: 4.0}, {"v2x1024s1w4n3": {1: 3.0}, "d16x64s1w4n3": {1: 3.5},
                                           "b4x4x1024s1w4n3": {1: 2.0}},
                                {1: 1.5}, {"b4x4x1024s1w4n3": {1: 2.5}}, 576)
    assert base == {1: 5.5}
    assert eff == {"v2x1024s1w4n3": {1: 3.0}, "d16x64s1w4n3": {1: 5.0},
                   "b4x4x1024s1w4n3": {1: 2.5}}
    literal = bench.table_literal({(960, 576, False): ((1, "v2x1024s1w4n3"),
                                                       (8, "b4x4x1024s1w4n3")),
                                   (16384, 576, False): None,
                                   (49152, 576, False): ((2, "d64x64s1w4n3"),)})
    namespace: dict = {"SkinnyRanges": object}
    exec(literal, namespace)
    assert namespace["SKINNY_TABLE"] == {
        (960, 576, False): ((1, "v2x1024s1w4n3"), (8, "b4x4x1024s1w4n3")),
        (16384, 576, False): None, (49152, 576, False): ((2, "d64x64s1w4n3"),)}
    assert bench.table_json(namespace["SKINNY_TABLE"])["960,576,0"] == \
        [[1, "v2x1024s1w4n3"], [8, "b4x4x1024s1w4n3"]]


def test_bench_chooser_prefix_and_cublas_tail(monkeypatch):
    """bench/bench_skinny_gemm.py's choice of a prefix (one class, no tl.dot) up to R1 and
    a tail of tl.dot configurations with F.linear's bits (models/_linear's rule) up to R2:
    taken where it saves more than every single class, only from the tail tags given
    (cublas_tail: tl.dot, F.linear's plain digest), never a class's own tl.dot
    configurations after its others; equal savings keep the single class; the tail ends
    where it stops saving or stops running; for norm shapes the prefix's rows cost the
    norm kernel's time, the tail's tl.dot + add_rms_norm."""
    bench = _bench(monkeypatch)
    cublas = {1: 4.0, 2: 4.0, 4: 4.0, 8: 4.0, 16: 4.0}
    times = {"v2": {1: 1.5, 2: 2.2, 4: 4.5, 8: 6.0, 16: 9.0},
             "dc": {1: 2.5, 2: 2.5, 4: 2.6, 8: 2.7, 16: 4.2},     # cuBLAS's bits
             "dx": {1: 5.0, 2: 5.0, 4: 1.0, 8: 1.0, 16: 1.0},     # another class
             "dv": {1: 9.0, 2: 9.0, 4: 1.0, 8: 1.0, 16: 1.0}}     # v2's class, tl.dot
    classes = {"v2": "A", "dc": "C", "dx": "X"}
    # Alone: A to 2 rows saves 2.5 + 1.8 = 4.3; C to 8 1.5 + 1.5 + 1.4 + 1.3 = 5.7; X to
    # 16 -1 - 1 + 3 + 3 + 1.5 = 5.5. A to 2 then C to 8: 4.3 + 1.4 + 1.3 = 7.0 (A to 1
    # then C: 6.7; C at 16 rows loses 0.2 x 1/2: the tail ends at 8). X is faster above 2
    # rows, but not a tail.
    assert bench.choose(cublas, times, classes) == (((8, "dc"),), pytest.approx(5.7))
    assert bench.choose(cublas, times, classes, ["dc"]) == \
        (((2, "v2"), (8, "dc")), pytest.approx(7.0))
    assert bench.choose(cublas, times, {"v2": "A"}, ["dc"]) == \
        (((2, "v2"), (8, "dc")), pytest.approx(7.0))          # the tail needs no class
    assert bench.choose(cublas, times, classes, ["v2"]) == (((8, "dc"),), pytest.approx(5.7))
    # Only tl.dot tags may form a tail (bz: no tl.dot, fast above 2 rows, given as one);
    # a tail with no class of its own stands alone (an entry of tl.dot ranges only).
    fast = dict(times, bz={1: 9.0, 2: 9.0, 4: 1.0, 8: 1.0, 16: 1.0})
    assert bench.choose(cublas, fast, {"v2": "A"}, ["bz"]) == (((2, "v2"),), pytest.approx(4.3))
    assert bench.choose(cublas, times, {}, ["dc"]) == (((8, "dc"),), pytest.approx(5.7))
    # A tl.dot class of its own (dy, not cuBLAS's) is never a prefix: models/_linear would
    # take all of its ranges as the tail (dy to 2 then dc would save 8.7).
    ahead = dict(times, dy={1: 1.0, 2: 1.0, 4: 9.0, 8: 9.0, 16: 9.0})
    assert bench.choose(cublas, ahead, {"dy": "Y"}, ["dc"]) == (((2, "dy"),), pytest.approx(6.0))
    # A class's own tl.dot configurations never follow its others (one class, but
    # models/_linear takes tl.dot ranges as a tail in cuBLAS's class): A without them
    # (dv alone never saves), not v2 to 2 then dv to 16 (11.8).
    assert bench.choose(cublas, times, {"v2": "A", "dv": "A"}) == \
        (((2, "v2"),), pytest.approx(4.3))
    # Equal savings: the single class is kept (a tail saving 0 at 4 rows is not taken).
    flat = dict(times, dc={1: 5.0, 2: 5.0, 4: 4.0, 8: 9.0})
    assert bench.choose(cublas, flat, classes, ["dc"]) == (((16, "dx"),), pytest.approx(5.5))
    assert bench.choose(cublas, flat, {"v2": "A"}, ["dc"]) == (((2, "v2"),), pytest.approx(4.3))
    # The tail stops at the first row count none of it ran; the prefix's class at its own.
    gap = dict(times, dc={1: 2.5, 2: 2.5, 4: "mismatch", 8: 2.7},
               v2={1: 1.5, 2: "error", 4: 4.5})
    assert bench.choose(cublas, gap, {"v2": "A"}, ["dc"]) == \
        (((1, "v2"), (2, "dc")), pytest.approx(2.5 + 1.5))
    # >= 3% of cuBLAS's time over the rows <= R2, as for one class.
    near = {"v2": {1: 3.9, 2: 3.9}, "dc": {r: 3.95 for r in cublas}}
    assert bench.choose(cublas, near, {"v2": "A"}, ["dc"]) == (None, 0.0)
    # The tail's candidates: tl.dot tags with F.linear's plain digest (its norm digest
    # aside: the tail runs add_rms_norm then the plain GEMM), never one that varies.
    digests = {"cublas": ("p0", "n0"), "d16x1024s1w8n1": ("p0", None),
               "d64x1024s1w8n1": ("p0", "n1"), "d16x64s1w4n3": ("p1", None),
               "d32x1024s1w8n1": ("varies", None), "v4x1024s1w4n3": ("p0", "n0")}
    assert bench.cublas_tail(digests) == ["d16x1024s1w8n1", "d64x1024s1w8n1"]
    assert bench.cublas_tail({"d16x1024s1w8n1": ("p0", None)}) == []
    # Norm shapes: the prefix's rows at the norm kernel's time, the tail's at tl.dot +
    # add_rms_norm (also where an older run timed a tl.dot norm kernel: no longer run).
    v, d = "v2x1024s1w4n3", "d64x1024s1w8n1"
    base, eff = bench.effective({1: 4.0, 4: 4.0}, {v: {1: 3.0, 4: 6.0}, d: {1: 2.5, 4: 2.6}},
                                {1: 1.0, 4: 1.0}, {v: {1: 2.0, 4: 5.5}, d: {1: 0.5, 4: 0.5}},
                                576)
    assert base == {1: 5.0, 4: 5.0} and eff == {v: {1: 2.0, 4: 5.5}, d: {1: 3.5, 4: 3.6}}
    # v alone saves 3.0, d alone 1.5 + 1.4: v at 1 row, d above.
    assert bench.choose(base, eff, {v: "A", d: "C"}, [d]) == \
        (((1, v), (4, d)), pytest.approx(3.0 + 1.4))
    _linear.check_table({(960, 576, False): ((1, v), (4, d))})


def test_bench_offline_takes_the_tail_from_the_run_or_the_bits(monkeypatch, tmp_path):
    """--offline's tail candidates: a run's own ``cublas_tail``; a run from before it, the
    tl.dot tags grouped with 'cublas' in its ``bit_classes``; with --bits, the tl.dot tags
    in cuBLAS's plain groups. Never a tl.dot tag of another class (dx, fastest above 1 row:
    a v4 + dx table would save 9 against v4 + d64's 7)."""
    import json
    bench = _bench(monkeypatch)
    v4, d64, dx = "v4x1024s1w4n3", "d64x1024s1w8n1", "d16x64s1w4n3"
    run = {"shape": "o", "N": 576, "K": 576, "silu_mul": False,
           "cublas_us": {"1": 4.0, "2": 4.0, "4": 4.0},
           "configs": {v4: {"1": 1.0, "2": 3.0, "4": 5.0}, d64: {"1": 3.0, "2": 2.0, "4": 2.0},
                       dx: {"1": 9.0, "2": 1.0, "4": 1.0}}}
    path, bits = tmp_path / "skinny.json", tmp_path / "bits.json"

    def offline(bits_path=None, **r):
        path.write_text(json.dumps({"shapes": [dict(run, **r)]}))
        return bench.offline(str(path), bits_path)[(576, 576, False)]
    tail = ((1, v4), (4, d64))                 # 3 + 2 + 2; v4 alone 4, d64 alone 5
    assert offline(bit_classes=[["cublas"], [d64], [dx], [v4]], cublas_tail=[d64]) == tail
    assert offline(bit_classes=[["cublas", d64], [dx], [v4]]) == tail
    assert offline(bit_classes=[["cublas"], [d64], [dx], [v4]]) == ((4, d64),)
    bits.write_text(json.dumps({"o": {"groups": [["cublas", d64], [dx], [v4]]}}))
    assert offline(str(bits)) == tail
    bits.write_text(json.dumps({"o": {"groups": [["cublas"], [d64], [dx], [v4]]}}))
    assert offline(str(bits)) == ((4, d64),)


def test_bench_bit_classes_from_a_file_need_every_shape_to_agree(monkeypatch):
    """--offline: two tags share a class only if they shared a group in every shape of the
    same BLOCK_K rounding (one random input can miss a difference), norm groups included."""
    bench = _bench(monkeypatch)
    bits = {"qkv": {"groups": [["cublas", "d"], ["v4", "b4", "w2"]], "norm_groups": [["v4", "b4"]]},
            "o": {"groups": [["v4", "b4"], ["w2"]], "norm_groups": [["v4", "b4"]]},
            "gate_up": {"groups": [["v4", "b4"]], "norm_groups": [["v4"], ["b4"]]},
            "fc": {"groups": [["v4", "w2"]]}}                 # another BLOCK_K: not compared
    classes = bench.classes_from_bits(bits)
    assert classes["qkv"]["v4"] != classes["qkv"]["w2"]       # apart in o
    assert classes["qkv"]["v4"] != classes["qkv"]["b4"]       # apart under gate-up's norm
    assert classes["fc"]["v4"] == classes["fc"]["w2"]
    assert classes["qkv"]["d"][1] is None                     # not norm-fusable


def test_norm_probe_rows_sit_on_rounding_midpoints(monkeypatch):
    """The norm kernel's probe rows: in every row some element of x * rsqrt(mean(x^2) +
    eps) rounds to bf16 differently when the RMS moves by a few fp32 ulps (what a
    different summation order of the RMS can do), unlike most randn rows."""
    bench = _bench(monkeypatch)

    def flips(x):
        xd = x.double()
        t = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
        return ((t * (1 + 2.0 ** -22)).bfloat16() != (t * (1 - 2.0 ** -22)).bfloat16()).any(-1)

    x = bench.norm_probe_rows(64, 32, torch.bfloat16)
    assert x.shape == (32, 64) and x.dtype == torch.bfloat16
    assert flips(x).all()
    assert flips(torch.randn(4096, 64).bfloat16()).float().mean() < 0.01


def test_probe_inputs_cancel_in_pairs(monkeypatch):
    """The bit-class probe's second input: every product over K has a partner of opposite
    sign (x, both gate-up halves and the norm weight equal within a pair, w opposite), so
    the exact sum is 0 — for the plain, silu-mul and RMSNorm operands — and what a kernel
    returns is its fp32 partial sums' rounding, which depends on the order."""
    bench = _bench(monkeypatch)
    for n, k, act in ((24, 40, False), (24, 40, True)):
        (x, w, nw), (xp, wp, nwp) = bench.probe_inputs(n, k, act, "cpu", torch.float32, rows=3)
        assert x.shape == xp.shape == (3, 2 * k if act else k) and w.shape == wp.shape == (n, k)
        assert (x[:, :k].double() @ w.double().T).abs().min() > 0   # randn: no pairs
        if act:
            g, u = xp[:, :k], xp[:, k:]
            ops = [(g / (1.0 + torch.exp(-g)) * u)]
        else:
            ops = [xp, xp * torch.rsqrt(xp.pow(2).mean(-1, keepdim=True) + 1e-5) * nwp]
        for a in ops:
            # 0 but for float64's own rounding of the sum (the products are exact there)
            assert (a.double() @ wp.double().T).abs().max() < 1e-12
            assert not torch.equal(a, a.roll(1, -1))             # not trivially constant




def test_bench_tail_compose_chooses_entries_from_a_run(monkeypatch):
    """bench/bench_skinny_tail.py --compose: a shape whose prefix rows were timed gets prefix
    and tail chosen again (here the down GEMM's broadcast rows 2..8 give way to a tl.dot
    tail of F.linear's bits from 2 rows); a shape timed only above its prefix keeps the
    ranges below its first timed row and gets a new tail; a tl.dot configuration that
    missed F.linear's bits at one row count is never a tail; shapes not timed stay."""
    _bench(monkeypatch)
    tail = importlib.import_module("bench_skinny_tail")
    table = dict(_linear.SKINNY_TABLE)
    down = table[(576, 1536, True)]
    ok = lambda us: {"us": us, "cublas": True, "rows": True}          # noqa: E731
    rows = (1, 2, 4, 8, 16, 32)
    down_run = {"shape": "down", "N": 576, "K": 1536,
                "cublas_us": {str(r): 4.0 for r in rows},
                "configs": {down[0][1]: {str(r): {**ok(1.0 if r == 1 else 1.5 + r),
                                                  "cublas": False} for r in rows},
                            "d16x2048s1w8n1": {str(r): ok(2.0) for r in rows},
                            "d32x2048s1w8n1": {str(r): ok(1.0) if r != 4 else
                                               {**ok(1.0), "cublas": False} for r in rows}}}
    gate_up = table[(3072, 576, False)]
    up_rows = (48, 64, 128, 256)
    up_run = {"shape": "gate_up", "N": 3072, "K": 576,
              "cublas_us": {str(r): 4.0 for r in up_rows},
              "configs": {"d128x1024s1w8n1m64": {str(r): ok(3.0 if r <= 128 else 5.0)
                                                 for r in up_rows}}}
    new = tail.compose([down_run, up_run], table)
    # The prefix (its bits need not be F.linear's) at 1 row, d16 from 2 (d32, faster, missed
    # F.linear's bits at 4 rows).
    assert new[(576, 1536, True)] == ((1, down[0][1]), (32, "d16x2048s1w8n1"))
    assert new[(3072, 576, False)] == tuple(r for r in gate_up if r[0] < 48) + \
        ((128, "d128x1024s1w8n1m64"),)
    assert {k: v for k, v in new.items() if k not in ((576, 1536, True), (3072, 576, False))} \
        == {k: v for k, v in table.items() if k not in ((576, 1536, True), (3072, 576, False))}
    _linear.check_table(new)
