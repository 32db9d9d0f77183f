"""CPU matmuls over a few rows (VERIFY's K+1 tokens, a draft head's catch-up) on weights
prepacked for oneDNN.

A decode step's matmuls are bound by reading the weights once, whatever the rows. On x86
CPUs (MKL, fp32) the 1-row product runs at that bound (gemv), but 2-32 rows go through
sgemm at 1.5-2.5x its cost: SmolLM2's LM head [49152, 576], one thread, 8.2 ms for 1 row,
20.5 ms for 4, 24.6 ms for 8 — so verifying K+1 tokens cost about twice a decode step,
which ate most of what speculation saves on the CPU. oneDNN's kernel on a weight reordered
once into its blocked layout takes 10.1 ms for 4 rows and 14.3 ms for 8 (bench figures in
docs/performance.md, "On the CPU"). Outside that window (1 row; prefill chunks over 32
rows; CUDA; autograd) this is ``F.linear`` itself, so a decode step without speculation is
bit-for-bit what it was (short prompts' prefill now runs packed: fp32 rounding-level
differences, as between any two GEMM kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows (all leading dims) for which the packed kernel beats MKL (measured 2..32; from 64
# rows on both cost the same, and long prefill chunks keep MKL's numerics).
MIN_ROWS, MAX_ROWS = 2, 32


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_linear_pointwise")


class PackedLinear:
    """``F.linear`` that, for CPU float32 inputs of MIN_ROWS..MAX_ROWS rows outside
    autograd, multiplies by a oneDNN-packed copy of the weight, packed on first use.

    One cache per model (no module-level state). An entry holds the weight view it was
    packed from, so its storage stays alive and its address cannot be reused by another
    tensor; the weight's version counter (bumped by every in-place write: load, copy_, an
    optimizer step) must still match, or the weight is repacked.
    """

    def __init__(self, *, enabled: bool | None = None) -> None:
        self.enabled = packing_available() if enabled is None else enabled
        # (data_ptr, shape, stride) -> (the weight, its version when packed, the packing)
        self._packed: dict[tuple[int, tuple[int, ...], tuple[int, ...]],
                           tuple[torch.Tensor, int, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self._applies(x, weight, bias):
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._pack(weight), bias, "none", [], "")

    def _applies(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> bool:
        if not self.enabled or x.device.type != "cpu" or x.dtype != torch.float32 \
                or weight.dtype != torch.float32 or weight.dim() != 2 \
                or weight.is_inference():    # no version counter to notice a rewrite
            return False
        rows = x.numel() // max(x.shape[-1], 1)
        if not MIN_ROWS <= rows <= MAX_ROWS:
            return False
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                        (bias is not None and bias.requires_grad)):
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
        return PackedLinear(enabled=self.enabled)

    def __getstate__(self) -> dict[str, object]:
        return {"enabled": self.enabled, "_packed": {}}
