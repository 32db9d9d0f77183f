"""Early-exit self-drafting: the target's first N layers, its final norm and LM head.

No extra weights, and no cache of its own: for committed tokens the first N layers' K/V
equal the target's, so drafts write into the target cache and VERIFY overwrites them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from specloop.samplers import Sampler, SamplingBatch

from .._grad import inference_mode
from ._errors import DrafterConfigError
from ._protocol import (DraftContext, DrafterDeps, DraftProposal, FixedKGraphDrafter,
                        graph_int_inputs, graph_outputs, replay_proposal)


class EarlyExitDrafter(FixedKGraphDrafter):
    def __init__(self, config: Any, deps: DrafterDeps) -> None:
        self.num_draft_tokens = config.speculative.num_draft_tokens
        self.model = deps.target.model
        self.cache = deps.target_cache
        total = deps.target.args.num_layers
        self.num_layers = config.speculative.early_exit_layers or max(1, total // 4)
        if self.num_layers >= total:
            raise DrafterConfigError("speculative.early_exit_layers", self.num_layers,
                              f"must be below the target's {total} layers")

    def prefill(self, slot: int, token_ids: Sequence[int], hidden: torch.Tensor | None = None
                ) -> None:
        """The target's prefill already wrote these layers' K/V."""

    def release(self, slot: int) -> None:
        pass

    def _draft_steps(self, inputs: dict[str, torch.Tensor], sampler: Sampler,
                     batch: SamplingBatch, *, advanced: bool,
                    kv_len: int | None) -> dict[str, torch.Tensor]:
        """The one drafting loop, eager and graph alike: K steps of the first N layers from
        each row's last token. inputs: last [B], seq_lens [B], slots [B]."""
        tokens, seq_lens, slots = inputs["last"], inputs["seq_lens"], inputs["slots"]
        drafted: list[torch.Tensor] = []
        probs: list[torch.Tensor | None] = []
        for j in range(self.num_draft_tokens):
            hidden = self.model(tokens[:, None], seq_lens - 1 + j, slots, self.cache,
                                num_layers=self.num_layers, kv_len=kv_len)
            sample = sampler.draft(self.model.logits(hidden[:, -1]), batch, seq_lens + j,
                                   advanced=advanced)
            tokens = sample.token_ids
            drafted.append(tokens)
            probs.append(sample.probs)
        return graph_outputs(drafted, probs, advanced)

    @inference_mode
    def _draft(self, ctx: DraftContext) -> DraftProposal:
        inputs = {"last": torch.tensor([t[-1] for t in ctx.token_ids], device=ctx.slots.device),
                  "seq_lens": ctx.seq_lens, "slots": ctx.slots}
        out = self._draft_steps(inputs, ctx.sampler, ctx.sampling,
                                advanced=ctx.spec.wants_advanced_draft_sampling, kv_len=None)
        return DraftProposal(out["token_ids"], out.get("probs"))

    def graph_inputs(self, ctx: DraftContext) -> dict[str, torch.Tensor]:
        """Static-shape inputs for the graph's rows (padding: scratch slot, position 0)."""
        pad = ctx.graph_rows - len(ctx.token_ids)
        return graph_int_inputs(ctx, {
            "last": [t[-1] for t in ctx.token_ids] + [0] * pad,
            "seq_lens": ctx.seq_len_list() + [1] * pad,
            "slots": ctx.slot_list() + [self.cache.scratch_slot] * pad})

    async def propose(self, ctx: DraftContext) -> DraftProposal:
        if ctx.replay is not None:
            advanced = ctx.spec.wants_advanced_draft_sampling
            inputs = self.graph_inputs(ctx)
            return await ctx.run_sync(lambda: replay_proposal(ctx, inputs, advanced))
        return await ctx.run_sync(lambda: self._draft(ctx))
