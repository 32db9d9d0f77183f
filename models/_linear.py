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
differences, as between any two GEMM kernels).

On CUDA (bf16/fp16, 1..SKINNY_MAX_ROWS rows, outside autograd). cuBLAS's tiles for so few
rows leave most SMs idle (an H200 at batch 1: 3.7-3.9 us per SmolLM2 GEMM, whose weights
stream in ~0.3-1.5 us); ``models/_skinny``'s kernel splits N (and optionally K) finely.
Which configuration runs per (N, K) (one for every row count, so a row's bits do not depend
on the batch bucket) is SKINNY_TABLE, filled from ``bench/bench_skinny_gemm.py`` on the
H200 (it prints the literal); shapes not in it get ``default_config``'s guess. ``SPECLOOP_SKINNY=0`` in the environment (or ``skinny =
False`` on a dispatcher, e.g. ``DecoderModel.linear``) keeps cuBLAS everywhere.
``norm_linear`` also takes the fused layer's residual add + RMSNorm into the GEMM's
prologue where the configuration allows (``skinny_norm``; ``SPECLOOP_SKINNY_NORM=0`` turns
it off).
"""

from __future__ import annotations

import functools
import json
import os
import re

import torch
import torch.nn.functional as F

from . import _skinny
from ._skinny import SkinnyConfig

# Rows (all leading dims) for which the packed kernel beats MKL (measured 2..32; from 64
# rows on both cost the same, and long prefill chunks keep MKL's numerics).
MIN_ROWS, MAX_ROWS = 2, 32

# Rows for which the skinny kernel may run on CUDA.
SKINNY_MAX_ROWS = 32

# (N, K, silu_mul) -> (config tag, max rows), or None for F.linear. The tags are
# SkinnyConfig.tag()'s (``d16x128s2w4n3``: tl.dot, BLOCK_N 16, BLOCK_K 128, SPLIT_K 2, 4
# warps, 3 stages; ``v``: no tl.dot, rows reduced one after the other; ``b4x2x1024...``: no
# tl.dot, blocks of 4 rows reduced in one reduction, for VERIFY's 2-8 rows). One
# configuration per shape for every row count up to ``max rows`` (F.linear beyond): the
# kernel gives a row the same bits whatever the number of rows in the call, so a graph
# padded to a larger batch bucket (or a chained step taken at one) equals the unpadded
# call. A shape missing from the table uses default_config up to SKINNY_MAX_ROWS rows.
# SmolLM2-135M's and its EAGLE-3 head's, measured on one H200 (2026-12-01 09:47, torch
# 2.11, Triton 3.6; bench/bench_skinny_gemm.py prints the literal to paste here). Its
# chooser weighs rows 1, 2, 4 and 8 alike: the b configurations give up ~1 us a layer at
# 1 row (decode) against the v ones for ~4 us at 4 (VERIFY at batch 1, K = 3).
SKINNY_TABLE: dict[tuple[int, int, bool], tuple[str, int] | None] = {
    (960, 576, False): ('b2x2x1024s1w2n3', 8),
    (576, 576, False): ('b2x2x1024s1w2n3', 16),
    (3072, 576, False): ('v4x1024s1w4n3', 2),
    (576, 1536, True): ('b2x2x2048s1w8n3', 4),
    (576, 1728, False): ('b2x4x2048s1w8n3', 8),
    (576, 1152, False): ('b2x4x2048s1w8n3', 8),
    (16384, 576, False): None,
    (49152, 576, False): ('d64x64s1w4n3', 2),
}


def _table_from_file(path: str) -> dict[tuple[int, int, bool], tuple[str, int] | None]:
    """A table measured on this machine (``SPECLOOP_SKINNY_TABLE``: the JSON file
    bench/bench_skinny_gemm.py writes, {"N,K,silu": [tag, max rows] | null}), so a new
    device's configurations are tried without editing the code; it replaces the shipped
    table."""
    with open(path) as f:
        raw = json.load(f)
    table: dict[tuple[int, int, bool], tuple[str, int] | None] = {}
    for key, entry in raw.items():
        n, k, silu = key.split(",")
        table[(int(n), int(k), silu.strip().lower() in ("1", "true"))] = \
            None if entry is None else (str(entry[0]), int(entry[1]))
    return table


if os.environ.get("SPECLOOP_SKINNY_TABLE"):
    SKINNY_TABLE = _table_from_file(os.environ["SPECLOOP_SKINNY_TABLE"])

_TAG = re.compile(r"(?:([dv])|b(\d+)x)(\d+)x(\d+)s(\d+)w(\d+)n(\d+)")


@functools.lru_cache(maxsize=None)     # a table's few tags, looked up on every call
def parse_config(tag: str) -> SkinnyConfig:
    """SkinnyConfig.tag()'s inverse."""
    m = _TAG.fullmatch(tag)
    if m is None or m.group(2) is not None and int(m.group(2)) < 1:
        raise ValueError(f"not a skinny config tag: {tag!r}")
    d, tile_m, *ints = m.groups()
    bn, bk, split, warps, stages = map(int, ints)
    return SkinnyConfig(d == "d", bn, bk, split, warps, stages, int(tile_m or 0))


