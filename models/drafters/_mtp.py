"""MTP-Eagle drafting: one head (_mtp_head.py) applied K times, fed by the target's rows.

After each VERIFY the rows the target accepted (hidden states and tokens) wait for the
next DRAFT (_pending_rows.py), which feeds them to the head first (the catch-up), so its
cache follows the committed sequence; then it drafts autoregressively on its own outputs.
One drafting loop (``_draft_steps``) serves the eager path, the captured draft graph and,
with inputs built on the device from VERIFY's outputs, the chained step
(``chained_inputs``, engine/_chain.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Generator, Sequence

import torch

from specloop.samplers import DefaultSampler, Sampler, SamplingBatch
from specloop.samplers._tree import DraftTree

from .._decoder import DecoderModel, TreeMask
from .._grad import inference_mode
from .._host import StagingRing, copy_into, int64_tensor, to_device
from .._linear import bf16_packing_available
from .._prefill import padded_shape
from ._errors import DrafterConfigError
from ._heads import check_method, check_sha256, check_target, head_metadata, resolve_head
from ._lm_head import DraftHead
from ._mtp_head import MtpEagleHead, load_or_init
from ._pending_rows import PendingRows
from ._protocol import (DraftContext, Drafter, DrafterDeps, DraftGraphStep, DraftProposal,
                        PrefillReplay, Step, graph_int_inputs, graph_outputs, replay_proposal,
                        sample_draft_step, stack_proposal, static_or_view)

# The drafting loop: yields the head's hidden state per step, is sent that step's tokens.
DraftLoop = Generator[torch.Tensor, torch.Tensor, None]

# Target rows a slot keeps beyond K + 1 under adaptive K (K = 0 iterations in a row).
LAZY_ROWS = 32
# At most this many tokens (counting the padding) per shared head prefill forward.
PREFILL_TOKENS = 8192


def draft_dtype(setting: str, target: DecoderModel) -> torch.dtype:
    """``speculative.draft_dtype`` for a head on ``target``: "auto" is the target's dtype,
    except bfloat16 for a float32 target on a CPU whose oneDNN multiplies bf16 natively
    (a CPU draft step reads its weights from memory each time: SmolLM2's eagle3 head,
    one thread, 25 -> 17 ms for three steps). On CUDA the head's fused kernels and
    graphs take the target's dtype, so another one is refused."""
    if setting == "auto":
        if target.device.type == "cpu" and target.dtype == torch.float32 \
                and bf16_packing_available():
            return torch.bfloat16
        return target.dtype
    dtype = getattr(torch, setting)
    if target.device.type == "cuda" and dtype != target.dtype:
        wanted = str(target.dtype).removeprefix("torch.")
        raise DrafterConfigError("speculative.draft_dtype", setting,
                                 f"differs from the target's {wanted} on CUDA (the head's "
                                 "fused kernels and CUDA graphs run in the target's dtype)",
                                 f"set it to 'auto' or '{wanted}'")
    return dtype


