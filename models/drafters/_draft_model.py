"""A second, smaller model sharing the target's tokenizer, with its own KV cache.

The draft cache is kept aligned with the committed sequence: drafts it wrote that were
accepted stay valid, and each propose first feeds the tokens it has not seen (1 or 2).
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch

from specloop.samplers import Sampler, SamplingBatch

from .._grad import inference_mode
from ._errors import DrafterConfigError
from ._protocol import (DraftContext, DrafterDeps, DraftProposal, FixedKGraphDrafter,
                        graph_int_inputs, graph_outputs, replay_proposal)

# Tokens the draft cache can lag behind: the last committed one, plus the bonus token
# when all K drafts were accepted.
MAX_FEED = 2


@attrs.define
class _SlotState:
    num_cached: int            # committed tokens whose K/V the draft cache holds
    written_from: int = 0      # position of the first draft whose K/V it wrote last time
    written: tuple[int, ...] = ()


class DraftModelDrafter(FixedKGraphDrafter):
    def __init__(self, config: Any, deps: DrafterDeps) -> None:
        from specloop.models import KVCache, load_model  # noqa: PLC0415

        self.num_draft_tokens = config.speculative.num_draft_tokens
        target = deps.target
        device = deps.target_cache.device
        dtype = next(target.model.parameters()).dtype
        self.loaded = load_model(config.speculative.draft_model, dtype=dtype, device=device)
        if self.loaded.args.vocab_size != target.args.vocab_size:
            raise DrafterConfigError("speculative.draft_model", config.speculative.draft_model,
                              f"vocab size {self.loaded.args.vocab_size} differs from the "
                              f"target's {target.args.vocab_size}",
                              "use a draft model sharing the target's tokenizer")
        self.model = self.loaded.model
        self.cache = KVCache(self.loaded.args, deps.num_slots, deps.max_seq_len,
                             dtype=dtype, device=device, pages=deps.target_cache.pages)
        self._slots: dict[int, _SlotState] = {}
        # (states, [B, K-1] drafts written) of the last propose
        self._unread: tuple[list[_SlotState], torch.Tensor] | None = None

    @inference_mode
    def prefill(self, slot: int, token_ids: Sequence[int], hidden: torch.Tensor | None = None
                ) -> None:
        device = self.cache.device
        if token_ids:
            self.model(torch.tensor([list(token_ids)], device=device),
                       torch.tensor([0], device=device), torch.tensor([slot], device=device),
                       self.cache)
        self._slots[slot] = _SlotState(num_cached=len(token_ids))

    def release(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def _valid_prefix(self, state: _SlotState, tokens: Sequence[int]) -> int:
        valid = state.num_cached
        for j, tok in enumerate(state.written):
            pos = state.written_from + j
            if valid != pos or pos >= len(tokens) - 1 or tokens[pos] != tok:
                break
            valid = pos + 1
        return valid

    def _feeds(self, ctx: DraftContext
               ) -> tuple[list[_SlotState], list[int], list[list[int]]]:
        """Per row: its state, the first position to feed, and the tokens to feed (1 or 2:
        the ones the draft cache has not seen)."""
        self._read_written()
        states = [self._slots[s] for s in ctx.slot_list()]
        starts = [self._valid_prefix(st, t) for st, t in zip(states, ctx.token_ids)]
        feeds = [list(t[c:]) for c, t in zip(starts, ctx.token_ids)]
        return states, starts, feeds

    def _commit(self, states: list[_SlotState], ctx: DraftContext, proposal: DraftProposal) -> None:
        # The draft cache now holds every committed token and drafts d1..d_{K-1}. Which
        # drafts is read back at the next propose: here it would sync before VERIFY is
        # queued; then VERIFY's own read-back has already waited for the device.
        for st, length in zip(states, ctx.seq_len_list()):
            st.num_cached, st.written_from = length, length
        self._unread = (states, proposal.token_ids[:, :-1])

    def _read_written(self) -> None:
        if self._unread is not None:
            states, written = self._unread
            self._unread = None
            for st, w in zip(states, written.tolist()):
                st.written = tuple(w)

    def _draft_steps(self, inputs: dict[str, torch.Tensor], sampler: Sampler,
                     batch: SamplingBatch, *,
                     advanced: bool, kv_len: int | None) -> dict[str, torch.Tensor]:
        """The one drafting loop, eager and graph alike: feed each row's unseen tokens
        (catch-up), then K draft steps. inputs: feed [B, W] (right-padded), feed_start [B],
        feed_last [B] (index of the last real feed token), slots [B], seq_lens [B]."""
        model, cache = self.model, self.cache
        slots, seq_lens = inputs["slots"], inputs["seq_lens"]
        hidden = model(inputs["feed"], inputs["feed_start"], slots, cache, kv_len=kv_len)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        logits = model.logits(hidden[rows, inputs["feed_last"]])
        drafted: list[torch.Tensor] = []
        probs: list[torch.Tensor | None] = []
        for j in range(self.num_draft_tokens):
            if j:
                hidden = model(drafted[-1][:, None], seq_lens - 1 + j, slots, cache,
                               kv_len=kv_len)
                logits = model.logits(hidden[:, -1])
            sample = sampler.draft(logits, batch, seq_lens + j, advanced=advanced)
            drafted.append(sample.token_ids)
            probs.append(sample.probs)
        return graph_outputs(drafted, probs, advanced)

    @staticmethod
    def _feed_columns(feeds: Sequence[list[int]], starts: Sequence[int], width: int
                      ) -> dict[str, list[Any]]:
        # Right-pad: a padded position writes junk K/V at L, which d1 overwrites next.
        return {"feed": [f + [f[-1]] * (width - len(f)) for f in feeds],
                "feed_start": list(starts), "feed_last": [len(f) - 1 for f in feeds]}

    @inference_mode
    def _draft(self, ctx: DraftContext) -> DraftProposal:
        states, starts, feeds = self._feeds(ctx)
        device = ctx.slots.device
        columns = self._feed_columns(feeds, starts, max(len(f) for f in feeds))
        inputs = {name: torch.tensor(v, device=device) for name, v in columns.items()}
        inputs.update(slots=ctx.slots, seq_lens=ctx.seq_lens)
        out = self._draft_steps(inputs, ctx.sampler, ctx.sampling,
                                advanced=ctx.spec.wants_advanced_draft_sampling, kv_len=None)
        proposal = DraftProposal(out["token_ids"], out.get("probs"))
        self._commit(states, ctx, proposal)
        return proposal

    def graph_inputs(self, ctx: DraftContext, feeds: Sequence[list[int]] | None = None,
                     starts: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
        """Static inputs for the graph's rows: feeds right-padded to MAX_FEED tokens;
        padding rows feed token 0 at position 0 of the scratch slot."""
        if feeds is None:
            _, starts, feeds = self._feeds(ctx)
        assert starts is not None, "feeds and starts come together"
        pad = ctx.graph_rows - len(ctx.token_ids)
        columns = self._feed_columns(list(feeds) + [[0]] * pad, list(starts) + [0] * pad,
                                     MAX_FEED)
        return graph_int_inputs(ctx, {
            **columns,
            "slots": ctx.slot_list() + [self.cache.scratch_slot] * pad,
            "seq_lens": ctx.seq_len_list() + [1] * pad,
        })

    async def propose(self, ctx: DraftContext) -> DraftProposal:
        if ctx.replay is not None:
            states, starts, feeds = self._feeds(ctx)
            if max(len(f) for f in feeds) <= MAX_FEED:
                advanced = ctx.spec.wants_advanced_draft_sampling
                inputs = self.graph_inputs(ctx, feeds, starts)
                proposal = await ctx.run_sync(lambda: replay_proposal(ctx, inputs, advanced))
                self._commit(states, ctx, proposal)
                return proposal
        return await ctx.run_sync(lambda: self._draft(ctx))
