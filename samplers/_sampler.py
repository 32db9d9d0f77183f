"""The Sampler protocol and the default sampler (registered by specloop.engine as "default")."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs
import torch

from ._params import SamplingBatch
from ._probs import compute_probs, sample_tokens
from ._rejection import METHODS, RejectionResult, rejection_sample
from ._rng import Stream
from ._triton_greedy import greedy_argmax, greedy_verify, usable, usable_argmax


@attrs.frozen(eq=False)
class DraftSample:
    token_ids: torch.Tensor  # [B] i64
    probs: torch.Tensor | None  # [B, V] f32, the q the token was drawn from; None = argmax


@runtime_checkable
class Sampler(Protocol):
    def draft(self, logits: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor, *,
              advanced: bool) -> DraftSample: ...

    def verify(self, draft_token_ids: torch.Tensor, target_logits: torch.Tensor,
               draft_probs: torch.Tensor | None, batch: SamplingBatch,
               positions: torch.Tensor, *, advanced: bool) -> RejectionResult: ...

    def strict_targets(self, target_logits: torch.Tensor, batch: SamplingBatch,
                       positions: torch.Tensor) -> torch.Tensor:
        """Optional (this default): the token strict verification holds each VERIFY row
        against, [B, R] from target_logits [B, R, V] and each row's position [B, R] (the
        position of the token the row predicts). A draft tree's VERIFY (samplers/_tree.py)
        accepts a node whose token is its parent row's target, so these must be exact
        draws from p: argmax for greedy rows, else independent across positions."""
        return strict_targets(target_logits, batch, positions)


def strict_targets(target_logits: torch.Tensor, batch: SamplingBatch,
                   positions: torch.Tensor) -> torch.Tensor:
    """[B, R]: argmax for greedy rows, else drawn from p at ``positions`` [B, R] with
    Stream.BONUS. Rows at one position share its uniform (a tree's siblings): one of
    them at most is on a path, and a path's rows are at different positions."""
    if batch.all_greedy:  # padding rows are greedy too
        return target_logits.argmax(dim=-1)  # same tokens as one-hot rows, no softmax
    return sample_tokens(compute_probs(target_logits, batch), batch.seeds, positions,
                         Stream.BONUS, validate=False)


def _target_tokens(target_logits: torch.Tensor, batch: SamplingBatch,
                   positions: torch.Tensor) -> torch.Tensor:
    """[B, K+1]: ``strict_targets`` of a chain's rows, at positions L..L+K."""
    steps = torch.arange(target_logits.shape[1], device=positions.device)
    return strict_targets(target_logits, batch, positions.unsqueeze(1) + steps)


def target_tokens_from_probs(probs: torch.Tensor, seeds: torch.Tensor,
                             positions: torch.Tensor) -> torch.Tensor:
    """[B, K+1] tokens drawn from probs [B, K+1, V] at positions L..L+K, Stream.BONUS."""
    steps = torch.arange(probs.shape[1], device=positions.device)
    return sample_tokens(probs, seeds, positions.unsqueeze(1) + steps, Stream.BONUS,
                         validate=False)


def strict_from_targets(draft_token_ids: torch.Tensor, t: torch.Tensor) -> RejectionResult:
    """Accept the longest prefix with d_i == t_i [B, K+1], then emit t at the mismatch."""
    match = (draft_token_ids == t[:, :-1]).long()
    n = match.cumprod(dim=1).sum(dim=1)  # [B]
    steps = torch.arange(t.shape[1], device=t.device)
    return RejectionResult(token_ids=torch.where(steps <= n.unsqueeze(1), t, -1),
                           num_accepted=n)


def strict_verify(draft_token_ids: torch.Tensor, target_logits: torch.Tensor,
                  batch: SamplingBatch, positions: torch.Tensor) -> RejectionResult:
    """Strict verification: exact for any p, since the token emitted at each position is
    t_i, drawn from p_i (argmax for greedy rows).

    An all-greedy batch on CUDA (with Triton) takes two kernels (_triton_greedy) that write
    the same tokens and counts into one [B, K+2] tensor: token_ids and num_accepted are
    its views (``packed_result`` gives it back), not an argmax and the prefix ops."""
    if batch.all_greedy and usable(draft_token_ids, target_logits):
        packed = greedy_verify(draft_token_ids, target_logits)
        k1 = packed.shape[1] - 1
        return RejectionResult(token_ids=packed[:, :k1], num_accepted=packed[:, k1])
    return strict_from_targets(draft_token_ids,
                               _target_tokens(target_logits, batch, positions))


def packed_result(result: RejectionResult) -> torch.Tensor:
    """[B, K+2] i64: token_ids [B, K+1], then num_accepted; a view when the two are views
    of one such tensor (what strict_verify's kernels return), else a new tensor."""
    t, n = result.token_ids, result.num_accepted
    B, k1 = t.shape
    if (B and t.dtype == n.dtype == torch.int64 and t.stride() == (k1 + 1, 1)
            and n.stride() == (k1 + 1,) and n.data_ptr() == t.data_ptr() + 8 * k1
            and t.untyped_storage().data_ptr() == n.untyped_storage().data_ptr()):
        return t.as_strided((B, k1 + 1), (k1 + 1, 1))
    return torch.cat([t, n[:, None]], dim=1)


@attrs.frozen
class DefaultSampler:
    """Argmax drafts and strict verification, or sampled drafts and rejection sampling."""

    method: str = attrs.field(default="token", validator=attrs.validators.in_(METHODS))
    validate: bool = True

    def draft(self, logits: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor, *,
              advanced: bool) -> DraftSample:
        # logits [B, V], positions [B]: the position the drafted token will take.
        if not advanced:   # CUDA: the greedy kernels' split argmax (_triton_greedy)
            tokens = (greedy_argmax(logits) if usable_argmax(logits)
                      else logits.argmax(dim=-1))
            return DraftSample(token_ids=tokens, probs=None)
        q = compute_probs(logits, batch)
        tokens = sample_tokens(q, batch.seeds, positions, Stream.DRAFT, validate=False)
        return DraftSample(token_ids=tokens, probs=q)

    def strict_targets(self, target_logits: torch.Tensor, batch: SamplingBatch,
                       positions: torch.Tensor) -> torch.Tensor:
        return strict_targets(target_logits, batch, positions)

    def verify(self, draft_token_ids: torch.Tensor, target_logits: torch.Tensor,
               draft_probs: torch.Tensor | None, batch: SamplingBatch,
               positions: torch.Tensor, *, advanced: bool) -> RejectionResult:
        # target_logits [B, K+1, V]; K = 0 is plain sampling of one token.
        if not advanced:
            return strict_verify(draft_token_ids, target_logits, batch, positions)
        p = compute_probs(target_logits, batch)
        return rejection_sample(draft_token_ids, p, draft_probs, seeds=batch.seeds,
                                positions=positions, method=self.method,
                                validate=self.validate)

