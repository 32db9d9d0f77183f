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


def recording_sampler(config) -> RecordingSampler:
    recorder = RecordingSampler(default_sampler(config))
    RECORDERS.append(recorder)
    return recorder
