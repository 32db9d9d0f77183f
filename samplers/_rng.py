"""Counter-based randomness: a uniform is a pure hash of (seed, position, stream, index).

No generator state anywhere, so a row's draws do not depend on batch composition, row
order, padding, rank placement or graph replay. All arithmetic is on 32-bit lanes held in
int64 tensors, with multipliers below 2**31, so no product overflows int64 (signed
overflow is undefined in C++, and torch kernels are C++): the same bits on CPU and CUDA.
"""

from __future__ import annotations

import enum

import torch

_M32 = 0xFFFFFFFF
# Two independent hash chains (different start values) give 64 random bits per uniform.
_CHAIN_STARTS = (0x243F6A88, 0x13198A2E)
_MANTISSA_BITS = 52


class Stream(enum.IntEnum):
    """Independent noise streams; sharing one between draft and accept biases the output."""

    DRAFT = 1
    ACCEPT = 2
    RESIDUAL = 3
    BONUS = 4


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A 2-round xorshift-multiply permutation of [0, 2**32) (hash-prospector constants,
    # both < 2**31 so x * c < 2**63).
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def _words(seeds: torch.Tensor, positions: torch.Tensor, stream: int | torch.Tensor,
           index: torch.Tensor | int) -> list[torch.Tensor]:
    # seeds [B] broadcast against positions [B, ...]; position high bits share a word with
    # the stream id (positions < 2**56, streams < 256).
    s = seeds.reshape(seeds.shape + (1,) * (positions.dim() - 1))
    pos_hi = ((positions >> 32) & 0xFFFFFF) << 8
    stream = stream if isinstance(stream, torch.Tensor) else int(stream)
    return [s & _M32, (s >> 32) & _M32, positions & _M32, pos_hi | stream, index & _M32]


def random_bits(seeds: torch.Tensor, positions: torch.Tensor, stream: int | torch.Tensor,
                index: torch.Tensor | int = 0) -> torch.Tensor:
    """Two 32-bit hashes of the counter: int64 [2, *positions.shape] with values < 2**32."""
    if seeds.dtype != torch.int64 or positions.dtype != torch.int64:
        raise ValueError(f"uniform: seeds and positions must be int64, got {seeds.dtype} "
                         f"and {positions.dtype}")
    if seeds.dim() != 1 or positions.dim() < 1 or positions.shape[0] != seeds.shape[0]:
        raise ValueError(f"uniform: seeds [B] and positions [B, ...] expected, got "
                         f"{tuple(seeds.shape)} and {tuple(positions.shape)}")
    # No host-to-device copies (CUDA graph capture forbids them): a Python int index stays
    # a scalar, and the two chain starts come from a device-side arange.
    first, second = _CHAIN_STARTS
    starts = first + (second - first) * torch.arange(2, device=positions.device)
    h = starts.reshape((2,) + (1,) * positions.dim())  # [2, 1...]: both chains at once
    for w in _words(seeds, positions, stream, index):
        h = _mix32(h ^ w)
    return h


def uniform(seeds: torch.Tensor, positions: torch.Tensor, stream: int | torch.Tensor,
            index: torch.Tensor | int = 0) -> torch.Tensor:
    """f64 [B, ...] in the open interval (0, 1), a pure function of its arguments.

    seeds [B] i64, positions [B, ...] i64, stream a `Stream` (or an i64 tensor of them
    broadcastable to positions), index (likewise) for several draws at one position.
    """
    h = random_bits(seeds, positions, stream, index)
    k = (h[0] << 20) | (h[1] >> 12)  # 52 random bits
    # (k + 0.5) / 2**52: never 0, at most 1 - 2**-53 (exactly representable, so never 1).
    return (k.to(torch.float64) + 0.5) * (2.0 ** -_MANTISSA_BITS)


def derive_seed(base_seed: int, request_index: int) -> int:
    """A seed in [0, 2**63) for an unseeded request: the engine calls it at admission."""
    seeds = torch.tensor([base_seed & (2**63 - 1)], dtype=torch.int64)
    pos = torch.tensor([request_index & (2**56 - 1)], dtype=torch.int64)
    h = random_bits(seeds, pos, 0)[:, 0].tolist()
    return int(((h[0] << 31) | (h[1] >> 1)) & (2**63 - 1))
