"""Chi-square goodness of fit with small bins merged (the samplers issue's statistic)."""

from __future__ import annotations

import math

import torch


def chi2_statistic(samples: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    """(chi2, threshold) of samples [N] (token ids) against p [V]; bins with expected count
    < 5 are merged into one; the threshold is df + 10 * sqrt(2 * df)."""
    obs = torch.bincount(samples, minlength=p.numel()).double()
    exp = p.double() * samples.numel()
    small = exp < 5
    obs = torch.cat([obs[~small], obs[small].sum().reshape(1)])
    exp = torch.cat([exp[~small], exp[small].sum().reshape(1)])
    if exp[-1] == 0:
        obs, exp = (obs, exp.clamp_min(1e-12)) if obs[-1] > 0 else (obs[:-1], exp[:-1])
    df = obs.numel() - 1
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    return chi2, df + 10 * math.sqrt(2 * df)
