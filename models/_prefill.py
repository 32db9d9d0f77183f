"""The padded shapes of prefill forwards on a GPU (the target's and a draft head's).

A prefill forward there runs at (rows, tokens per row) each rounded up to a power of two
(tokens at least MIN_PREFILL_WIDTH), within the prefill token budget, and replays the CUDA
graph captured for that shape at warm-up (engine/_runner.py, engine/_warmup.py): an eager
forward costs ~10 ms of kernel launches on the H200 for under 1 ms of GPU work, at any
shape. Eager forwards pad the same way, so the two compute the same thing.
"""

from __future__ import annotations

MIN_PREFILL_WIDTH = 16
Shape = tuple[int, int]     # (rows, tokens per row)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def padded_shape(rows: int, width: int) -> Shape:
    return _pow2(rows), max(_pow2(width), MIN_PREFILL_WIDTH)


def prefill_shapes(max_rows: int, max_tokens: int) -> list[Shape]:
    """Every padded shape a prefill may run at: powers of two, rows at most ``max_rows``'
    power of two, rows x width at most ``max_tokens`` (a single row up to the power of
    two of ``max_tokens``: a chunk of ``max_tokens`` tokens)."""
    shapes, width = [], MIN_PREFILL_WIDTH
    while width <= max(_pow2(max_tokens), MIN_PREFILL_WIDTH):
        rows = 1
        while rows <= _pow2(max_rows) and (rows == 1 or rows * width <= max_tokens):
            shapes.append((rows, width))
            rows *= 2
        width *= 2
    return shapes
