"""MTP-Eagle drafting: one head applied K times, fed by the target's hidden states.

The head fuses the target's hidden state at position p with the embedding of token p+1
(``fc([enorm(emb(t_{p+1})); hnorm(h_p)])``), runs one decoder layer with its own KV cache
and the target's LM head; its output at p predicts token p+2. After each VERIFY the rows
the target accepted (hidden states and tokens) are fed to the head first, so its cache
follows the committed sequence; then it drafts autoregressively on its own outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generator, Sequence, TypeVar

import attrs
import torch
from safetensors.torch import load_file, save_file

from specloop.samplers import DefaultSampler, Sampler, SamplingBatch

from .._grad import inference_mode
from ._heads import (check_method, check_sha256, check_target, head_metadata, resolve_head,
                     target_shape)
from ._lm_head import DraftHead
from ._protocol import (DraftContext, Drafter, DrafterDeps, DraftProposal, graph_int_inputs,
                        graph_outputs, replay_proposal, sample_draft_step, stack_proposal)

if TYPE_CHECKING:
    from specloop.models import DecoderModel, KVCache

HeadT = TypeVar("HeadT", bound="MtpEagleHead")
# The drafting loop: yields the head's hidden state per step, is sent that step's tokens.
DraftLoop = Generator[torch.Tensor, torch.Tensor, None]


class MtpEagleHead(torch.nn.Module):
    def __init__(self, target: DecoderModel, *, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        from specloop.models import DecoderModel  # noqa: PLC0415

        super().__init__()
        args = attrs.evolve(target.args, num_layers=1)
        h = args.hidden_size
        self.block = DecoderModel(args, dtype=dtype, device=device)
        # Shared with the target: embedding and LM head are not the head's own weights.
        self.block.embed_tokens = target.embed_tokens
        if target.lm_head is not None:
            self.block.lm_head = target.lm_head
        self.fc = torch.nn.Parameter(torch.empty(h, 2 * h, dtype=dtype, device=device),
                                     requires_grad=False)
        self.enorm = torch.nn.Parameter(torch.ones(h, dtype=dtype, device=device),
                                        requires_grad=False)
        self.hnorm = torch.nn.Parameter(torch.ones(h, dtype=dtype, device=device),
                                        requires_grad=False)
        # Reduced draft vocabulary (draft index -> target id, [N] i64), or None: all of V.
        self.d2t: torch.Tensor | None = None
        self.target_args = target.args     # the shape a saved head records

    @property
    def feature_size(self) -> int:
        """Width of the target rows the head reads at step 0 (here the final hidden)."""
        return self.block.args.hidden_size

    def own_state(self) -> dict[str, torch.Tensor]:
        shared = {"block.embed_tokens", "block.lm_head"}
        return {k: v for k, v in self.state_dict().items() if k not in shared}

    def init_random(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.own_state().items():
            if "norm" in name:
                p.data.fill_(1.0)
            else:
                p.data.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.02)

    def load(self, path: str) -> None:
        tensors = load_file(path)
        own = self.own_state()
        missing = sorted(set(own) - set(tensors))
        if missing:
            raise ValueError(f"MTP head file {path} lacks {missing}")
        for name, p in own.items():
            if tuple(tensors[name].shape) != tuple(p.shape):
                raise ValueError(f"MTP head file {path}: {name} has shape "
                                 f"{tuple(tensors[name].shape)}, expected {tuple(p.shape)}")
            p.data.copy_(tensors[name])
        self.d2t = tensors["d2t"].to(torch.int64) if "d2t" in tensors else None

    def save(self, path: str, metadata: dict[str, str] | None = None) -> None:
        tensors = {k: v.contiguous() for k, v in self.own_state().items()}
        if self.d2t is not None:
            tensors["d2t"] = self.d2t.contiguous()
        target = {f"target_{k}": str(v) for k, v in target_shape(self.target_args).items()}
        save_file(tensors, path, metadata={**target, **(metadata or {})})

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dim: one fused kernel where the block runs its kernels
        (a draft step is launch-bound on the GPU: the plain ops are ~7 kernels each)."""
        eps = self.block.args.rms_norm_eps
        if self.block.uses_kernels:
            from specloop.models import _kernels  # noqa: PLC0415
            return _kernels.add_rms_norm(x, None, weight, eps)[0]
        from specloop.models._layers import rms_norm  # noqa: PLC0415
        return rms_norm(x, weight, eps)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, start_pos: torch.Tensor,
                slots: torch.Tensor, cache: KVCache, kv_len: int | None = None,
                pos_offset: int = 0) -> torch.Tensor:
        """tokens [B, T] (t_{p+1}), hidden [B, T, H] (h_p) at positions start_pos +
        pos_offset.. -> the head's hidden [B, T, H]; logits come from the shared LM head."""
        if self.block.uses_kernels:
            # Embedding gather, both norms and the concat in one kernel (the same bits as
            # a norm kernel each: a draft step is launch-bound on the GPU).
            from specloop.models import _kernels  # noqa: PLC0415
            x = _kernels.eagle_prologue(tokens, self.block.embed_tokens, hidden, self.enorm,
                                        self.hnorm, self.block.args.rms_norm_eps)
        else:
            x = torch.cat([self.norm(self.block.embed(tokens), self.enorm),
                           self.norm(hidden, self.hnorm)], dim=-1)
        return self.block.forward_embeds(self.block.linear(x, self.fc), start_pos, slots, cache,
                                         kv_len=kv_len, pos_offset=pos_offset)


