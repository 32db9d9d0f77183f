"""Logits -> probabilities (temperature, top-k, top-p, min-p) and exact token sampling."""

from __future__ import annotations

import torch

from ._params import SamplingBatch
from ._rng import uniform


def _per_row(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # [B] -> [B, 1, ..., 1] to broadcast over `like` [B, ..., V].
    return t.reshape(t.shape + (1,) * (like.dim() - 1))


def _sort_mask(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """bool [B, ..., V]: True where top-k or top-p removes the token."""
    # Stable sort: among equal logits the lower id ranks first, like argmax.
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    rank = torch.arange(x.shape[-1], device=x.device)
    k = _per_row(batch.top_k, x)
    drop = (k > 0) & (rank >= k)
    probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix reaching top_p: drop a token once the mass before it does.
    before = torch.cumsum(probs, dim=-1) - probs
    drop = drop | (before >= _per_row(batch.top_p, x))
    drop[..., 0] = False  # the top token always stays
    return torch.zeros_like(drop).scatter_(-1, order, drop)


def compute_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """f32 [B, ..., V] probabilities from logits [B, ..., V], one row of params per B.

    Greedy rows come out one-hot at the argmax (the first one on ties).
    """
    if logits.shape[0] != batch.size:
        raise ValueError(f"compute_probs: logits has {logits.shape[0]} rows, batch has "
                         f"{batch.size}")
    # Subtract the row max first: a tiny temperature then gives -inf, never inf - inf.
    lf = logits.float()
    x = lf - lf.amax(dim=-1, keepdim=True)
    x.mul_(_per_row(batch.temperature.reciprocal(), x))
    if batch.needs_sort:
        x = x.masked_fill(_sort_mask(x, batch), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if batch.needs_min_p:
        floor = _per_row(batch.min_p, probs) * probs.amax(dim=-1, keepdim=True)
        probs = torch.softmax(x.masked_fill(probs < floor, float("-inf")), dim=-1)
    if batch.any_greedy:
        onehot = torch.zeros_like(probs).scatter_(
            -1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(_per_row(batch.is_greedy, probs), onehot, probs)
    return probs


def check_probs(probs: torch.Tensor, name: str, *, atol: float = 1e-3) -> None:
    """Raise ValueError unless every row is finite, >= 0 and sums to 1 within atol."""
    sums = probs.sum(dim=-1)  # NaN/inf anywhere make the sum non-finite
    bad = ~torch.isfinite(sums) | ((sums - 1).abs() > atol)
    if bool(bad.any()):
        row = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"{name}: row {row} sums to {sums[row].item()!r}; rows must be "
                         f"finite probabilities summing to 1 (±{atol})")
    if probs.numel() and float(probs.amin()) < 0:
        raise ValueError(f"{name}: has negative entries; probabilities must be >= 0")


_CHUNK = 256  # two-level search: cumsum is sequential per row, chunk sums are not


def _search(cdf: torch.Tensor, t: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """i64 [N]: first index with cdf > t [N], clamped to the last index with mass.

    t can round up to the total; the clamp keeps a zero-probability index out.
    """
    idx = torch.searchsorted(cdf, t.unsqueeze(-1), right=True).squeeze(-1)
    last = mass.cumsum(dim=-1).argmax(dim=-1)  # first index reaching the full count
    return torch.minimum(idx, last)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """i64 [...]: index drawn with probability weights/sum from weights [..., V] >= 0.

    One uniform u [...] per row, float64 sums. A row with no mass returns 0.
    Works on expanded (stride-0) inputs without copying them.
    """
    V = weights.shape[-1]
    if V % _CHUNK:
        weights = torch.nn.functional.pad(weights, (0, _CHUNK - V % _CHUNK))
    chunks = weights.unflatten(-1, (-1, _CHUNK))  # [..., V/C, C]
    sums = chunks.sum(dim=-1).double()  # [..., V/C]; f32 within a chunk avoids a f64 copy
    chunk_cdf = sums.cumsum(dim=-1)
    t = u * chunk_cdf[..., -1]
    c = _search(chunk_cdf, t, (sums > 0).int())
    # Only the chosen chunk [..., C] gets a sequential cumsum.
    pick = c.reshape(c.shape + (1, 1)).expand(c.shape + (1, _CHUNK))
    inner = chunks.gather(-2, pick).squeeze(-2)
    before = chunk_cdf.gather(-1, (c - 1).clamp_min(0).unsqueeze(-1)).squeeze(-1)
    before = torch.where(c > 0, before, 0.0)
    j = _search(inner.double().cumsum(dim=-1), t - before, (inner > 0).int())
    return c * _CHUNK + j


def sample_tokens(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  stream: int, *, validate: bool = True) -> torch.Tensor:
    """i64 [B, ...] tokens from probs [B, ..., V]; row (b, ...) uses the uniform of
    (seeds[b], positions[b, ...], stream). Rows are normalised implicitly."""
    if positions.shape != probs.shape[:-1]:
        raise ValueError(f"sample_tokens: positions {tuple(positions.shape)} must match "
                         f"probs without vocab {tuple(probs.shape[:-1])}")
    if validate:
        check_probs(probs, "sample_tokens probs", atol=float("inf"))
    return inverse_cdf(probs, uniform(seeds, positions, stream))
