"""Pearson chi-square goodness of fit, shared by the distribution tests and ``certify``.

Bins of expected count < 5 are merged into one tail bin (and that bin, if still < 5, into
the smallest other bin), so the statistic's chi-square approximation holds. The threshold
df + 10 * sqrt(2 * df) is the mean plus ten standard deviations of a chi-square with df
degrees of freedom: a correct sampler essentially never fails it, a biased one must be
sized (trials) so that it does, which a wrong-parameter control checks.
"""

from __future__ import annotations

import math

import attrs
import torch

MIN_EXPECTED = 5.0


@attrs.frozen
class Chi2Result:
    statistic: float
    df: int
    threshold: float
    num_samples: int

    @property
    def passed(self) -> bool:
        return self.statistic < self.threshold

    def as_dict(self) -> dict[str, object]:
        return {"statistic": round(self.statistic, 3), "df": self.df,
                "threshold": round(self.threshold, 3), "num_samples": self.num_samples,
                "verdict": "pass" if self.passed else "fail"}


def chi2_threshold(df: int) -> float:
    return df + 10 * math.sqrt(2 * df)


def chi2_counts(observed: torch.Tensor, expected: torch.Tensor) -> Chi2Result:
    """observed [V] counts against expected [V] counts (same total). ``expected`` may be a
    sum of per-sample distributions (conditional test): the statistic is then at most as
    spread as a chi-square, so the threshold stays conservative."""
    obs, exp = observed.double().flatten(), expected.double().flatten()
    # A token the distribution rules out (expected exactly 0) must never be drawn.
    impossible = bool((obs[exp <= 0] > 0).any())
    obs, exp = obs[exp > 0], exp[exp > 0]
    small = exp < MIN_EXPECTED
    obs = torch.cat([obs[~small], obs[small].sum().reshape(1)])
    exp = torch.cat([exp[~small], exp[small].sum().reshape(1)])
    if exp[-1] < MIN_EXPECTED and exp.numel() > 1:
        # The tail is still small (or empty): fold it into the smallest proper bin.
        j = int(exp[:-1].argmin())
        obs[j] += obs[-1]
        exp[j] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    df = max(obs.numel() - 1, 1)
    statistic = math.inf if impossible else float(((obs - exp) ** 2 / exp).sum())
    return Chi2Result(statistic, df, chi2_threshold(df), int(observed.sum()))


def chi2_samples(samples: torch.Tensor, p: torch.Tensor) -> Chi2Result:
    """Token ids [N] drawn i.i.d. against the distribution p [V]."""
    observed = torch.bincount(samples.flatten(), minlength=p.numel())
    return chi2_counts(observed, p.double() * samples.numel())


def chi2_statistic(samples: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    """(chi2, threshold) of samples [N] against p [V]."""
    result = chi2_samples(samples, p)
    return result.statistic, result.threshold