def load_or_init(head: HeadT, path: str | Path | None) -> HeadT:
    """The head with its trained weights from ``path``, or random ones (tests, training)
    when there is none."""
    if path is not None:
        head.load(str(path))
    else:
        head.init_random()
    return head


# Target rows a slot keeps beyond K + 1 under adaptive K (K = 0 iterations in a row).
LAZY_ROWS = 32
# At most this many tokens (counting the padding) per shared head prefill forward.
PREFILL_TOKENS = 8192


class MtpEagleDrafter(Drafter):
    def __init__(self, config: Any, deps: DrafterDeps) -> None:
        from specloop.models import KVCache  # noqa: PLC0415

        target = deps.target.model
        self.num_draft_tokens = k = config.speculative.num_draft_tokens
        self.head = self._make_head(config, deps)
        self.cache = KVCache(self.head.block.args, deps.num_slots, deps.max_seq_len,
                             dtype=target.dtype, device=target.device,
                             pages=deps.target_cache.pages)
        self.scratch = self.cache.scratch_slot
        self.lm = DraftHead(target.lm_head_weight, lm_head_tp=config.parallel.lm_head_tp_in_adp,
                            max_rows=deps.num_slots, d2t=self.head.d2t)
        # Per slot: the target rows not yet fed to the head (position start.., count rows).
        # Adaptive K does not call propose at K = 0: rows of such iterations pile up here
        # (LAZY_ROWS more) and the next drafting iteration feeds them all at once.
        rows = k + 1 + (LAZY_ROWS if config.speculative.adaptive else 0)
        self.pending = torch.zeros(deps.num_slots + 1, rows, self.head.feature_size,
                                   dtype=target.dtype, device=target.device)
        self.pending_start = [0] * (deps.num_slots + 1)
        self.pending_count = [0] * (deps.num_slots + 1)
        # on_verified's stores not yet made (slots, dst, src, hidden): a chained step
        # usually consumes them first (chained_consumed drops them: no host or GPU work),
        # else the next access to ``pending`` makes them, in order (_flush_pending).
        self._deferred: list[tuple[set[int], list[tuple[int, int]],
                                   list[tuple[int, int]], torch.Tensor]] = []
        # prefill_many shares the head's forwards between prompts (on a GPU; tests set it).
        self.batch_prefill = self.cache.device.type == "cuda"

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
        return load_or_init(MtpEagleHead(target, dtype=target.dtype, device=target.device),
                            self.weights_path(config, deps))

    @property
    def needs_empty_calls(self) -> bool:
        return self.lm.lm_head_tp

    @property
    def variable_k(self) -> bool:
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
        self._start_pending(slot, n, hidden)

    @inference_mode
    def prefill_many(self, slots: Sequence[int], token_ids: Sequence[Sequence[int]],
                     hidden: Sequence[torch.Tensor | None]) -> None:
        """With ``batch_prefill`` (on a GPU, where an eager head forward costs its
        kernel launches whatever its rows), the head's forwards over several prompts are
        shared, at most PREFILL_TOKENS tokens each counting the padding: rows
        right-padded to the longest, whose padding writes head K/V past each row's own
        positions (the catch-up writes them again before any query reads them) or into
        the scratch page. Elsewhere one forward per request, as ``prefill``."""
        if any(h is None for h in hidden):
            raise ValueError(f"{type(self).__name__} needs the target's hidden states")
        rows = [(s, t, h) for s, t, h in zip(slots, token_ids, hidden) if h is not None]
        fed = [row for row in rows if len(row[1]) >= 2]
        if not self.batch_prefill or len(fed) < 2:
            for slot, ids, h in rows:
                self.prefill(slot, ids, h)
            return
        group: list[tuple[int, Sequence[int], torch.Tensor]] = []
        for row in sorted(fed, key=lambda r: len(r[1])):
            if group and (len(group) + 1) * (len(row[1]) - 1) > PREFILL_TOKENS:
                self._prefill_rows(group)
                group = []
            group.append(row)
        self._prefill_rows(group)
        for slot, ids, h in rows:
            self._start_pending(slot, len(ids), h)

    def _prefill_rows(self, group: list[tuple[int, Sequence[int], torch.Tensor]]) -> None:
        """One head forward over [B, W]: row b feeds its prompt's positions 0..n_b - 2."""
        width = max(len(ids) - 1 for _, ids, _ in group)
        host = torch.zeros(len(group), width + 1, dtype=torch.int64)
        for row, (slot, ids, _) in enumerate(group):
            host[row, 0] = slot
            host[row, 1:len(ids)] = torch.tensor(list(ids[1:]), dtype=torch.int64)
        dev = self.cache.device
        host = (host.pin_memory() if dev.type == "cuda" else host).to(dev, non_blocking=True)
        features = torch.nn.utils.rnn.pad_sequence(
            [h[:len(ids) - 1] for _, ids, h in group], batch_first=True)
        self.head(host[:, 1:], features, torch.zeros_like(host[:, 0]), host[:, 0], self.cache)

    def _start_pending(self, slot: int, n: int, hidden: torch.Tensor) -> None:
        """Position n - 1 of an n-row prompt (its last target row) waits for DRAFT."""
        self._flush_pending()
        if n >= 1:
            self.pending[slot, 0] = hidden[n - 1]
        else:
            # A 1-token prompt has no target row: the head starts from zeros, never from
            # what the slot's previous user left here.
            self.pending[slot].zero_()
        self.pending_start[slot] = max(n - 1, 0)
        self.pending_count[slot] = 1 if n else 0

    def on_verified(self, slots: Sequence[int], start_pos: Sequence[int], hidden: torch.Tensor,
                    num_accepted: Sequence[int]) -> None:
        """hidden [B, K+1, H] of VERIFY at positions start_pos..; rows 0..n are committed.
        Rows not yet fed (no propose since: adaptive K's K = 0) are kept and these appended
        after them; when the buffer is full the older ones are dropped (the head then
        drafts with a gap in its cache: weaker drafts, never wrong outputs).

        With accepted drafts the store itself is deferred (``_deferred``): ``hidden`` is
        the chain's copy, a fresh eager output, or a captured VERIFY's static output that
        only a replay of the same graph overwrites, and that replay comes after DRAFT's
        ``propose`` (which makes the stores first) or is the chained step (copy)."""
        if not any(num_accepted):
            self._append_last_rows(slots, start_pos, hidden)
            return
        cap = self.pending.shape[1]
        # (slot, pending row) <- (batch row, VERIFY position)
        dst: list[tuple[int, int]] = []
        src: list[tuple[int, int]] = []
        for row, (slot, start, n) in enumerate(zip(slots, start_pos, num_accepted)):
            count = self.pending_count[slot]
            if count and self.pending_start[slot] + count == start and count + n + 1 <= cap:
                first = count
                self.pending_count[slot] = count + n + 1
            else:
                first = 0
                self.pending_start[slot], self.pending_count[slot] = start, n + 1
            dst.extend((slot, first + i) for i in range(n + 1))
            src.extend((row, i) for i in range(n + 1))
        self._deferred.append((set(slots), dst, src, hidden))

    def _flush_pending(self) -> None:
        """Make on_verified's deferred stores, oldest first (before any read or other
        write of ``pending``)."""
        deferred, self._deferred = self._deferred, []
        for _, dst, src, hidden in deferred:
            self._store_pending(dst, src, hidden)

    def _append_last_rows(self, slots: Sequence[int], start_pos: Sequence[int],
                          hidden: torch.Tensor) -> None:
        """``on_verified`` when no draft was accepted (adaptive K's K = 0 iterations: each
        batch row one pending row), with one index row per request: the same bookkeeping,
        a fraction of the host time at a large batch. Made now: ``hidden`` may be a step
        queued ahead's output, which the next one overwrites."""
        self._flush_pending()
        cap, count_of, start_of = self.pending.shape[1], self.pending_count, self.pending_start
        rows: list[int] = []
        for slot, start in zip(slots, start_pos):
            count = count_of[slot]
            if count and start_of[slot] + count == start and count < cap:
                count_of[slot] = count + 1
            else:
                start_of[slot], count_of[slot], count = start, 1, 0
            rows.append(count)
        index = torch.tensor([list(slots), rows], dtype=torch.int64)
        if self.pending.device.type == "cuda":
            index = index.pin_memory()      # queued without waiting for the device
        index = index.to(self.pending.device, non_blocking=True)
        self.pending[index[0], index[1]] = hidden[:len(rows), 0]

    def _store_pending(self, dst: list[tuple[int, int]], src: list[tuple[int, int]],
                       hidden: torch.Tensor) -> None:
        """pending[dst] = hidden[src]: one gather and one scatter whatever the batch (a
        copy per row cost a launch per row on the GPU), after one host-to-device copy."""
        if not dst:
            return
        index = torch.tensor([[*d, *s] for d, s in zip(dst, src)], dtype=torch.int64)
        if self.pending.device.type == "cuda":
            # Pinned: a copy from pageable memory first waits for the stream, i.e. for the
            # DRAFT + VERIFY chained behind this VERIFY (the GPU then idles while the host
            # runs up to the next chained step: ~0.3 ms an iteration at batch 1).
            index = index.pin_memory()
        index = index.to(self.pending.device, non_blocking=True)
        self.pending[index[:, 0], index[:, 1]] = hidden[index[:, 2], index[:, 3]]

    def release(self, slot: int) -> None:
        self.pending_count[slot] = 0

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
        out = self.head(inputs["cu_tokens"], inputs["cu_hidden"], inputs["cu_start"],
                        inputs["write_slots"], cache, kv_len=kv_len)
        # Each row's last catch-up row (one gather: a draft step is launch-bound on a GPU).
        last = inputs["cu_last"].view(-1, 1, 1).expand(-1, 1, out.shape[-1])
        hidden = out.gather(1, last)[:, 0]
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
        real = len(ctx.token_ids)
        slots = ctx.slot_list() + [self.scratch] * (rows - real)
        counts = [self.pending_count[s] for s in slots[:real]] + [1] * (rows - real)
        tokens: list[list[int]] = []
        starts: list[int] = []
        writes: list[int] = []
        for i, (slot, count) in enumerate(zip(slots, counts)):
            seq = ctx.token_ids[i] if i < real else [0]
            start = self.pending_start[slot] if i < real else 0
            toks = list(seq[start + 1:start + 1 + count]) or [seq[-1]]
            tokens.append(toks + [toks[-1]] * (width - len(toks)))
            starts.append(start)
            # A 1-token prompt has no target row yet: it runs on zeros in its own slot (the
            # shared scratch slot would let batch neighbours see each other's K/V).
            writes.append(slot if i < real else self.scratch)
        return {"cu_tokens": tokens, "cu_start": starts, "write_slots": writes,
                "cu_last": [max(c, 1) - 1 for c in counts], "slots": slots}

    def graph_inputs(self, ctx: DraftContext) -> dict[str, torch.Tensor]:
        """Static-shape draft inputs for the graph's rows (padding: scratch slot)."""
        k, real, rows = self.num_draft_tokens, len(ctx.token_ids), ctx.graph_rows
        columns = self._catch_up_columns(ctx, rows, k + 1)
        columns["seq_lens"] = ctx.seq_len_list() + [2] * (rows - real)
        inputs = graph_int_inputs(ctx, columns)
        self._flush_pending()
        inputs["cu_hidden"] = self.pending[inputs["slots"], :k + 1]
        return inputs

    def graph_step(self, sampler: Sampler, template: SamplingBatch, *, advanced: bool,
                   num_draft_tokens: int | None = None
                   ) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        """``_draft_steps`` on static tensors, drafting with the local head (argmax, or
        sampled with q kept); for CUDA-graph capture. Never used on the LM-head-TP path
        (collectives)."""
        kv_len = self.cache.max_seq_len
        k = self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens

        greedy = not advanced and type(sampler).draft is DefaultSampler.draft

        def step(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            batch, seq_lens = template.with_columns(inputs), inputs["seq_lens"]
            loop = self._draft_steps(inputs, kv_len=kv_len, k=k)
            hidden = next(loop)
            if not k:
                return {"token_ids": seq_lens.new_zeros(seq_lens.shape[0], 0)}
            if greedy:      # argmax drafts, each written into its column of the output
                ids = seq_lens.new_empty(seq_lens.shape[0], k)
                for j in range(k):
                    if j:
                        hidden = loop.send(ids[:, j - 1])
                    self.lm.greedy(hidden, out=ids[:, j], fused=self.head.block.uses_kernels)
                return {"token_ids": ids}
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

        return step

    @inference_mode
    def _eager_inputs(self, ctx: DraftContext) -> dict[str, torch.Tensor]:
        """The catch-up padded only to the longest row's pending rows."""
        real = len(ctx.token_ids)
        width = max(max(self.pending_count[s] for s in ctx.slot_list()), 1)
        columns = self._catch_up_columns(ctx, real, width)
        dev = ctx.slots.device
        inputs = {name: torch.tensor(v, device=dev) for name, v in columns.items()}
        self._flush_pending()
        inputs["cu_hidden"] = self.pending[inputs["slots"], :width]
        inputs.update(slots=ctx.slots, seq_lens=ctx.seq_lens)
        return inputs

    @property
    def can_chain(self) -> bool:
        return True

    @inference_mode
    def chained_inputs(self, verified: dict[str, torch.Tensor], start: Sequence[int],
                       slots: Sequence[int], sampling: SamplingBatch
                       ) -> dict[str, torch.Tensor]:
        """The catch-up of each row is that VERIFY's K + 1 rows at ``start`` (rows
        0..n committed; the rest sit at positions >= the new length - 1, which the draft
        steps and the next catch-up write before any query reads them, as the graph's
        own padding rows do), its tokens (-1 past the bonus: any valid id), cu_last n,
        the new length start + n + 2. Padding rows as ``graph_inputs`` pads them
        (scratch slot, start 0, cu_last 0, length 2)."""
        rows, real = sampling.size, len(start)
        pad = rows - real
        start = list(start)
        # One copy: the columns, each row's new length and VERIFY n+1's position less the
        # accepted count (padding rows: length 2, position 0, accepted count 0).
        host = torch.tensor([start + [0] * pad, list(slots) + [self.scratch] * pad,
                             [1] * real + [0] * pad, [s + 2 for s in start] + [2] * pad,
                             [s + 1 for s in start] + [0] * pad], dtype=torch.int64)
        dev = self.pending.device
        packed = (host.pin_memory() if dev.type == "cuda" else host).to(dev, non_blocking=True)
        cu_start, row_slots, is_real, length, position = packed
        accepted = verified["num_accepted"] * is_real
        tokens = verified["token_ids"].clamp(min=0)
        inputs = {"cu_tokens": tokens, "cu_hidden": verified["hidden"][:],
                  "cu_start": cu_start, "write_slots": row_slots, "cu_last": accepted,
                  "slots": row_slots, "seq_lens": length + accepted,
                  "bonus": tokens.gather(1, accepted[:, None]),
                  "start_pos": position + accepted}
        inputs.update(sampling.columns())
        return inputs

    def chained_consumed(self, slots: Sequence[int]) -> None:
        """The chained step fed these slots' rows: they are dead, and so are deferred
        stores whose slots all hold none now (a slot's rows are read only up to its count,
        and the next store into an empty slot starts at row 0)."""
        for slot in slots:
            self.pending_count[slot] = 0
        count = self.pending_count
        self._deferred = [d for d in self._deferred if any(count[s] for s in d[0])]

    def _replay(self, ctx: DraftContext, advanced: bool) -> DraftProposal:
        proposal = replay_proposal(ctx, self.graph_inputs(ctx),
                                   advanced and ctx.draft_count(self) > 0)
        for slot in ctx.slot_list():
            self.pending_count[slot] = 0
        return proposal

    def can_graph(self, advanced: bool) -> bool:
        return advanced or not self.lm.lm_head_tp

    async def propose(self, ctx: DraftContext) -> DraftProposal:
        rows, k = len(ctx.token_ids), ctx.draft_count(self)
        advanced = ctx.spec.wants_advanced_draft_sampling
        # The graph's catch-up is K + 1 rows wide: more pending rows (after K = 0
        # iterations) take the eager path once.
        if rows and ctx.replay is not None and self.can_graph(advanced) and max(
                self.pending_count[s] for s in ctx.slot_list()) <= self.num_draft_tokens + 1:
            if self.cache.device.type == "cuda":
                # Queueing a replay costs the host little: no hop into the compute thread
                # and back (~0.1-0.2 ms per iteration), as VERIFY on CUDA.
                return self._replay(ctx, advanced)
            return await ctx.run_sync(lambda: self._replay(ctx, advanced))
        if rows == 0:
            # An idle rank still enters every LM-head-TP collective, with dummy rows.
            hidden = self.pending.new_zeros(0, self.head.block.args.hidden_size)
            if self.lm.uses_collectives(ctx):
                for step in range(k):
                    await self.lm.tokens(ctx, hidden, step)
            return DraftProposal(torch.zeros(0, k, dtype=torch.int64))

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
        for slot in ctx.slot_list():
            self.pending_count[slot] = 0
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
        for slot in ctx.slot_list():
            self.pending_count[slot] = 0
        if not k:
            return DraftProposal(torch.zeros(len(ctx.token_ids), 0, dtype=torch.int64,
                                             device=hidden.device))
        return stack_proposal(drafted, probs)
