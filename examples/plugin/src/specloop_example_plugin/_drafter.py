"""A successor-table drafter: per request, the most recent token that followed each token.

Model free, like specloop's n-gram drafter, but it drafts differently: from the last
committed token it follows the table K times (a chain of one-token lookups), and an
unseen token maps to itself. The table lives on the model's device and the K lookups are
plain tensor indexing with static shapes, so the whole proposal can run in a CUDA graph:
``can_graph`` says so, and the engine captures ``graph_step`` at warmup and replays it
through ``ctx.replay``. Only the table updates (new committed tokens) run outside it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specloop.engine import EngineConfig
from specloop.models.drafters import DraftContext, Drafter, DrafterDeps, DraftProposal
from specloop.samplers import Sampler, SamplingBatch

Tensors = dict[str, torch.Tensor]


class SuccessorDrafter(Drafter):
    """Drafts are point masses (no q); no collectives, so idle ranks are not called."""

    point_mass = True

    def __init__(self, config: EngineConfig, deps: DrafterDeps) -> None:
        self.num_draft_tokens = config.speculative.num_draft_tokens
        vocab = deps.target.args.vocab_size
        self.device = deps.target_cache.device
        self.scratch = deps.target_cache.scratch_slot      # what padding rows use
        # table[slot, t]: the token that last followed t in slot's request; t if none.
        # One row per slot plus the scratch slot. Updated in place only: a captured graph
        # reads this very storage.
        self._identity = torch.arange(vocab, dtype=torch.int64, device=self.device)
        self.table = self._identity.repeat(deps.num_slots + 1, 1)
        self._indexed: dict[int, int] = {}   # slot -> committed tokens already in its row

    def prefill(self, slot: int, token_ids: Sequence[int], hidden: torch.Tensor | None
                ) -> None:
        self.table[slot] = self._identity
        self._indexed[slot] = 0
        self._learn([slot], [token_ids])

    def release(self, slot: int) -> None:
        self._indexed.pop(slot, None)

    def can_graph(self, advanced: bool) -> bool:
        # Table lookups only: no sampling, no host reads, no collectives, on either path.
        return True

    def graph_step(self, sampler: Sampler, template: SamplingBatch, *, advanced: bool,
                   num_draft_tokens: int | None = None) -> Callable[[Tensors], Tensors]:
        # num_draft_tokens is always this drafter's own K: its variable_k is False.
        return self._follow

    def graph_inputs(self, ctx: DraftContext) -> Tensors:
        rows = ctx.graph_sampling.size if ctx.graph_sampling is not None else len(ctx.token_ids)
        pad = rows - len(ctx.token_ids)
        return self._inputs([*ctx.slot_list(), *[self.scratch] * pad],
                            [*(t[-1] for t in ctx.token_ids), *[0] * pad])

    async def propose(self, ctx: DraftContext) -> DraftProposal:
        self._learn(ctx.slot_list(), ctx.token_ids)
        rows = len(ctx.token_ids)
        if ctx.replay is not None:      # the engine captured graph_step for this batch
            inputs = self.graph_inputs(ctx)
            return DraftProposal(await ctx.run_sync(lambda: self._replay(ctx, inputs, rows)))
        inputs = self._inputs(ctx.slot_list(), [t[-1] for t in ctx.token_ids])
        return DraftProposal(self._follow(inputs)["token_ids"])

    @staticmethod
    def _replay(ctx: DraftContext, inputs: Tensors, rows: int) -> torch.Tensor:
        assert ctx.replay is not None
        # The graph's static tensors are inference tensors: copy into them in that mode.
        with torch.inference_mode():
            out = ctx.replay(inputs)
            # Static outputs: the next replay overwrites them.
            return out["token_ids"][:rows].clone()

    # One code path for eager and graph runs. -------------------------------------------
    def _follow(self, inputs: Tensors) -> Tensors:
        slots, token = inputs["slots"], inputs["last"]
        drafted = []
        for _ in range(self.num_draft_tokens):
            token = self.table[slots, token]
            drafted.append(token)
        return {"token_ids": torch.stack(drafted, dim=1)}

    def _inputs(self, slots: list[int], last: list[int]) -> Tensors:
        host = torch.tensor([slots, last], dtype=torch.int64)
        both = host.to(self.device, non_blocking=True)
        return {"slots": both[0], "last": both[1]}

    def _learn(self, slots: Sequence[int], token_ids: Sequence[Sequence[int]]) -> None:
        """Add each row's new successor pairs: one indexed write for the whole batch (each
        (slot, token) once, its latest successor; duplicate indices would race)."""
        rows: list[int] = []
        keys: list[int] = []
        values: list[int] = []
        for slot, tokens in zip(slots, token_ids):
            start = max(self._indexed.get(slot, 0) - 1, 0)
            latest = dict(zip(tokens[start:-1], tokens[start + 1:]))
            self._indexed[slot] = len(tokens)
            rows += [slot] * len(latest)
            keys += latest.keys()
            values += latest.values()
        if rows:
            index = torch.tensor([rows, keys, values], dtype=torch.int64).to(self.device)
            self.table[index[0], index[1]] = index[2]
