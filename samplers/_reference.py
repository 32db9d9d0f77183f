"""A straightforward per-row reference of rejection_sample, for tests and the benchmark.

Same algorithm and the same counter-based noise, written row by row with Python scalars,
so the vectorised version can be checked token for token against it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._probs import inverse_cdf
from ._rejection import RejectionResult
from ._rng import Stream, uniform


def _coin(seed: int, pos: int, stream: Stream) -> float:
    return float(uniform(torch.tensor([seed]), torch.tensor([pos]), stream)[0])


def _draw(row: torch.Tensor, u: float) -> int:
    return int(inverse_cdf(row.unsqueeze(0), torch.tensor([u], dtype=torch.float64))[0])


def _probs_at(d: Tensor, target: Tensor, draft: Tensor | None, b: int, i: int
              ) -> tuple[float, float]:
    x = int(d[b, i])
    if not 0 <= x < target.shape[-1]:
        return 0.0, 1.0
    return float(target[b, i, x]), 1.0 if draft is None else float(draft[b, i, x])


def _token_tau(d: Tensor, target: Tensor, draft: Tensor | None, b: int, seed: int, L: int
               ) -> int:
    for i in range(d.shape[1]):
        p, q = _probs_at(d, target, draft, b, i)
        if not (p > 0 and _coin(seed, L + i, Stream.ACCEPT) * q <= p):
            return i
    return int(d.shape[1])


def _block_tau(d: Tensor, target: Tensor, draft: Tensor | None, b: int, seed: int, L: int
               ) -> tuple[int, float]:
    K = d.shape[1]
    w = [1.0]
    for i in range(K):
        p, q = _probs_at(d, target, draft, b, i)
        ratio = (p / q if q > 0 else float("inf")) if p > 0 else 0.0
        w.append(min(1.0, w[-1] * ratio) if w[-1] > 0 else 0.0)
    for i in range(K, 0, -1):
        if i == K:
            h = w[K]
        else:
            if draft is None:
                r = w[i] * (1 - _probs_at(d, target, draft, b, i)[0])
            else:
                deficit = torch.addcmul(draft[b, i], target[b, i],
                                        torch.tensor(w[i], dtype=target.dtype), value=-1)
                r = -float(deficit.clamp_max(0).sum())
            den = r + 1 - w[i]
            h = r / den if den > 0 else 1.0
        if _coin(seed, L + i - 1, Stream.ACCEPT) <= h:
            return i, w[i]
    return 0, 1.0


def _recover(d: Tensor, target: Tensor, draft: Tensor | None, b: int, tau: int, w: float,
             seed: int, L: int) -> int:
    K = d.shape[1]
    p = target[b, tau]
    if tau == K:
        return _draw(p, _coin(seed, L + tau, Stream.BONUS))
    wp = torch.tensor(w, dtype=target.dtype) * p
    if draft is None:
        resid = wp.clone()
        resid[int(d[b, tau]) % p.shape[0]] = 0.0
    else:
        resid = torch.addcmul(-draft[b, tau], torch.tensor(w, dtype=target.dtype), p)
        resid = resid.clamp_min(0)
    if not bool(resid.sum() > 0):
        resid = p
    return _draw(resid, _coin(seed, L + tau, Stream.RESIDUAL))


def reference_rejection_sample(draft_token_ids: Tensor, target_probs: Tensor,
                               draft_probs: Tensor | None = None, *, seeds: Tensor,
                               positions: Tensor, method: str = "token"
                               ) -> RejectionResult:
    d = draft_token_ids
    B, K = d.shape
    out = torch.full((B, K + 1), -1, dtype=torch.int64)
    num = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        seed, L = int(seeds[b]), int(positions[b])
        if method == "token":
            tau, w = _token_tau(d, target_probs, draft_probs, b, seed, L), 1.0
        else:
            tau, w = _block_tau(d, target_probs, draft_probs, b, seed, L)
        out[b, :tau] = d[b, :tau]
        out[b, tau] = _recover(d, target_probs, draft_probs, b, tau, w, seed, L)
        num[b] = tau
    return RejectionResult(token_ids=out, num_accepted=num)