def default_config(n: int, k: int) -> SkinnyConfig:
    """A guess for shapes the table lacks: no tl.dot, all of K in one pass (BLOCK_K = K
    rounded up to a power of two, up to 4096; such a pass is not software-pipelined, so a
    loop over K would cost a memory latency a pass), BLOCK_N as large as keeps the tile of
    W within ~64 fp32 registers a thread (1..8 rows of W)."""
    bk = min(4096, max(16, 1 << max(0, (k - 1).bit_length())))
    return SkinnyConfig(False, max(1, min(8, 64 * 32 * 4 // bk)), bk)


def skinny_config(rows: int, n: int, k: int, silu_mul: bool = False) -> SkinnyConfig | None:
    """The configuration for ``rows`` x [N, K] (the same for every row count it covers),
    or None where F.linear runs (the table says cuBLAS, or more rows than it covers)."""
    if not 1 <= rows <= SKINNY_MAX_ROWS:
        return None
    key = (n, k, silu_mul)
    if key not in SKINNY_TABLE:
        return default_config(n, k)
    entry = SKINNY_TABLE[key]
    if entry is None or rows > entry[1]:
        return None
    return parse_config(entry[0])


def _under_autograd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                    ) -> bool:
    """The product is recorded for backward (training): F.linear's, not a kernel's."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                        (bias is not None and bias.requires_grad))


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_linear_pointwise")


def skinny_available() -> bool:
    """The skinny kernel may run: Triton imports and ``SPECLOOP_SKINNY`` is not 0."""
    return _skinny.available() and os.environ.get("SPECLOOP_SKINNY", "1") != "0"


class PackedLinear:
    """``F.linear`` that, for CPU float32 inputs of MIN_ROWS..MAX_ROWS rows outside
    autograd, multiplies by a oneDNN-packed copy of the weight, packed on first use
    (``enabled``), and for CUDA bf16/fp16 inputs of 1..SKINNY_MAX_ROWS rows runs the
    skinny-GEMM kernel (``skinny``; configurations from SKINNY_TABLE).

    One cache per model (no module-level state). An entry holds the weight view it was
    packed from, so its storage stays alive and its address cannot be reused by another
    tensor; the weight's version counter (bumped by every in-place write: load, copy_, an
    optimizer step) must still match, or the weight is repacked.
    """

    def __init__(self, *, enabled: bool | None = None, skinny: bool | None = None) -> None:
        self.enabled = packing_available() if enabled is None else enabled
        self.skinny = skinny_available() if skinny is None else skinny
        # The RMSNorm before a GEMM in its prologue too (norm_linear); SPECLOOP_SKINNY_NORM=0
        # keeps the separate norm kernels (H200, batch 1: 1,332 -> 1,578 tok/s with it).
        self.skinny_norm = self.skinny and os.environ.get("SPECLOOP_SKINNY_NORM", "1") != "0"
        # Tests: the skinny kernel also on CPU tensors (Triton's interpreter runs it there).
        self.skinny_on_cpu = False
        # (data_ptr, shape, stride) -> (the weight, its version when packed, the packing)
        self._packed: dict[tuple[int, tuple[int, ...], tuple[int, ...]],
                           tuple[torch.Tensor, int, torch.Tensor]] = {}

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
        skinny kernel where it runs, else the fused path's silu_mul kernel and this
        dispatcher (the MLP's down projection of ``DecoderModel._fused_layer``)."""
        config = self._skinny_config(gate_up, weight, None, silu_mul=True)
        if config is not None:
            return _skinny.skinny_linear(gate_up, weight, None, config, silu_mul=True)
        from . import _kernels  # noqa: PLC0415  (Triton: the fused path's module)
        return self(_kernels.silu_mul(gate_up), weight)

    def norm_linear(self, x: torch.Tensor, delta: torch.Tensor | None,
                    norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None = None, capture: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (rms_norm(x + delta, norm_weight) @ weight^T (+ bias), x + delta): the fused
        layer's residual add + RMSNorm and the GEMM after it (``_kernels.add_rms_norm``'s
        contract: delta None, no add; ``capture`` also receives x + delta). One skinny
        kernel where ``skinny_norm`` is on and the GEMM's configuration takes K in one pass
        without tl.dot; else the norm kernel, then this dispatcher."""
        if self.skinny_norm and norm_weight.dim() == 1 and \
                (delta is None or delta.dtype == x.dtype and delta.shape == x.shape):
            config = self._skinny_config(x, weight, bias, silu_mul=False)
            if config is not None and _skinny.norm_fusable(config, weight.shape[1]):
                return _skinny.skinny_norm_linear(x, delta, norm_weight, eps, weight, bias,
                                                  config, capture)
        from . import _kernels  # noqa: PLC0415  (Triton: the fused path's module)
        h, stream = _kernels.add_rms_norm(x, delta, norm_weight, eps, capture)
        return self(h, weight, bias), stream

    def _skinny_config(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       *, silu_mul: bool) -> SkinnyConfig | None:
        if not self.skinny or x.dtype not in (torch.bfloat16, torch.float16) \
                or weight.dtype != x.dtype or weight.dim() != 2 or weight.stride(1) != 1 \
                or not (x.device.type == "cuda" or self.skinny_on_cpu and x.device.type == "cpu"):
            return None
        if bias is not None and (bias.dtype != x.dtype or bias.dim() != 1 or bias.stride(0) != 1):
            return None
        n, k = weight.shape
        if x.shape[-1] != (2 * k if silu_mul else k):
            return None
        if _under_autograd(x, weight, bias):
            return None
        return skinny_config(x.numel() // max(x.shape[-1], 1), n, k, silu_mul)

    def _applies(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> bool:
        if not self.enabled or x.device.type != "cpu" or x.dtype != torch.float32 \
                or weight.dtype != torch.float32 or weight.dim() != 2 \
                or weight.is_inference():    # no version counter to notice a rewrite
            return False
        rows = x.numel() // max(x.shape[-1], 1)
        if not MIN_ROWS <= rows <= MAX_ROWS:
            return False
        if _under_autograd(x, weight, bias):
            return False
        return bias is None or bias.dtype == torch.float32

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
        return clone

    def __getstate__(self) -> dict[str, object]:
        return {"enabled": self.enabled, "skinny": self.skinny, "skinny_norm": self.skinny_norm,
                "skinny_on_cpu": self.skinny_on_cpu, "_packed": {}}
