"""Stateless building blocks of the decoder: RMSNorm, rotary tables and their application."""

from __future__ import annotations

import math

import torch

from ._args import ModelArgs


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] -> [..., H]; normalised in fp32 like the reference implementation."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rope_inv_freq(args: ModelArgs, device: torch.device | str = "cpu") -> torch.Tensor:
    """Inverse frequencies f32 [head_dim/2], llama3-scaled when configured."""
    dim = args.head_dim
    exps = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv = 1.0 / (args.rope_theta**exps)
    s = args.rope_scaling
    if s is None:
        return inv
    old_len = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / s.low_freq_factor, old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    args: ModelArgs, max_len: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, head_dim] in ``dtype``, rows indexed by absolute position."""
    inv = rope_inv_freq(args, device)
    pos = torch.arange(max_len, dtype=torch.int64, device=device).float()
    freqs = pos[:, None] * inv[None, :]  # [max_len, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, N, D], cos/sin [B, T, 1, D] -> rotated [B, T, N, D] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
