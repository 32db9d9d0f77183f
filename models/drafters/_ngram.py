"""Prompt-lookup (n-gram) drafting: continue the latest earlier match of the suffix.

DRAFT proposes on the host (``propose_row``). A step chained on the device behind VERIFY
(engine/_chain.py, one GPU rank; adaptive K too) drafts on the device instead, from each
request's tokens kept in a device buffer (``_ngram_device``): the same drafts, but the GPU
no longer waits for the host to read VERIFY back and draft (issue 12, n-gram at batch 1).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
import torch

from specloop.samplers import Sampler, SamplingBatch

from .._host import int64_tensor, to_device
from ._ngram_device import ROW, chain_step
from ._protocol import DraftContext, Drafter, DrafterDeps, DraftProposal, static_or_view


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
        # Chaining: its draft graph and device buffers (any K; adaptive K chains too).
        self.chainable = deps.target_cache is not None
        if self.chainable:
            self._init_device_history(deps)

    def _init_device_history(self, deps: DrafterDeps) -> None:
        self.scratch = deps.num_slots
        self._rows = deps.num_slots + 1
        self._width = deps.max_seq_len + self.num_draft_tokens + 2
        # Allocated when a draft graph is built (``_device_buffers``): an engine that
        # never chains (CPU, eager) holds none.
        self.history: torch.Tensor | None = None
        # Per slot: positions below this hold the slot's tokens on the device.
        self._on_device: dict[int, int] = {}
        # (slots, rows) of the last chained step (``chained_inputs``' ``continued``).
        self._last_chain: tuple[tuple[int, ...], int] | None = None

    def _device_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each slot's committed tokens on the device (row ``num_slots``: padding), and
        the chained step's bonus / position outputs, read by VERIFY n+1."""
        if self.history is None:
            with torch.inference_mode(False):   # written in place in and out of it
                self.history = torch.zeros(self._rows, self._width, dtype=torch.int64,
                                           device=self.device)
                self._bonus = torch.zeros(self._rows, dtype=torch.int64, device=self.device)
                self._start_pos = torch.zeros_like(self._bonus)
                # The next chained step's meta, written by each (``chain_step``): a step
                # that continues the last one for the same rows takes it from here.
                self._next_meta = torch.zeros(4 * self._rows, dtype=torch.int64,
                                              device=self.device)
        return self.history, self._bonus, self._start_pos

    def prefill(self, slot: int, token_ids: Sequence[int],
                hidden: torch.Tensor | None = None) -> None:
        self._slots[slot] = _SlotIndex()
        if self.chainable:
            self._on_device[slot] = 0

    def release(self, slot: int) -> None:
        self._slots.pop(slot, None)
        if self.chainable:
            self._on_device.pop(slot, None)

    def _index(self, index: _SlotIndex, tokens: Sequence[int]) -> None:
        # The suffix itself must not match itself: index n-grams ending before the last token.
        last = len(tokens) - 1
        for end in range(index.indexed_upto, last):
            for n in range(self.ngram_min, min(self.ngram_max, end + 1) + 1):
                index.table[tuple(tokens[end - n + 1:end + 1])] = end + 1
        index.indexed_upto = max(index.indexed_upto, last)

    def propose_row(self, slot: int, tokens: Sequence[int], k: int | None = None
                    ) -> list[int]:
        return self.match_row(slot, tokens, self.num_draft_tokens if k is None else k)[1]

    def match_row(self, slot: int, tokens: Sequence[int], k: int) -> tuple[int, list[int]]:
        """(the length n of the match drafted from, 0 where none; the k drafts) for the
        row ``tokens`` of ``slot`` ((n, []) at k = 0). bench/ngram_match_study.py reads n."""
        n, start = self._match(slot, tokens)
        if k == 0:
            return n, []
        if n:
            drafts = list(tokens[start:start + k])
            return n, drafts + [drafts[-1]] * (k - len(drafts))
        # No match: repeat the last token; verification rejects it at no extra cost.
        return 0, [tokens[-1]] * k

    def _match(self, slot: int, tokens: Sequence[int]) -> tuple[int, int]:
        """(the longest n whose last n tokens occurred before, 0 where none; the
        position after that latest occurrence)."""
        index = self._slots.setdefault(slot, _SlotIndex())
        self._index(index, tokens)
        for n in range(min(self.ngram_max, len(tokens)), self.ngram_min - 1, -1):
            start = index.table.get(tuple(tokens[-n:]))
            if start is not None:
                return n, start
        return 0, 0

    # Adaptive K's draft classes: the match length, 0 (none) .. ngram_max. Without a match
    # the draft repeats the last token and is nearly never accepted (~0.1 % of SmolLM2's
    # chat iterations at K = 4), a one-token match ~0.4 tokens, three tokens ~2.3
    # (bench/ngram_match_study.py): verifying K + 1 rows pays only for the longer ones.
    @property
    def num_draft_classes(self) -> int:
        return int(self.ngram_max) + 1

    def draft_classes(self, slots: Sequence[int], token_ids: Sequence[Sequence[int]]
                      ) -> list[int]:
        return [self._match(slot, tokens)[0] for slot, tokens in zip(slots, token_ids)]

    async def propose(self, ctx: DraftContext) -> DraftProposal:
        slots = ctx.slot_list()
        k = ctx.draft_count(self)
        rows = [self.propose_row(s, t, k) for s, t in zip(slots, ctx.token_ids)]
        # On the host: VERIFY's one input copy takes them along (no copy of their own).
        return DraftProposal(torch.tensor(rows, dtype=torch.int64).reshape(len(rows), k))

    # Chained on the device (engine/_chain.py) -----------------------------------------
    def can_graph(self, advanced: bool) -> bool:
        # The draft graph is the chained step's (DRAFT itself drafts on the host).
        return self.chainable

    @property
    def can_chain(self) -> bool:
        return self.chainable

    @property
    def chains_through_k0(self) -> bool:
        # Its chained draft reads VERIFY's tokens only: at K = 0 the step places the bonus
        # token alone, and after a K = 0 VERIFY it drafts from that one token.
        return self.chainable

    @property
    def chains_joiners(self) -> bool:
        # A joining row's prompt reaches the device through ``chained_inputs``' tokens.
        return self.chainable

    def graph_step(self, sampler: Sampler, template: SamplingBatch, *, advanced: bool,
                   num_draft_tokens: int | None = None
                   ) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        """The chained draft: inputs ``verified`` [Bp, K+1] and ``accepted`` [Bp] (VERIFY
        n's outputs), ``meta`` [4, Bp] (``_ngram_device``) -> ``token_ids`` [Bp, k], and
        VERIFY n+1's inputs: ``tokens`` [Bp, k+1] (the bonus, then the drafts),
        ``start_pos`` [Bp] and ``slots`` [Bp] (which the capture writes into that VERIFY's
        own static inputs in the graph: graphs/_capture.into_verify_inputs)."""
        k = self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        history, bonus, start_pos = self._device_buffers()

        def step(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            rows = inputs["accepted"].shape[0]
            drafts = chain_step(history, inputs["verified"], inputs["accepted"],
                                inputs["meta"], k=k, ngram_min=self.ngram_min,
                                ngram_max=self.ngram_max, bonus=bonus[:rows],
                                start_pos=start_pos[:rows], next_meta=self._meta_view(rows))
            return {"token_ids": drafts, "tokens": torch.cat([bonus[:rows, None], drafts], 1),
                    "start_pos": start_pos[:rows], "slots": inputs["meta"][ROW]}

        return step

    def _meta_view(self, rows: int) -> torch.Tensor:
        """The next step's meta for ``rows`` rows [4, rows] (a fresh view each call: a
        replay copies an input it has not been given before)."""
        return self._next_meta[:4 * rows].view(4, rows)

    def graph_inputs(self, ctx: DraftContext) -> dict[str, torch.Tensor]:
        """Padding rows only (warm-up's capture: shapes); real rows come from
        ``chained_inputs``."""
        rows, width = ctx.graph_rows, self.num_draft_tokens + 1
        self._device_buffers()
        meta = torch.zeros(4, rows, dtype=torch.int64, device=self.device)
        meta[ROW] = self.scratch
        return {"verified": torch.zeros(rows, width, dtype=torch.int64, device=self.device),
                "accepted": torch.zeros(rows, dtype=torch.int64, device=self.device),
                "meta": meta}

    def chained_inputs(self, verified: dict[str, torch.Tensor], start: Sequence[int],
                       slots: Sequence[int], sampling: SamplingBatch,
                       into: dict[str, torch.Tensor] | None = None,
                       tokens: Sequence[Sequence[int]] | None = None,
                       continued: bool = False
                       ) -> dict[str, torch.Tensor]:
        """The chained draft's inputs (VERIFY n's rows), after copying to the device the
        tokens it lacks of each row's first ``start + 1`` (``tokens``: those committed
        since the row's last chained step, drafted on the host or verified at K = 0; a
        row whose last step was chained has them all); VERIFY n+1's tokens, positions
        and slots are the graph's outputs (``graph_step``). ``continued``: VERIFY n is
        the step the last call queued, for these rows: then nothing is copied (its draft wrote
        the tokens and this step's meta on the device: at batch 1 on the H200 the
        copy's host work, a pinned tensor and three torch calls, was ~0.15 ms an
        iteration). ``into``: the draft graph's static inputs; VERIFY n's tokens and
        counts already written there (the chain's step out of K = 0) are passed as they
        are, so the replay copies neither (else fresh views: a replay copies an input it
        has not been given before)."""
        rows = sampling.size
        key = (tuple(slots), rows)
        continues, self._last_chain = continued and self._last_chain == key, key
        history = self._device_buffers()[0]
        meta_dev = self._meta_view(rows) if continues else self._copy_meta(
            history, start, slots, rows, tokens)
        for slot, s in zip(slots, start):
            self._on_device[slot] = s + 1
        return {"verified": static_or_view(verified["token_ids"], into, "verified"),
                "accepted": static_or_view(verified["num_accepted"], into, "accepted"),
                "meta": meta_dev}

    def _copy_meta(self, history: torch.Tensor, start: Sequence[int], slots: Sequence[int],
                   rows: int, tokens: Sequence[Sequence[int]] | None) -> torch.Tensor:
        """The step's meta [4, rows] on the device, in one copy with the tokens the device
        lacks of each row's first ``start + 1``."""
        real = len(start)
        pad = rows - real
        meta = [list(start) + [0] * pad, list(slots) + [self.scratch] * pad,
                [1] * real + [0] * pad, [s + 1 for s in start] + [0] * pad]
        at: list[int] = []
        values: list[int] = []
        stride = history.shape[1]
        for i, (slot, s) in enumerate(zip(slots, start)):
            have = self._on_device.get(slot, 0)
            if have < s + 1:
                if tokens is None:
                    raise ValueError(f"slot {slot}: the device holds {have} of its "
                                     f"{s + 1} tokens and chained_inputs got no tokens")
                tail = list(tokens[i][have:s + 1])
                at.extend(range(slot * stride + have, slot * stride + have + len(tail)))
                values.extend(tail)
        host = int64_tensor([v for column in meta for v in column] + at + values)
        packed = to_device(host, history.device)
        if at:
            tail = packed[4 * rows:]
            history.view(-1).index_copy_(0, tail[:len(at)], tail[len(at):])
        return packed[:4 * rows].view(4, rows)
