"""Turning draft hidden states into draft tokens: local head, or LM-head TP under ADP.

Greedy path with LM-head TP (DESIGN.md, DRAFT): every rank pads its rows to M, all-gathers
them to [g*M, H], multiplies by its vocab shard [ceil(V/g), H] and the group takes the
distributed argmax; each rank keeps its own segment of rows. Advanced path: the local
full-vocab head (replicated under ADP), sampled with the draft stream, no collective.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from specloop.comm import distributed_argmax

from ._protocol import DraftContext, sample_draft_step


class DraftHead:
    def __init__(self, weight: torch.Tensor, *, lm_head_tp: bool, max_rows: int) -> None:
        self.weight = weight                       # [V, H], shared with the target
        self.lm_head_tp = lm_head_tp
        self.max_rows = max_rows                   # M = max_batch_size

    def uses_collectives(self, ctx: DraftContext) -> bool:
        # Reads the one predicate (group-synced when the gate is on); config decides TP.
        return self.lm_head_tp and not ctx.spec.wants_advanced_draft_sampling

    async def tokens(self, ctx: DraftContext, hidden: torch.Tensor, step: int
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [B, H] -> (draft tokens [B], q [B, V] or None)."""
        if self.uses_collectives(ctx):
            return await self._tp_argmax(ctx, hidden), None
        logits = await ctx.run_sync(lambda: F.linear(hidden, self.weight).float())
        return sample_draft_step(ctx, logits, step)

    async def _tp_argmax(self, ctx: DraftContext, hidden: torch.Tensor) -> torch.Tensor:
        comm, m = ctx.comm, self.max_rows
        rows = hidden.shape[0]
        padded = hidden.new_zeros(m, hidden.shape[1])
        padded[:rows] = hidden
        stacked = await comm.all_gather(padded)                  # [g, M, H]
        shard_logits = await ctx.run_sync(lambda: self._shard_logits(stacked, comm))
        ids = await distributed_argmax(comm, shard_logits, vocab_size=self.weight.shape[0])
        start = comm.rank * m
        return ids[start:start + rows]                           # this rank's own rows

    def _shard_logits(self, stacked: torch.Tensor, comm) -> torch.Tensor:
        vocab, g = self.weight.shape[0], comm.world_size
        size = math.ceil(vocab / g)
        lo, hi = comm.rank * size, min((comm.rank + 1) * size, vocab)
        flat = stacked.reshape(-1, stacked.shape[-1])            # [g*M, H]
        logits = flat.new_zeros(flat.shape[0], size, dtype=torch.float32)
        if hi > lo:                                              # columns >= V stay padding
            logits[:, :hi - lo] = F.linear(flat, self.weight[lo:hi]).float()
        return logits                                            # [g*M, ceil(V/g)]
