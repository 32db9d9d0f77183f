"""Early-exit self-drafting: the target's first N layers, its final norm and LM head.

No extra weights, and no cache of its own: for committed tokens the first N layers' K/V
equal the target's, so drafts write into the target cache and VERIFY overwrites them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ._errors import DrafterConfigError
from ._protocol import DraftContext, DrafterDeps, DraftProposal, sample_draft_step, stack_proposal


class EarlyExitDrafter:
    def __init__(self, config, deps: DrafterDeps) -> None:
        self.num_draft_tokens = config.speculative.num_draft_tokens
        self.model = deps.target.model
        self.cache = deps.target_cache
        total = deps.target.args.num_layers
        self.num_layers = config.speculative.early_exit_layers or max(1, total // 4)
        if self.num_layers >= total:
            raise DrafterConfigError("speculative.early_exit_layers", self.num_layers,
                              f"must be below the target's {total} layers")

    def prefill(self, slot: int, token_ids: Sequence[int], hidden=None) -> None:
        """The target's prefill already wrote these layers' K/V."""

    def release(self, slot: int) -> None:
        pass

    @torch.inference_mode()
    def _draft(self, ctx: DraftContext) -> DraftProposal:
        tokens = torch.tensor([t[-1] for t in ctx.token_ids], device=ctx.slots.device)
        drafted, probs = [], []
        for step in range(self.num_draft_tokens):
            hidden = self.model(tokens[:, None], ctx.seq_lens - 1 + step, ctx.slots,
                                self.cache, num_layers=self.num_layers)
            tokens, q = sample_draft_step(ctx, self.model.logits(hidden[:, -1]), step)
            drafted.append(tokens)
            probs.append(q)
        return stack_proposal(drafted, probs)

    async def propose(self, ctx: DraftContext) -> DraftProposal:
        return await ctx.run_sync(lambda: self._draft(ctx))
