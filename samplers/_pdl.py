"""Programmatic Dependent Launch (PDL) for the Triton kernels of a step: the one switch.

A batch-1 step is a chain of ~200 small kernels, each reading what the one before it
wrote. Launched with PDL (Hopper and later; ``launch_pdl=True``), a kernel's programs may
start while the kernel before it still runs: each program first loads what no earlier
kernel writes (weights), then waits in ``griddepcontrol.wait`` (``gdc_wait``) until the
previous grid has completed and its memory is visible, and only then reads activations
and stores. bench/bench_pdl.py on an H200 (30 layers x 4 decode GEMMs at one row, one CUDA
graph): 8.39 us a layer plain, 7.79 with PDL and the wait first (1.08x), 6.51 with the
weight tile loaded before the wait (1.29x); the same bits in all three.

Every kernel that takes a ``GDC: tl.constexpr`` keeps these rules (the offline sm_90
compile test, tests/models/test_pdl.py, checks them in the PTX):

1. every program executes ``gdc_wait()`` before it loads anything an earlier kernel may
   write (activations, the KV cache, block tables, positions and slots, counters, logits,
   token ids) and before ANY store or atomic: a later kernel must not overwrite memory an
   earlier one still reads (a CUDA graph's pool reuses it);
2. no program returns before its wait: a grid whose programs all skipped it could complete
   before its predecessor, and the kernel after it, which waits only for its own
   predecessor's completion, would then read the earlier kernel's output unfinished
   (each wait covers all earlier kernels only because every grid completes after its own
   wait);
3. before the wait only parameters never written while serving are loaded: linear and
   norm weights, biases (an embedding row is a weight, but its index is a token: after).
   No GDC kernel writes a weight; one written by a kernel launched without PDL (a cast or
   a copy at load time) is complete before: such a kernel lets the next one start only
   when it has completed;
4. ``gdc_launch_dependents()`` at the start is fine: it only lets the next grid be
   scheduled once every program of this one has started (or exited); the next grid still
   waits in its own ``gdc_wait`` for this one's completion and memory flush.

Kernels compiled with GDC True are launched with ``launch_pdl=True`` and only they
(``launch_kw``). Anything else in the step (cuBLAS GEMMs, torch ops, copies) is launched
normally: it starts after the kernel before it has completed, and a PDL kernel after it
waits for its completion, so it stays correct and just does not overlap. CUDA-graph
capture keeps the programmatic edges (bench_pdl measures replays).

On when the device is CUDA (not ROCm) with compute capability >= 9, Triton has
``tl.extra.cuda.gdc_wait``, the interpreter is off (it has no griddepcontrol) and
``SPECLOOP_PDL`` is not "0" (read once, at import: an A/B of whole runs). Off elsewhere
(CPU tensors, older GPUs): the kernels are compiled with GDC False, unchanged.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

# Read once, at import (as the other SPECLOOP_* switches of the kernels).
_ENV_ON = os.environ.get("SPECLOOP_PDL", "1") != "0"
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

OFF: dict[str, Any] = {"GDC": False}
ON: dict[str, Any] = {"GDC": True, "launch_pdl": True}


@functools.cache
def _triton_has_gdc() -> bool:
    try:
        import triton.language as tl
    except ImportError:  # pragma: no cover - depends on the install
        return False
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


@functools.cache
def device_supports(index: int) -> bool:
    """Whether CUDA device ``index`` runs PDL kernels (sm_90+, Triton with gdc_wait, no
    interpreter); the environment switch aside."""
    if _INTERPRET or torch.version.hip is not None or not _triton_has_gdc():
        return False  # ROCm reports gfx9 as capability 9.x: no griddepcontrol there
    return int(torch.cuda.get_device_capability(index)[0]) >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether the kernels launched on ``t``'s device use PDL."""
    return _ENV_ON and t.is_cuda and device_supports(t.get_device())


def launch_kw(t: torch.Tensor) -> dict[str, Any]:
    """The launch keywords of a GDC kernel on ``t``'s device: ``GDC`` (the constexpr) and,
    when it is True, ``launch_pdl=True`` with it; never one without the other. (Shared
    dicts, not to be modified; a launch only unpacks them.)"""
    return ON if enabled(t) else OFF
