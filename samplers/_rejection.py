"""Exact rejection sampling of K drafts against the target, token-wise or block-wise.

Token-wise (Leviathan et al. 2023): accept d_i with min(1, p(d_i)/q(d_i)); at the first
rejection sample normalize((p - q)+); if all K pass, a bonus token from p at K.
Block-wise (Sun et al. 2024, arXiv 2403.10444): weights w_i = min(1, w_{i-1} p/q),
stop probabilities h_i = r_i / (r_i + 1 - w_i) with r_i = sum (w_i p - q)+ at the next
position (h_K = w_K); keep the longest prefix tau whose coin passes, then sample
normalize((w_tau p - q)+) at tau, or the bonus when tau = K. Both are vectorised over B;
only K is looped.

Noise: the acceptance coin of draft i uses Stream.ACCEPT at position L+i, the recovered
token Stream.RESIDUAL and the bonus Stream.BONUS at L+tau.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from . import _triton_rejection
from ._probs import check_probs, inverse_cdf
from ._rng import Stream, uniform

METHODS = ("token", "block")


@attrs.frozen(eq=False)
class RejectionResult:
    token_ids: torch.Tensor  # [B, K+1] i64: accepted drafts, recovered/bonus, then -1
    num_accepted: torch.Tensor  # [B] i64


def _check_shapes(d: Tensor, target: Tensor, draft: Tensor | None, seeds: Tensor,
                  positions: Tensor, method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"rejection_sample: method={method!r}; use one of {METHODS}")
    if d.dtype != torch.int64 or d.dim() != 2:
        raise ValueError(f"rejection_sample: draft_token_ids must be int64 [B, K], got "
                         f"{d.dtype} {tuple(d.shape)}")
    B, K = d.shape
    if target.dim() != 3 or tuple(target.shape[:2]) != (B, K + 1):
        raise ValueError(f"rejection_sample: target_probs must be [B, K+1, V] = "
                         f"[{B}, {K + 1}, V], got {tuple(target.shape)}")
    if not target.is_floating_point():
        raise ValueError(f"rejection_sample: target_probs must be floating, got {target.dtype}")
    if draft is not None and (draft.shape != (B, K, target.shape[2])
                              or draft.dtype != target.dtype):
        raise ValueError(f"rejection_sample: draft_probs must be {target.dtype} "
                         f"[{B}, {K}, {target.shape[2]}], got {draft.dtype} "
                         f"{tuple(draft.shape)}")
    for name, t in (("seeds", seeds), ("positions", positions)):
        if t.dtype != torch.int64 or tuple(t.shape) != (B,):
            raise ValueError(f"rejection_sample: {name} must be int64 [{B}], got "
                             f"{t.dtype} {tuple(t.shape)}")


def _check_values(d: Tensor, target: Tensor, draft: Tensor | None, q_d: Tensor) -> None:
    V = target.shape[-1]
    if d.numel() and (int(d.min()) < 0 or int(d.max()) >= V):
        raise ValueError(f"rejection_sample: draft_token_ids outside the vocab [0, {V}): "
                         f"min {int(d.min())}, max {int(d.max())}")
    check_probs(target, "rejection_sample target_probs")
    if draft is not None:
        check_probs(draft, "rejection_sample draft_probs")
        if bool((q_d <= 0).any()):
            b, i = (q_d <= 0).nonzero()[0].tolist()
            raise ValueError(f"rejection_sample: draft_probs[{b}, {i}] is 0 at the drafted "
                             f"token {int(d[b, i])}; q must be the distribution the draft "
                             "was sampled from (pass None for point-mass drafts)")


def _validate(d: Tensor, target: Tensor, draft: Tensor | None) -> None:
    d_safe = d.clamp(0, target.shape[-1] - 1).unsqueeze(2)
    q_d = None if draft is None else draft.gather(2, d_safe).squeeze(2)
    _check_values(d, target, draft, q_d)


def _token_accept(p_d: Tensor, q_d: Tensor, u: Tensor) -> Tensor:
    """[B]: leading drafts whose coin u [B,K] passes u <= p/q (p > 0 keeps p = 0 out)."""
    ok = (u * q_d <= p_d) & (p_d > 0)
    return ok.long().cumprod(dim=-1).sum(dim=-1)


def _block_weights(p_d: Tensor, q_d: Tensor) -> Tensor:
    """f64 [B, K+1]: w_0 = 1, w_i = min(1, w_{i-1} p(d_i)/q(d_i)); q = 0 < p counts as inf."""
    ratio = torch.where(p_d > 0, p_d / q_d, 0.0)
    w = [torch.ones_like(p_d[:, 0])]
    for i in range(p_d.shape[1]):
        w.append(torch.where(w[-1] > 0, torch.clamp(w[-1] * ratio[:, i], max=1.0), 0.0))
    return torch.stack(w, dim=1)


def _residual_mass(p: Tensor, q: Tensor | None, p_d: Tensor, w: Tensor) -> Tensor:
    """f64 [B, J]: sum_x (w p(x) - q(x))+ over rows p, q [B, J, V]; q None = point mass
    at the draft, whose mass is then w (1 - p(d)) since w p(d) <= 1."""
    if q is None:
        return w * (1 - p_d)
    # q - w p, clamped at 0 from above: minus the excess, without a negation pass.
    deficit = torch.addcmul(q, p, w.to(p.dtype).unsqueeze(-1), value=-1).clamp_max_(0)
    return -deficit.sum(dim=-1).double()


def _block_accept(target: Tensor, draft: Tensor | None, p_d: Tensor, q_d: Tensor, eta: Tensor
                  ) -> tuple[Tensor, Tensor]:
    """(tau [B] i64, w_tau [B] f64) for block verification; eta [B, K] are the coins."""
    B, K = p_d.shape
    w = _block_weights(p_d, q_d)
    h = w[:, 1:].clone()  # h_K = w_K; h_1..h_{K-1} below
    if K > 1:
        q_next = None if draft is None else draft[:, 1:K]
        r = _residual_mass(target[:, 1:K], q_next, p_d[:, 1:], w[:, 1:K])
        den = r + 1 - w[:, 1:K]
        # den = 0 needs w = 1 and p = q at the next position; h_{i+1} = 1 then, so
        # stopping at i never happens and any value is exact.
        h[:, :K - 1] = torch.where(den > 0, r / den.clamp_min(1e-300), 1.0)
    steps = torch.arange(1, K + 1, device=p_d.device)
    tau = ((eta <= h) * steps).amax(dim=-1)
    return tau, w.gather(1, tau.unsqueeze(1)).squeeze(1)


def _recovery_rows(target: Tensor, draft: Tensor | None, d_safe: Tensor, tau: Tensor,
                   weight: Tensor) -> Tensor:
    """[B, V]: (w p - q)+ at tau (not normalised; inverse_cdf scales), or p when tau = K."""
    B, K1, V = target.shape
    rows = torch.arange(B, device=target.device)
    p = _take_rows(target, tau)
    if K1 == 1:
        return p
    at = tau.clamp(max=K1 - 2)
    bonus = (tau == K1 - 1).unsqueeze(1)
    w = torch.where(bonus, 1.0, weight.to(p.dtype).unsqueeze(1))  # the bonus row is p
    if draft is None:
        # q is a point mass at the draft: (w p - q)+ is w p with the draft zeroed.
        wp, idx = w * p, d_safe[rows, at].unsqueeze(1)
        resid = wp.scatter_(1, idx, wp.gather(1, idx) * bonus)
    else:
        # -q on rejected rows, 0 on bonus rows, in one pass.
        neg_q = _take_rows(draft, at).mul_(torch.where(bonus, 0.0, -1.0))
        resid = torch.addcmul(neg_q, w, p).clamp_min_(0)
    # A residual with no mass is reached only through rounding; p keeps it defined.
    empty = resid.sum(dim=1) <= 0
    if resid.device.type == "cpu" and not bool(empty.any()):
        return resid  # the usual case; on CPU the check costs no device sync
    return torch.where(empty.unsqueeze(1), p, resid)


def _take_rows(probs: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """[B, V] copy of probs[b, at[b]] from probs [B, J, V]."""
    B, J, V = probs.shape
    if probs.is_contiguous():  # index_select copies whole rows, much faster than indexing
        rows = torch.arange(B, device=probs.device) * J + at
        return probs.view(B * J, V).index_select(0, rows)
    return probs[torch.arange(B, device=probs.device), at]


def _finish(target: Tensor, draft: Tensor | None, d: Tensor, d_safe: Tensor, tau: Tensor,
            weight: Tensor, seeds: Tensor, positions: Tensor) -> Tensor:
    """[B, K+1] tokens: d_1..d_tau, the recovered or bonus token, then -1."""
    B, K1, _ = target.shape
    pos = positions + tau
    bonus = tau == K1 - 1
    u = uniform(seeds, pos, torch.where(bonus, int(Stream.BONUS), int(Stream.RESIDUAL)))
    tok = inverse_cdf(_recovery_rows(target, draft, d_safe, tau, weight), u)
    steps = torch.arange(K1, device=d.device)
    d_pad = torch.nn.functional.pad(d, (0, 1), value=-1)
    out = torch.where(steps < tau.unsqueeze(1), d_pad, -1)
    return out.scatter_(1, tau.unsqueeze(1), tok.unsqueeze(1))


def rejection_sample(draft_token_ids: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None = None, *, seeds: torch.Tensor,
                     positions: torch.Tensor, method: str = "token",
                     validate: bool = True) -> RejectionResult:
    """Verify drafts [B, K] against target_probs [B, K+1, V] and draft_probs [B, K, V]
    (None: point-mass drafts, accepted with probability p(d)).

    positions [B] is the position of the first draft. validate=True raises ValueError on
    ids outside the vocab, rows that are not finite probabilities summing to 1 and
    q(d) = 0; with validate=False such ids are rejected, q(d) = 0 < p(d) accepts, and
    rows are used as given.
    """
    _check_shapes(draft_token_ids, target_probs, draft_probs, seeds, positions, method)
    if method == "token" and _triton_rejection.usable(draft_token_ids, target_probs,
                                                      draft_probs):
        if validate:
            _validate(draft_token_ids, target_probs, draft_probs)
        tokens, tau = _triton_rejection.token_rejection_sample(
            draft_token_ids, target_probs, draft_probs, seeds, positions)
        return RejectionResult(token_ids=tokens, num_accepted=tau)
    B, K = draft_token_ids.shape
    V = target_probs.shape[-1]
    d = draft_token_ids
    in_vocab = (d >= 0) & (d < V)
    d_safe = d.clamp(0, V - 1)
    p_d = target_probs[:, :K].gather(2, d_safe.unsqueeze(2)).squeeze(2).double()
    p_d = torch.where(in_vocab, p_d, 0.0)  # an unknown id is never accepted
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
    else:
        q_d = draft_probs.gather(2, d_safe.unsqueeze(2)).squeeze(2).double()
    if validate:
        _check_values(d, target_probs, draft_probs, q_d)
    coins = uniform(seeds, positions.unsqueeze(1) + torch.arange(K, device=d.device),
                    Stream.ACCEPT)  # [B, K]
    if method == "token" or K == 0:
        tau = _token_accept(p_d, q_d, coins)
        weight = torch.ones(B, dtype=torch.float64, device=d.device)
    else:
        tau, weight = _block_accept(target_probs, draft_probs, p_d, q_d, coins)
    tokens = _finish(target_probs, draft_probs, d, d_safe, tau, weight, seeds, positions)
    return RejectionResult(token_ids=tokens, num_accepted=tau)
