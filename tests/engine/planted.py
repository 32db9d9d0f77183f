"""Test-only components named through config (``components.sampler = "tests.engine.planted:..."``):
a sampler that records what the drafter proposed, and planted bugs certify must catch."""

from __future__ import annotations

import attrs
import torch

from specloop.engine._components import default_sampler

# Recorders built by engines in this process; a test clears it first (test-only state).
RECORDERS: list["RecordingSampler"] = []


@attrs.define(eq=False)
class RecordingSampler:
    """The default sampler, recording per seed every draft distribution's logits and every
    drafted row VERIFY sees, in call order: a request's drafts must not depend on its
    slot's previous user or its batch neighbours."""

    inner: object
    drafts: dict = attrs.Factory(dict)     # seed -> [(position, logits [V])]
    verified: dict = attrs.Factory(dict)   # seed -> [(position, draft tokens [K])]
    batch_sizes: list = attrs.Factory(list)

    def draft(self, logits, batch, positions, *, advanced):
        for seed, pos, row in zip(batch.seeds.tolist(), positions.tolist(), logits):
            self.drafts.setdefault(seed, []).append((pos, row.detach().clone()))
        return self.inner.draft(logits, batch, positions, advanced=advanced)

    def verify(self, draft_token_ids, target_logits, draft_probs, batch, positions, *,
               advanced):
        self.batch_sizes.append(int(draft_token_ids.shape[0]))
        for seed, pos, row in zip(batch.seeds.tolist(), positions.tolist(),
                                  draft_token_ids.tolist()):
            self.verified.setdefault(seed, []).append((pos, row))
        return self.inner.verify(draft_token_ids, target_logits, draft_probs, batch,
                                 positions, advanced=advanced)

    def strict_targets(self, target_logits, batch, positions):
        return self.inner.strict_targets(target_logits, batch, positions)


def recording_sampler(config) -> RecordingSampler:
    recorder = RecordingSampler(default_sampler(config))
    RECORDERS.append(recorder)
    return recorder


# Planted bugs ------------------------------------------------------------------------
def share_one_stream(monkeypatch) -> None:
    """Drafting and verification draw from one noise stream (vLLM shipped this): a draft
    and its acceptance coin use the same uniform, so the tokens drafted with small
    uniforms are the ones always accepted."""
    from specloop.samplers import Stream, _probs, _rejection  # noqa: PLC0415

    real = _rejection.uniform

    def one_stream(seeds, positions, stream, index=0):
        return real(seeds, positions, Stream.ACCEPT, index)

    monkeypatch.setattr(_rejection, "uniform", one_stream)
    monkeypatch.setattr(_probs, "uniform", one_stream)


def skip_residual_normalisation(monkeypatch) -> None:
    """The recovered token is drawn from (p - q)+ with a uniform on [0, 1) as if it summed
    to 1: draws past its mass fall on the last token with mass."""
    from specloop.samplers import _rejection  # noqa: PLC0415

    def unscaled_inverse_cdf(weights, u):
        cdf = weights.double().cumsum(dim=-1)
        index = torch.searchsorted(cdf, u.unsqueeze(-1).double()).squeeze(-1)
        last = (weights > 0).long().cumsum(dim=-1).argmax(dim=-1)
        return torch.minimum(index, last)

    monkeypatch.setattr(_rejection, "inverse_cdf", unscaled_inverse_cdf)


class LeakyDraftModelDrafter:
    """The draft-model drafter with a prefix-reuse bug: when the slot's draft cache already
    holds as many positions as the new prompt, prefill skips the draft model, so the new
    request drafts against the previous user's K/V (release no longer forgets a slot)."""

    def __new__(cls, config, deps):
        from specloop.models.drafters import DraftModelDrafter  # noqa: PLC0415
        from specloop.models.drafters._draft_model import _SlotState  # noqa: PLC0415

        class Leaky(DraftModelDrafter):
            def prefill(self, slot, token_ids, hidden=None) -> None:
                old = self._slots.get(slot)
                if old is not None and old.num_cached >= len(token_ids):
                    self._slots[slot] = _SlotState(num_cached=len(token_ids))
                    return
                super().prefill(slot, token_ids, hidden)

            def release(self, slot) -> None:
                pass

        return Leaky(config, deps)


# Engines of one group build their samplers in turn; per config, the second one built
# (one rank of a 2-rank group) is off by one. Test-only state, cleared by the test.
SAMPLERS_BUILT: dict[int, int] = {}


@attrs.define(eq=False)
class SeedPlusOneSampler:
    inner: object

    def _shift(self, batch):
        return attrs.evolve(batch, seeds=batch.seeds + 1)

    def draft(self, logits, batch, positions, *, advanced):
        return self.inner.draft(logits, self._shift(batch), positions, advanced=advanced)

    def verify(self, draft_token_ids, target_logits, draft_probs, batch, positions, *,
               advanced):
        return self.inner.verify(draft_token_ids, target_logits, draft_probs,
                                 self._shift(batch), positions, advanced=advanced)

    def strict_targets(self, target_logits, batch, positions):
        return self.inner.strict_targets(target_logits, self._shift(batch), positions)


def one_rank_off_by_one(config):
    inner = default_sampler(config)
    if config.parallel.world_size == 1:
        return inner
    count = SAMPLERS_BUILT[id(config)] = SAMPLERS_BUILT.get(id(config), 0) + 1
    return SeedPlusOneSampler(inner) if count % 2 == 0 else inner


class _FlatterLogits:
    """A model whose logits are scaled down: its distributions are a flatter copy."""

    def __init__(self, model, scale: float) -> None:
        self.model, self.scale = model, scale

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def logits(self, hidden):
        return self.model.logits(hidden) * self.scale


def near_target_drafter(config, deps):
    """A good drafter, as trained heads are: the target itself as draft model, its logits
    scaled by 0.7, so q is close to p but not equal (high acceptance, and residuals
    (p - q)+ with little mass: where their normalisation matters most). Correct; the
    planted sampler bugs show up against it."""
    from specloop.models.drafters import DraftModelDrafter  # noqa: PLC0415

    drafter = DraftModelDrafter(config, deps)
    drafter.model = _FlatterLogits(drafter.model, 0.7)
    return drafter


@attrs.define(eq=False)
class OnePositionTreeSampler:
    """The default sampler, but a draft tree's rows all drawn with the root's uniform (its
    position's), not each at its own: along a path the draws are then dependent, and the
    tokens after an accepted node are biased (vLLM-style shared noise, in a tree)."""

    inner: object

    def draft(self, logits, batch, positions, *, advanced):
        return self.inner.draft(logits, batch, positions, advanced=advanced)

    def verify(self, draft_token_ids, target_logits, draft_probs, batch, positions, *,
               advanced):
        return self.inner.verify(draft_token_ids, target_logits, draft_probs, batch,
                                 positions, advanced=advanced)

    def strict_targets(self, target_logits, batch, positions):
        return self.inner.strict_targets(target_logits, batch,
                                         positions[:, :1].expand_as(positions))


def one_position_tree_sampler(config) -> OnePositionTreeSampler:
    return OnePositionTreeSampler(default_sampler(config))