class MtpEagleDrafter(Drafter):
    def __init__(self, config: Any, deps: DrafterDeps) -> None:
        from specloop.models import KVCache  # noqa: PLC0415

        target = deps.target.model
        self.num_draft_tokens = k = config.speculative.num_draft_tokens
        self.dtype = draft_dtype(config.speculative.draft_dtype, target)
        self.head = self._make_head(config, deps)
        self.cache = KVCache(self.head.block.args, deps.num_slots, deps.max_seq_len,
                             dtype=self.dtype, device=target.device,
                             pages=deps.target_cache.pages)
        self.scratch = self.cache.scratch_slot
        self.lm = DraftHead(target.lm_head_weight, lm_head_tp=config.parallel.lm_head_tp_in_adp,
                            max_rows=deps.num_slots, d2t=self.head.d2t, dtype=self.dtype)
        # Per slot: the target rows not yet fed to the head. Adaptive K does not call
        # propose at K = 0: rows of such iterations pile up (LAZY_ROWS more) and the next
        # drafting iteration feeds them all at once.
        rows = k + 1 + (LAZY_ROWS if config.speculative.adaptive else 0)
        self.pending = PendingRows(deps.num_slots, rows, self.head.feature_size,
                                   dtype=target.dtype, device=target.device)
        # (the batch's slots, padding rows) -> chained_inputs' per-batch ``meta`` and its
        # slot row (the same tensors while the batch stays: a replay copies them once).
        self._chain_meta_of: tuple[tuple[tuple[int, ...], int],
                                   tuple[torch.Tensor, torch.Tensor]] | None = None
        # Per graph rows, [2, rows], one buffer for every draft graph of those rows: each
        # row's length, and its catch-up start, which the graph reads and then overwrites
        # with its ``start_pos`` output (VERIFY n+1's positions: the next chained step's
        # catch-up start). Written before a replay (the starts) and by it.
        self._lengths: dict[int, torch.Tensor] = {}
        # The last chained call's (slots, graph rows), and whether its step was taken for
        # all those slots since with no draft replay in between: the next chained step's
        # catch-up starts then lie in ``_lengths`` on the device (its ``start_pos``).
        self._last_chain: tuple[tuple[int, ...], int] | None = None
        self._starts_on_device = False
        # prefill_many shares the head's forwards between prompts (on a GPU; tests set it).
        self.batch_prefill = self.cache.device.type == "cuda"
        # Set by prefill_graphs at warm-up: the padded shapes and their graphs' replay.
        self._prefill_shapes: frozenset[tuple[int, int]] = frozenset()
        self._prefill_replay: PrefillReplay | None = None
        # Pinned host buffers for a captured shape's slots and tokens (``_prefill_into``).
        self._prefill_staging = StagingRing(self.cache.device, torch.int64)
        # Per draft tree: its levels' index tensors (``_tree_plan``).
        self._tree_plans: dict[DraftTree, list[_TreeLevel]] = {}

    @staticmethod
    def weights_path(config: Any, deps: DrafterDeps) -> Path | None:
        """The checked head file (sha256 against its card, target shape), or None."""
        weights = config.speculative.draft_weights or config.speculative.mtp_weights
        if not weights:
            return None
        path, card = resolve_head(weights)
        check_sha256(path, card)
        meta = head_metadata(path)
        check_target(path, meta, deps.target.args)
        check_method(path, meta, config.speculative.method)
        return path

    def _make_head(self, config: Any, deps: DrafterDeps) -> MtpEagleHead:
        target = deps.target.model
        return load_or_init(MtpEagleHead(target, dtype=self.dtype, device=target.device),
                            self.weights_path(config, deps))

    @property
    def needs_empty_calls(self) -> bool:
        return self.lm.lm_head_tp

    @property
    def variable_k(self) -> bool:
        return True

    @property
    def drafts_trees(self) -> bool:
        """Draft trees (``DraftContext.tree``): ``_draft_tree_local`` with the local head
        (eager, or ``tree_graph_step`` captured), ``_draft_tree_tp`` under LM-head TP."""
        return True

    @inference_mode
    def prefill(self, slot: int, token_ids: Sequence[int], hidden: torch.Tensor | None) -> None:
        """Feed positions 0..P-2 of the prompt; position P-1 stays pending for DRAFT."""
        if hidden is None:
            raise ValueError(f"{type(self).__name__} needs the target's hidden states")
        n = len(token_ids)
        if n >= 2:
            dev = self.cache.device
            self.head(torch.tensor([list(token_ids[1:])], device=dev), hidden[None, :n - 1],
                      torch.tensor([0], device=dev), torch.tensor([slot], device=dev),
                      self.cache)
        self.pending.prompt(slot, n, hidden)

    @inference_mode
    def prefill_many(self, slots: Sequence[int], token_ids: Sequence[Sequence[int]],
                     hidden: Sequence[torch.Tensor | None]) -> None:
        """With ``batch_prefill`` (on a GPU, where an eager head forward costs its
        kernel launches whatever its rows), the head's forwards over several prompts are
        shared, at most PREFILL_TOKENS tokens each counting the padding: rows
        right-padded to the longest, whose padding writes head K/V past each row's own
        positions (the catch-up writes them again before any query reads them) or into
        the scratch page. With prefill graphs (``prefill_graphs``, captured at warm-up)
        every forward, one prompt's too, runs at a captured padded shape (padding rows
        on the scratch slot) and replays its graph; prompts wider than the widest shape
        run eagerly. Elsewhere one forward per request, as ``prefill``."""
        if any(h is None for h in hidden):
            raise ValueError(f"{type(self).__name__} needs the target's hidden states")
        rows = [(s, t, h) for s, t, h in zip(slots, token_ids, hidden) if h is not None]
        fed = [row for row in rows if len(row[1]) >= 2]
        if not self.batch_prefill or (len(fed) < 2 and not self._prefill_shapes):
            for slot, ids, h in rows:
                self.prefill(slot, ids, h)
            return
        group: list[tuple[int, Sequence[int], torch.Tensor]] = []
        for row in sorted(fed, key=lambda r: len(r[1])):
            if group and not self._fits(len(group) + 1, len(row[1]) - 1):
                self._prefill_rows(group)
                group = []
            group.append(row)
        if group:
            self._prefill_rows(group)
        for slot, ids, h in rows:
            self.pending.prompt(slot, len(ids), h)

    def _fits(self, rows: int, width: int) -> bool:
        if self._prefill_shapes:
            return padded_shape(rows, width) in self._prefill_shapes
        return rows * width <= PREFILL_TOKENS

    def _prefill_rows(self, group: list[tuple[int, Sequence[int], torch.Tensor]]) -> None:
        """One head forward over [B, W]: row b feeds its prompt's positions 0..n_b - 2;
        at a captured padded shape, the graph's (``prefill_graphs``)."""
        real, width = len(group), max(len(ids) - 1 for _, ids, _ in group)
        shape = padded_shape(real, width)
        rows, width = shape if shape in self._prefill_shapes else (real, width)
        replay = self._prefill_replay
        statics = replay.static_inputs((rows, width)) if replay is not None else None
        if replay is not None and statics is not None:
            self._prefill_into(statics, group, rows, width)
            self.cache.pages.sync()
            replay((rows, width), statics)
            return
        host = torch.zeros(rows, width + 1, dtype=torch.int64)
        host[:, 0] = self.scratch       # padding rows: the scratch slot
        for row, (slot, ids, _) in enumerate(group):
            host[row, 0] = slot
            host[row, 1:len(ids)] = torch.tensor(list(ids[1:]), dtype=torch.int64)
        dev = self.cache.device
        host = to_device(host, dev)
        features = torch.zeros(rows, width, self.head.feature_size, dtype=self.cache.dtype,
                               device=dev)
        for row, (_, ids, h) in enumerate(group):
            features[row, :len(ids) - 1] = h[:len(ids) - 1]
        inputs = {"tokens": host[:, 1:], "features": features, "slots": host[:, 0]}
        if replay is not None:
            self.cache.pages.sync()     # an eager forward syncs the table itself
        if replay is None or replay((rows, width), inputs) is None:
            self._prefill_step(inputs)

    def _prefill_into(self, statics: dict[str, torch.Tensor],
                      group: list[tuple[int, Sequence[int], torch.Tensor]], rows: int,
                      width: int) -> None:
        """A captured shape's inputs written in place into its graph's static inputs: the
        slots and tokens from a pinned buffer of the staging ring (one copy each, nothing
        pinned or allocated a call), each row's feature rows copied in. Past a row's
        prompt the tokens are 0 and the features keep what the last prefill left there
        (finite: earlier prompts' rows, or the capture's zeros): padding, whose head K/V
        the catch-up writes again before any query reads them (positions past a
        prompt's) or that lands in the scratch page (padding rows)."""
        ring = self._prefill_staging
        flat, buffer = ring.take(rows * (width + 1))
        slots = flat[:rows]
        tokens = flat[rows:rows * (width + 1)].reshape(rows, width)
        slots[:] = self.scratch         # padding rows: the scratch slot
        tokens[:] = 0
        features = statics["features"]
        for row, (slot, ids, h) in enumerate(group):
            n = len(ids) - 1
            slots[row] = slot
            tokens[row, :n] = ids[1:]
            features[row, :n].copy_(h[:n], non_blocking=True)
        ring.copy_into(buffer, [statics["slots"], statics["tokens"]])

    def _prefill_step(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        slots = inputs["slots"]
        return {"hidden": self.head(inputs["tokens"], inputs["features"],
                                    torch.zeros_like(slots), slots, self.cache)}

    def prefill_graphs(self, shapes: Sequence[tuple[int, int]], replay: PrefillReplay
                       ) -> list[tuple[tuple[int, int], Step, dict[str, torch.Tensor]]]:
        """The head's prefill forward at each padded shape (on the scratch slot), with
        the fused kernels only (positions past max_seq_len land in the scratch page and
        lengths stay on the device); prefill_many then groups prompts by these shapes."""
        if not (self.batch_prefill and self.head.block.uses_kernels):
            return []
        self._prefill_shapes, self._prefill_replay = frozenset(shapes), replay
        dev, size = self.cache.device, self.head.feature_size
        # Broadcast views: nothing allocated per shape unless a graph is captured (its
        # static inputs are contiguous copies).
        zeros = torch.zeros(1, 1, size, dtype=self.cache.dtype, device=dev)
        return [(shape, self._prefill_step,
                 {"tokens": torch.zeros(*shape, dtype=torch.int64, device=dev),
                  "features": zeros.expand(*shape, size),
                  "slots": torch.full((shape[0],), self.scratch, device=dev)})
                for shape in shapes]

    def on_verified(self, slots: Sequence[int], start_pos: Sequence[int], hidden: torch.Tensor,
                    num_accepted: Sequence[int]) -> None:
        """hidden [B, K+1, H] of VERIFY at positions start_pos..; rows 0..n are committed:
        kept for the next catch-up (stored lazily: _pending_rows.py)."""
        self.pending.verified(slots, start_pos, hidden, num_accepted)

    def release(self, slot: int) -> None:
        self.pending.zero([slot])

    @inference_mode
    def _draft_steps(self, inputs: dict[str, torch.Tensor], *, kv_len: int | None,
                     k: int) -> DraftLoop:
        """The one drafting loop, eager and graph alike, as a generator: the catch-up (each
        row's pending target rows), then K steps of the head on its own outputs. It yields
        the head's hidden state for draft step j, [B, H], and is sent that step's tokens
        [B]; the caller turns hidden states into tokens (local head, or LM-head TP, whose
        collectives must run on the event loop). inputs: cu_tokens [B, W], cu_hidden
        [B, W, H], cu_start [B], write_slots [B], cu_last [B], slots [B], seq_lens [B].
        With k = 0 it yields the catch-up's hidden state once (the caller drafts nothing)."""
        cache, slots, seq_lens = self.cache, inputs["slots"], inputs["seq_lens"]
        # Each row's last catch-up row alone out of the head (its final norm reads that row:
        # no gather kernel after it; a draft step is launch-bound on a GPU).
        hidden = self.head(inputs["cu_tokens"], inputs["cu_hidden"], inputs["cu_start"],
                           inputs["write_slots"], cache, kv_len=kv_len,
                           last=inputs["cu_last"])
        tokens: torch.Tensor    # sent in by the caller after each step
        # k = 0 (adaptive K): the catch-up alone (yielded once, never sent to), so the
        # head's cache stays current.
        for j in range(max(k, 1)):
            if j:
                # Draft step j >= 1: input (own hidden, d_j) at position L - 2 + j (the
                # offset goes to the kernels as a constant: no position tensor per step).
                hidden = self.head(tokens[:, None], hidden[:, None], seq_lens, slots,
                                   cache, kv_len=kv_len, pos_offset=j - 2)[:, 0]
            tokens = yield hidden

    def _catch_up_columns(self, ctx: DraftContext, rows: int, width: int
                          ) -> dict[str, list[Any]]:
        """Host columns of the catch-up for ``rows`` rows (the real ones, then padding on
        the scratch slot), each row's pending target rows right-padded to ``width``."""
        real, pad = len(ctx.token_ids), rows - len(ctx.token_ids)
        own = ctx.slot_list()
        counts = self.pending.counts(own)
        starts = self.pending.starts(own)
        tokens: list[list[int]] = []
        for seq, start, count in zip(ctx.token_ids, starts, counts):
            toks = list(seq[start + 1:start + 1 + count]) or [seq[-1]]
            tokens.append(toks + [toks[-1]] * (width - len(toks)))
        # Padding rows: token 0 at position 0 of the scratch slot. A 1-token prompt has no
        # target row yet: it runs on zeros in its own slot (the shared scratch slot would
        # let batch neighbours see each other's K/V).
        slots = own + [self.scratch] * pad
        return {"cu_tokens": tokens + [[0] * width] * pad, "cu_start": starts + [0] * pad,
                "write_slots": slots, "cu_last": [max(c, 1) - 1 for c in counts] + [0] * pad,
                "slots": slots}

    def graph_inputs(self, ctx: DraftContext) -> dict[str, torch.Tensor]:
        """Static-shape draft inputs for the graph's rows (padding: scratch slot), in the
        form the chained step gives them (``graph_step``): ``verified`` [Bp, K+2] each
        row's catch-up tokens then its last catch-up row (VERIFY's ``packed`` layout:
        tokens, count), ``cu_hidden`` [Bp, K+1, F], ``meta`` [4, Bp] (slot, 1 on real
        rows, length and VERIFY position less the catch-up start + the last row: 2 and 1
        unless a row's pending rows end early; padding 2 and 0). Each row's catch-up
        start (padding 0) is written into the graphs' ``_lengths`` buffer (the graph reads
        it there: a chained step's own output, ``chained_inputs``)."""
        k, real, rows = self.num_draft_tokens, len(ctx.token_ids), ctx.graph_rows
        pad = rows - real
        columns = self._catch_up_columns(ctx, rows, k + 1)
        starts, last = columns["cu_start"], columns["cu_last"]
        seq_off = [n - s - c for n, s, c in zip(ctx.seq_len_list(), starts, last)]
        meta = [columns["slots"], [1] * real + [0] * pad, seq_off + [2] * pad,
                [o - 1 for o in seq_off] + [0] * pad]
        inputs = graph_int_inputs(ctx, {
            "verified": [t + [c] for t, c in zip(columns["cu_tokens"], last)],
            "cu_start": starts, "meta": meta})
        self._lengths_of(rows)[1].copy_(inputs.pop("cu_start"))
        inputs["cu_hidden"] = self.pending.rows(inputs["meta"][0], k + 1)
        return inputs

    def _lengths_of(self, rows: int) -> torch.Tensor:
        """The draft graphs' [2, rows] buffer: each row's length, then its catch-up start
        before a replay and VERIFY's position (the ``start_pos`` output) after it."""
        buffer = self._lengths.get(rows)
        if buffer is None:
            with torch.inference_mode(False):   # written in graphs, read out of them
                buffer = self._lengths[rows] = torch.zeros(
                    2, rows, dtype=torch.int64, device=self.pending.buffer.device)
        return buffer

    def tree_graph_step(self, sampler: Sampler, template: SamplingBatch, tree: DraftTree
                        ) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        """``graph_step``'s catch-up and glue, then ``tree_from_root`` (outputs as
        ``graph_step``'s, ``token_ids`` [Bp, N] the tree's nodes, VERIFY's ``tokens``
        [Bp, 1 + N])."""
        return self.graph_step(sampler, template, advanced=False, tree=tree)

    def graph_step(self, sampler: Sampler, template: SamplingBatch, *, advanced: bool,
                   num_draft_tokens: int | None = None, tree: DraftTree | None = None
                   ) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        """``_draft_steps`` on static tensors (``graph_inputs``' form), drafting with the
        local head (argmax, or sampled with q kept); for CUDA-graph capture. Never used on
        the LM-head-TP path (collectives). The catch-up's last row, lengths and VERIFY's
        next inputs are computed in the graph (the chained step's glue: no eager kernel
        per iteration): outputs ``token_ids`` [Bp, K] (and ``probs``), ``tokens``
        [Bp, K+1] (VERIFY's: each row's last catch-up token, then its drafts) and
        ``start_pos`` [Bp] (VERIFY's: length - 1, padding rows 0)."""
        kv_len = self.cache.max_seq_len
        k = self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        if tree is not None:    # the catch-up alone (a K = 0 loop), then the tree
            k = 0

        greedy = not advanced and type(sampler).draft is DefaultSampler.draft
        from specloop.models import _kernels  # noqa: PLC0415 (step's glue kernel)
        # Made before any capture (not in one: its memory and zero-fill outside graphs).
        lengths = self._lengths_of(template.size)

        # VERIFY's tokens [Bp, 1 + K] (a tree's: 1 + its nodes) where the drafts go into
        # their columns (a tree, greedy drafts, none at K = 0): made before the glue, which
        # writes column 0 (the step's first token), the drafts after it; no concatenation
        # joins them. Sampled drafts are stacked (graph_outputs) and joined after.
        in_columns = tree is not None or greedy or not k
        drafted = tree.size if tree is not None else k

        def drafts(inputs: dict[str, torch.Tensor], caught_up: Callable[[], None],
                   ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
            batch, seq_lens = template.with_columns(inputs), inputs["seq_lens"]
            loop = self._draft_steps(inputs, kv_len=kv_len, k=k)
            hidden = next(loop)
            caught_up()     # before anything reads seq_lens
            if tree is not None:
                return {"tokens": self.tree_from_root(hidden, seq_lens, inputs["slots"],
                                                      tree, kv_len, root_column=True,
                                                      into=ids)}
            if not k:
                return {"tokens": ids}
            if greedy:      # argmax drafts, each written into its column of the output
                assert ids is not None
                for j in range(1, k + 1):
                    if j > 1:
                        hidden = loop.send(ids[:, j - 1])
                    self.lm.greedy(hidden, out=ids[:, j], fused=self.head.block.uses_kernels)
                return {"tokens": ids}
            tokens: list[torch.Tensor] = []
            probs: list[torch.Tensor | None] = []
            for j in range(k):
                if j:
                    hidden = loop.send(tokens[-1])
                sample = sampler.draft(self.lm.logits(hidden), batch, seq_lens + j,
                                       advanced=advanced)
                tokens.append(sample.token_ids)
                probs.append(sample.probs)
            return graph_outputs(tokens, probs, advanced)

        def step(inputs: dict[str, torch.Tensor], into: dict[str, torch.Tensor]
                 ) -> dict[str, torch.Tensor]:
            verified, meta = inputs["verified"], inputs["meta"]
            width = verified.shape[1] - 1
            slots, is_real = meta[0], meta[1]
            if lengths.shape[1] != slots.shape[0]:
                raise ValueError(f"draft graph inputs of {slots.shape[0]} rows for a step "
                                 f"built for {lengths.shape[1]} (the template's)")
            seq_lens, start = lengths[0], lengths[1]    # the catch-up start, read first
            # Integer glue, as exact in the graph as on the host: the last catch-up row
            # (padding rows: 0), tokens -1 past a VERIFY's bonus made a valid id (0), each
            # row's length and VERIFY's position (one add for both: offsets + start + last,
            # written over the start once the catch-up has read it). With the kernels, one
            # kernel for all of it (_kernels.draft_glue: the catch-up reads a copy of the
            # start), not four.
            rows = verified.shape[0]
            # VERIFY's tokens and position where ``into`` names them (its static inputs:
            # DraftGraphStep), else the step's own.
            ids = None
            if in_columns:
                ids = _int64_into(into.get("tokens"), (rows, 1 + drafted))
                if ids is None:
                    ids = verified.new_empty(rows, 1 + drafted)
            position = _int64_into(into.get("start_pos"), (rows,))
            if self.head.block.uses_kernels and _kernels.draft_glue_fits(verified, meta,
                                                                         lengths):
                last, tokens, cu_start = _kernels.draft_glue(
                    verified, meta, lengths, None if ids is None else ids[:, 0], position)
                if position is not None:
                    start = position

                def caught_up() -> None:
                    pass
            else:
                last = verified[:, width] * is_real
                tokens = verified[:, :width].clamp(min=0)
                at = start + last
                cu_start = start
                if ids is not None:
                    torch.gather(tokens, 1, last[:, None], out=ids[:, :1])

                def caught_up() -> None:
                    torch.add(meta[2:], at, out=lengths)

            out = drafts({"cu_tokens": tokens, "cu_hidden": inputs["cu_hidden"],
                          "cu_start": cu_start, "write_slots": slots, "cu_last": last,
                          "slots": slots, "seq_lens": seq_lens,
                          **{name: inputs[name] for name in SamplingBatch.COLUMNS}}, caught_up,
                         ids)
            if ids is not None:     # the drafts in their columns, column 0 written above
                out["token_ids"] = ids[:, 1:]
            else:                   # sampled drafts (graph_outputs' stack)
                out["tokens"] = torch.cat([tokens.gather(1, last[:, None]),
                                           out["token_ids"]], 1)
            out["start_pos"] = start
            return out

        return DraftGraphStep(step)

    @inference_mode
    def _eager_inputs(self, ctx: DraftContext) -> dict[str, torch.Tensor]:
        """The catch-up, each row's pending rows right-padded to ``_eager_width``."""
        real = len(ctx.token_ids)
        width = self._eager_width(self.pending.counts(ctx.slot_list()))
        columns = self._catch_up_columns(ctx, real, width)
        dev = ctx.slots.device
        inputs = {name: torch.tensor(v, device=dev) for name, v in columns.items()}
        inputs["cu_hidden"] = self.pending.rows(inputs["slots"], width)
        inputs.update(slots=ctx.slots, seq_lens=ctx.seq_lens)
        return inputs

    def _eager_width(self, counts: Sequence[int]) -> int:
        """The eager catch-up's width (each row's pending rows right-padded to it). On
        CUDA one of two fixed shapes -- the graphs' K + 1, or the pending buffer's whole
        depth after K = 0 iterations -- whose Triton kernels ``warm_up_eager`` compiled:
        a width of its own each time made Triton compile new specialisations (the query
        count's class, the attention's row blocks and splits) while serving, a 1.97 s
        stall on the H200. Elsewhere the longest row's (less to compute, nothing to
        compile)."""
        longest = max(max(counts, default=1), 1)
        if self.cache.device.type != "cuda":
            return longest
        graph_width = self.num_draft_tokens + 1
        return graph_width if longest <= graph_width else self.pending.depth

    @inference_mode
    def warm_up_eager(self, max_batch_size: int, sampler: Sampler) -> None:
        """The eager proposal at both of ``_eager_width``'s CUDA widths, on the scratch
        slot: the catch-up, then K head steps, each step's logits drafted by ``sampler``
        greedily and sampled (the eager steps draft through it, not the graphs' fused
        argmax). At every row count the skinny GEMMs take (their configuration is chosen
        by exact row ranges, models/_linear.py), then 64, 128 .. up to ``max_batch_size``
        rounded up to a power of two (the attention's splits and the greedy argmax's
        chunks count the batch so rounded): every batch's kernels."""
        from specloop.models._kernels import _pow2  # noqa: PLC0415
        from specloop.models._linear import SKINNY_MAX_ROWS  # noqa: PLC0415

        dev, k = self.cache.device, self.num_draft_tokens
        widths = sorted({self._eager_width([1]), self._eager_width([self.pending.depth])})
        every = range(1, min(max_batch_size, SKINNY_MAX_ROWS) + 1)
        powers = (1 << p for p in range(_pow2(max_batch_size).bit_length()))
        for rows in sorted({*every, *powers}):
            scratch = torch.full((rows,), self.scratch, dtype=torch.int64, device=dev)
            zeros = torch.zeros(rows, dtype=torch.int64, device=dev)
            greedy, sampled = (SamplingBatch.padding(rows, all_greedy=g, device=dev)
                               for g in (True, False))
            for width in widths:
                inputs = {"cu_tokens": torch.zeros(rows, width, dtype=torch.int64, device=dev),
                          "cu_hidden": self.pending.rows(scratch, width), "cu_start": zeros,
                          "write_slots": scratch, "cu_last": zeros + width - 1,
                          "slots": scratch, "seq_lens": zeros + width + 1}
                loop = self._draft_steps(inputs, kv_len=None, k=k)
                hidden = next(loop)
                for step in range(k):
                    logits, positions = self.lm.logits(hidden), inputs["seq_lens"] + step
                    sampler.draft(logits, sampled, positions, advanced=True)
                    tokens = sampler.draft(logits, greedy, positions, advanced=False).token_ids
                    if step + 1 < k:
                        hidden = loop.send(tokens)

    @property
    def can_chain(self) -> bool:
        return True

    @inference_mode
    def chained_inputs(self, verified: dict[str, torch.Tensor], start: Sequence[int],
                       slots: Sequence[int], sampling: SamplingBatch,
                       into: dict[str, torch.Tensor] | None = None,
                       tokens: Sequence[Sequence[int]] | None = None,
                       continued: bool = False
                       ) -> dict[str, torch.Tensor]:
        """The draft graph's inputs (``graph_inputs``' form) from VERIFY n's outputs as
        they are: ``packed`` (tokens, -1 past the bonus, then the count: the catch-up's
        tokens and last row) and ``hidden``; each row's catch-up is that VERIFY's K + 1
        rows at ``start`` (rows 0..n committed; the rest sit at positions >= the new
        length - 1, which the draft steps and the next catch-up write before any query
        reads them, as the graph's own padding rows do), its new length start + n + 2.
        Padding rows as ``graph_inputs`` pads them (scratch slot, start 0, last row 0,
        length 2). The graph computes VERIFY n+1's ``tokens`` and ``start_pos``.
        ``start`` goes to the device (the graphs' ``_lengths``) only when it is not
        there: after a chained step taken for this very batch, that step's ``start_pos``
        output is it (``chained_consumed``). ``packed`` and ``hidden`` may be the draft
        graph's static ``verified`` and ``cu_hidden`` themselves (``into``: the chain
        wrote a smaller K's VERIFY there), which the replay then does not copy;
        ``tokens`` and ``continued`` are not used."""
        rows = sampling.size
        meta, slot_row = self._chain_meta(slots, rows)
        key, last = (tuple(slots), rows), self._last_chain
        if not (self._starts_on_device and last == key):
            # Each row's start into the graphs' buffer (one copy; pinned: queued without
            # waiting), unless the last chained step left it there (taken for this batch).
            copy_into(self._lengths_of(rows)[1],
                      int64_tensor([*start, *[0] * (rows - len(start))]))
        self._last_chain, self._starts_on_device = key, False
        inputs = {"verified": static_or_view(verified["packed"], into, "verified"),
                  "cu_hidden": static_or_view(verified["hidden"], into, "cu_hidden"),
                  "meta": meta, "slots": slot_row}
        inputs.update(sampling.columns())
        return inputs

    def _chain_meta(self, slots: Sequence[int], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(``meta`` [4, rows]: each row's slot (padding rows the scratch slot), 1 on real
        rows, 2, 1 on real rows; its slot row) on the device, made once per batch: while
        the batch stays, the same tensors go in, and a replay does not copy an input it
        was given last time again."""
        key = (tuple(slots), rows)
        if self._chain_meta_of is None or self._chain_meta_of[0] != key:
            pad = rows - len(slots)
            real = [1] * len(slots) + [0] * pad
            host = int64_tensor([*slots, *[self.scratch] * pad, *real, *[2] * rows, *real])
            meta = to_device(host, self.pending.buffer.device).view(4, rows)
            self._chain_meta_of = (key, (meta, meta[0]))
        return self._chain_meta_of[1]

    @property
    def chains_joiners(self) -> bool:
        return True

    def joining_rows(self, slots: Sequence[int]) -> torch.Tensor:
        """Each slot's pending prompt row (``prefill`` left it: position P - 2)."""
        return self.pending.prompt_rows(slots)

    def chained_consumed(self, slots: Sequence[int]) -> None:
        """The chained step fed these slots' rows (as ``propose`` would have); when they
        are all of its batch, its ``start_pos`` output is the next chained step's start."""
        self.pending.zero(slots)
        last = self._last_chain
        self._starts_on_device = last is not None and tuple(slots) == last[0]

    def _replay(self, ctx: DraftContext, advanced: bool) -> DraftProposal:
        proposal = replay_proposal(ctx, self.graph_inputs(ctx),
                                   advanced and ctx.draft_count(self) > 0)
        self.pending.zero(ctx.slot_list())
        return proposal

    def can_graph(self, advanced: bool) -> bool:
        return advanced or not self.lm.lm_head_tp

    async def propose(self, ctx: DraftContext) -> DraftProposal:
        # A DRAFT of its own: the lengths moved past the last chained step's positions
        # (and a replay overwrites them).
        self._starts_on_device = False
        rows, k = len(ctx.token_ids), ctx.draft_count(self)
        advanced = ctx.spec.wants_advanced_draft_sampling
        # The graph's catch-up is K + 1 rows wide: more pending rows (after K = 0
        # iterations) take the eager path once.
        if rows and ctx.replay is not None and self.can_graph(advanced) and max(
                self.pending.counts(ctx.slot_list())) <= self.num_draft_tokens + 1:
            if self.cache.device.type == "cuda":
                # Queueing a replay costs the host little: no hop into the compute thread
                # and back (~0.1-0.2 ms per iteration), as VERIFY on CUDA.
                return self._replay(ctx, advanced)
            return await ctx.run_sync(lambda: self._replay(ctx, advanced))
        if ctx.tree is not None and self.lm.uses_collectives(ctx):
            return await self._draft_tree_tp(ctx, ctx.tree)
        if rows == 0 and ctx.tree is not None:
            return DraftProposal(torch.zeros(0, ctx.tree.size, dtype=torch.int64))
        if rows == 0:
            # An idle rank still enters every LM-head-TP collective, with dummy rows.
            hidden = self.pending.buffer.new_zeros(0, self.head.block.args.hidden_size)
            if self.lm.uses_collectives(ctx):
                for step in range(k):
                    await self.lm.tokens(ctx, hidden, step)
            return DraftProposal(torch.zeros(0, k, dtype=torch.int64))

        if ctx.tree is not None:
            tree = ctx.tree
            return await ctx.run_sync(lambda: self._draft_tree_local(ctx, tree))
        if not self.lm.uses_collectives(ctx):
            # The whole proposal in one hop into the compute thread (not 2K + 1).
            return await ctx.run_sync(lambda: self._draft_local(ctx, k))

        def start() -> tuple[DraftLoop, torch.Tensor]:
            steps = self._draft_steps(self._eager_inputs(ctx), kv_len=None, k=k)
            return steps, next(steps)

        loop, hidden = await ctx.run_sync(start)
        drafted: list[torch.Tensor] = []
        probs: list[torch.Tensor | None] = []
        for step in range(k):
            if step:
                prev = drafted[-1]
                hidden = await ctx.run_sync(lambda: loop.send(prev))
            token, q = await self.lm.tokens(ctx, hidden, step)
            drafted.append(token)
            probs.append(q)
        self.pending.zero(ctx.slot_list())
        if not k:
            return DraftProposal(torch.zeros(rows, 0, dtype=torch.int64, device=hidden.device))
        q = torch.stack(probs, dim=1) if probs[0] is not None else None
        return DraftProposal(torch.stack(drafted, dim=1), q)

    @inference_mode
    def _draft_local(self, ctx: DraftContext, k: int) -> DraftProposal:
        """The eager K-step proposal with the local head, on the compute thread: the
        same steps, logits and draft sampling as the LM-head-TP loop above."""
        loop = self._draft_steps(self._eager_inputs(ctx), kv_len=None, k=k)
        hidden = next(loop)
        drafted: list[torch.Tensor] = []
        probs: list[torch.Tensor | None] = []
        for step in range(k):
            if step:
                hidden = loop.send(drafted[-1])
            token, q = sample_draft_step(ctx, self.lm.logits(hidden), step)
            drafted.append(token)
            probs.append(q)
        self.pending.zero(ctx.slot_list())
        if not k:
            return DraftProposal(torch.zeros(len(ctx.token_ids), 0, dtype=torch.int64,
                                             device=hidden.device))
        return stack_proposal(drafted, probs)

    @inference_mode
    def _draft_tree_local(self, ctx: DraftContext, tree: DraftTree) -> DraftProposal:
        """A draft tree (samplers/_tree.py) with the local head, eager: the
        catch-up (its last row is the root's), then ``tree_from_root``.
        -> token_ids [B, N], the nodes in the tree's order."""
        loop = self._draft_steps(self._eager_inputs(ctx), kv_len=None, k=0)
        root = next(loop)
        loop.close()
        tokens = self.tree_from_root(root, ctx.seq_lens, ctx.slots, tree)
        self.pending.zero(ctx.slot_list())
        return DraftProposal(tokens)

    def tree_from_root(self, root: torch.Tensor, seq_lens: torch.Tensor,
                       slots: torch.Tensor, tree: DraftTree, kv_len: int | None = None,
                       *, root_column: bool = False, into: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """The tree's drafts from the root's head output ``root`` [B, H] (the catch-up's
        last row, at L - 2; ``seq_lens`` [B] the rows' lengths L): one head forward per
        depth over that depth's nodes, each fed its token and its parent's output hidden
        state at the position of its depth (stored at the position of its row: L - 2 +
        row), attending the head's cache before the tree and its own ancestors
        (``TreeMask``); a row's children are the ranks the tree names among its draft
        logits. The chain's nodes (0,), (0, 0), ... get the chain's tokens. ``kv_len``:
        the head's attended length (the cache's whole length: static shapes, no host
        sync, capturable; None: the positions written). -> token_ids [B, N], the nodes
        in the tree's order (``root_column``: [B, 1 + N], column 0 unwritten, for the
        caller's root token: VERIFY's input without a concatenation; ``into``: that
        [B, 1 + N] buffer, made by the caller)."""
        fused = self.head.block.uses_kernels and self.lm.fused_top_fits(
            max(level.width for level in self._tree_plan(tree, root.device)))
        steps = self._tree_steps(root, seq_lens, slots, tree, kv_len, whole_depth=fused,
                                 root_column=root_column, into=into)
        try:
            ask = next(steps)
            while True:
                hidden, level, tokens = ask
                if fused:   # the ranks straight into their nodes' columns: None sent
                    self.lm.top(hidden, level.width, fused=True,
                                into=(tokens, level.dest_depth))
                    ask = steps.send(None)
                else:
                    ask = steps.send(self.lm.top(hidden, level.width))
        except StopIteration as done:
            return done.value

    @inference_mode
    def _tree_steps(self, root: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor,
                    tree: DraftTree, kv_len: int | None, *, whole_depth: bool = False,
                    root_column: bool = False, into: torch.Tensor | None = None
                    ) -> Generator[tuple[torch.Tensor, _TreeLevel, torch.Tensor],
                                   torch.Tensor | None, torch.Tensor]:
        """``tree_from_root`` as a generator: at each depth it runs the head, then yields
        (hidden states [B * R, H], the level, the nodes' tokens [B, 1 + N]) and is sent
        the top ``level.width`` draft tokens of those R rows a request [B * R, width] (the
        local LM head's, or the group's under LM-head TP), which it puts into the
        children's columns; or None, when the caller has put them there itself (through
        ``level.dest_depth``). The R rows: the depth's rows with children
        (``level.expand``), or with ``whole_depth`` all its rows up to the last with
        children (``level.first`` .. ``level.end`` - 1: the head's output as it is, no
        gather; a row without children has no destination). Returns token_ids [B, N]
        (``root_column``: with the unwritten column 0 before them, [B, 1 + N])."""
        rows, n = root.shape[0], tree.size
        # Not zeroed (a fill kernel less): every node's column is written at its parent's
        # depth (it is some rank of its parent), before any depth reads it.
        tokens = torch.empty(rows, n + 1, dtype=torch.int64, device=root.device) \
            if into is None else into
        # Each depth's head output as the head returns it, read by the next depth: no
        # buffer of every node's rows to copy them into (a copy kernel a depth).
        above = root[:, None]   # depth 0's rows: the root alone
        for level in self._tree_plan(tree, root.device):
            a, b = level.first, level.end
            if level.mask is None:          # depth 0
                out = above
            else:                           # depth >= 1: the head over its rows
                # At L - 2 + a: the offset goes to the kernels as a constant (no add kernel).
                # Parents that form no view are read by index (the head's prologue).
                parents, index = level.parents_in(above)
                out = self.head(tokens[:, a:b], parents, seq_lens, slots, self.cache,
                                kv_len=kv_len, pos_offset=a - 2, tree=level.mask,
                                hidden_rows=index)
            assert level.expand is not None, "every depth above the deepest has children"
            ranked = out if whole_depth else level.expanding(out)
            top = yield ranked.flatten(0, 1), level, tokens
            if top is not None:
                level.place(tokens, top, whole_depth=whole_depth)
            above = out
        return tokens if root_column else tokens[:, 1:]

    async def _draft_tree_tp(self, ctx: DraftContext, tree: DraftTree) -> DraftProposal:
        """The draft tree under LM-head TP (eager): the head on this rank's rows, and at
        each depth the top ranks of the rows with children across the group's vocabulary
        shards (``DraftHead.top_tokens``: two collectives a depth, as a chain's step). An
        idle rank enters the same collectives with no rows."""
        rows = len(ctx.token_ids)
        device = self.cache.device
        if not rows:
            empty = self.pending.buffer.new_zeros(0, self.head.block.args.hidden_size)
            for level in self._tree_plan(tree, device):
                assert level.expand is not None
                await self.lm.top_tokens(ctx, empty, level.width, per_row=len(level.expand))
            return DraftProposal(torch.zeros(0, tree.size, dtype=torch.int64, device=device))

        @inference_mode
        def start() -> Generator[tuple[torch.Tensor, _TreeLevel, torch.Tensor],
                                 torch.Tensor | None, torch.Tensor]:
            loop = self._draft_steps(self._eager_inputs(ctx), kv_len=None, k=0)
            root = next(loop)
            loop.close()
            return self._tree_steps(root, ctx.seq_lens, ctx.slots, tree, None)

        steps = await ctx.run_sync(start)

        def advance(top: torch.Tensor | None
                    ) -> tuple[tuple[torch.Tensor, _TreeLevel, torch.Tensor] | None,
                               torch.Tensor | None]:
            # (the next ask, None), or (None, the tokens) at the end: a StopIteration
            # must not cross the coroutines that run this on the compute thread.
            try:
                return (next(steps) if top is None else steps.send(top)), None
            except StopIteration as done:
                return None, done.value

        ask, tokens = await ctx.run_sync(lambda: advance(None))
        while ask is not None:
            hidden, level, _ = ask
            assert level.expand is not None
            top = await self.lm.top_tokens(ctx, hidden, level.width,
                                           per_row=len(level.expand))
            ask, tokens = await ctx.run_sync(lambda: advance(top))
        assert tokens is not None
        self.pending.zero(ctx.slot_list())
        return DraftProposal(tokens)

    def _tree_plan(self, tree: DraftTree, device: torch.device) -> list[_TreeLevel]:
        """Per depth, the index tensors ``tree_from_root`` uses (built once a tree)."""
        plan = self._tree_plans.get(tree)
        if plan is None:
            plan = self._tree_plans[tree] = _tree_levels(tree, device)
        return plan


class _TreeLevel:
    """One depth d of a draft tree, as ``MtpEagleDrafter.tree_from_root`` runs it: the
    head over rows ``first`` .. ``end`` - 1 (depth >= 1: their ``parents``, ``mask``; up
    to the depth's last row with children: a row past it, a leaf, needs no head output,
    and no row attends it), then the children of rows ``expand``, ranked among the top
    ``width`` of their draft logits: ``dest_depth`` [end - first, width] names, for each
    row of the depth and rank, the node (column of the tokens [B, 1 + N]) it drafts, -1
    for none (``_kernels.topk_map``'s ``dest``; ``place`` reads the same map).

    Where an index is a run of rows (or one row repeated), the rows are taken as a view
    (``parents_of``, ``expanding``): on the GPU each gather is a kernel of its own in a
    launch-bound step. Parents that are no view go to the head as an index
    (``parents_in``), which its prologue kernel reads."""

    def __init__(self, tree: DraftTree, depth: int, device: torch.device) -> None:
        kids = tree.children()
        rows = [r for r, d in enumerate(tree.depths) if d == depth]
        # (A depth above the deepest always holds a row with children.)
        rows = rows[:rows.index(max(r for r in rows if r in kids)) + 1]
        self.first, self.end = rows[0], rows[-1] + 1
        self.mask: TreeMask | None = None
        # Indices into the depth above's rows (its head output, from its first row).
        above = min((r for r, d in enumerate(tree.depths) if d == depth - 1), default=0)
        parents = [tree.parents[r] - above for r in rows]
        self.parents = torch.tensor(parents, device=device)
        self._parent_run = _run(parents)
        if depth:
            a, b = self.first, self.end
            # Rows a..b-1 at depth d: RoPE position L - 2 + d = (L - 2 + a) + (d - a);
            # the tree's rows 1..b-1 stored so far end with them.
            self.mask = TreeMask(torch.full((b - a,), depth - a, device=device),
                                 tree.visible(device)[a:b, 1:b])
        expand = [r for r in rows if r in kids]
        # The rows with children as indices into this depth's own rows (its head output).
        own = [r - self.first for r in expand]
        self.expand = torch.tensor(own, device=device) if expand else None
        self._expand_run = _run(own)
        self.width = max(tree.paths[c - 1][-1] for r in expand for c in kids[r]) + 1
        dest = torch.full((self.end - self.first, self.width), -1, dtype=torch.int64)
        for r in expand:
            for c in kids[r]:
                dest[r - self.first, tree.paths[c - 1][-1]] = c
        self.dest_depth = dest.to(device)
        # For ``place``: (positions in the ranks a request, flattened; their nodes), for
        # the rows with children and for the whole depth's rows.
        self._placing = {whole: _placing(d, device) for whole, d in
                         ((False, dest[own]), (True, dest))}

    def parents_of(self, above: torch.Tensor) -> torch.Tensor:
        """The depth above's head output [B, its rows, H] -> this depth's rows' parents'
        [B, end - first, H]."""
        return _take(above, self.parents, self._parent_run)

    def parents_in(self, above: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``parents_of`` as (rows, None) where they form a view, else (``above``, the
        parents' index into it): the head reads them by index (no gather)."""
        if self._parent_run is None:
            return above, self.parents
        return self.parents_of(above), None

    def expanding(self, out: torch.Tensor) -> torch.Tensor:
        """This depth's head output [B, end - first, H] -> its rows with children
        [B, len(expand), H]."""
        assert self.expand is not None
        return _take(out, self.expand, self._expand_run)

    def place(self, tokens: torch.Tensor, top: torch.Tensor, *, whole_depth: bool = False
              ) -> None:
        """Put ``top`` [B * R, width] (the ranks, or any value per rank; R: the rows with
        children, or with ``whole_depth`` the depth's rows) into their nodes' columns of
        ``tokens`` [B, 1 + N]."""
        src, cols = self._placing[whole_depth]
        tokens[:, cols] = top.reshape(tokens.shape[0], -1)[:, src]


def _int64_into(t: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    """``t`` where a draft graph may write that output into it: int64 of ``shape``, rows
    contiguous (the kernels' columns); else None."""
    ok = t is not None and t.dtype == torch.int64 and tuple(t.shape) == shape and \
        t.stride(-1) == 1
    return t if ok else None


def _placing(dest: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """dest [R, width] (a node or -1) -> (the flat positions with a node, those nodes)."""
    flat = dest.flatten()
    return torch.nonzero(flat >= 0).flatten().to(device), flat[flat >= 0].to(device)


def _run(index: list[int]) -> tuple[int, int, int] | None:
    """(start, length, step) where ``index`` is a run start, start + 1, ... (step 1) or one
    row repeated (step 0); else None."""
    if not index:
        return None
    if all(i == index[0] for i in index):
        return index[0], len(index), 0
    if index == list(range(index[0], index[0] + len(index))):
        return index[0], len(index), 1
    return None


def _take(hidden: torch.Tensor, index: torch.Tensor, run: tuple[int, int, int] | None
          ) -> torch.Tensor:
    """hidden[:, index] [B, len(index), H], a view where ``index`` is a ``_run``."""
    if run is None:
        return hidden.index_select(1, index)
    start, length, step = run
    if step:
        return hidden[:, start:start + length]
    return hidden[:, start:start + 1].expand(-1, length, -1)


def _tree_levels(tree: DraftTree, device: torch.device) -> list[_TreeLevel]:
    return [_TreeLevel(tree, d, device) for d in range(tree.depth)]
