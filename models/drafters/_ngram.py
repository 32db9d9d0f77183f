"""Prompt-lookup (n-gram) drafting: continue the latest earlier match of the suffix."""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch

from ._protocol import DraftContext, Drafter, DrafterDeps, DraftProposal


@attrs.define
class _SlotIndex:
    """n-gram -> the position after its latest occurrence, for one request."""

    table: dict[tuple[int, ...], int] = attrs.Factory(dict)
    indexed_upto: int = 0   # n-grams ending before this position are in the table


class NgramDrafter(Drafter):
    """Model-free; its drafts are point masses (q is None)."""

    point_mass = True
    variable_k = True

    def __init__(self, config: Any, deps: DrafterDeps) -> None:
        spec = config.speculative
        self.num_draft_tokens = spec.num_draft_tokens
        self.ngram_min, self.ngram_max = spec.ngram_min, spec.ngram_max
        self.device = deps.target_cache.device if deps.target_cache is not None else "cpu"
        self._slots: dict[int, _SlotIndex] = {}

    def prefill(self, slot: int, token_ids: Sequence[int],
                hidden: torch.Tensor | None = None) -> None:
        self._slots[slot] = _SlotIndex()

    def release(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def _index(self, index: _SlotIndex, tokens: Sequence[int]) -> None:
        # The suffix itself must not match itself: index n-grams ending before the last token.
        last = len(tokens) - 1
        for end in range(index.indexed_upto, last):
            for n in range(self.ngram_min, min(self.ngram_max, end + 1) + 1):
                index.table[tuple(tokens[end - n + 1:end + 1])] = end + 1
        index.indexed_upto = max(index.indexed_upto, last)

    def propose_row(self, slot: int, tokens: Sequence[int], k: int | None = None
                    ) -> list[int]:
        index = self._slots.setdefault(slot, _SlotIndex())
        self._index(index, tokens)
        k = self.num_draft_tokens if k is None else k
        if k == 0:
            return []
        for n in range(min(self.ngram_max, len(tokens)), self.ngram_min - 1, -1):
            start = index.table.get(tuple(tokens[-n:]))
            if start is not None:
                drafts = list(tokens[start:start + k])
                return drafts + [drafts[-1]] * (k - len(drafts))
        # No match: repeat the last token; verification rejects it at no extra cost.
        return [tokens[-1]] * k

    async def propose(self, ctx: DraftContext) -> DraftProposal:
        slots = ctx.slot_list()
        k = ctx.draft_count(self)
        rows = [self.propose_row(s, t, k) for s, t in zip(slots, ctx.token_ids)]
        # On the host: VERIFY's one input copy takes them along (no copy of their own).
        return DraftProposal(torch.tensor(rows, dtype=torch.int64).reshape(len(rows), k))
