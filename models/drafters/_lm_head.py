"""Turning draft hidden states into draft tokens: local head, or LM-head TP under ADP.

Greedy path with LM-head TP (DESIGN.md, DRAFT): every rank pads its rows to M, all-gathers
them to [g*M, H], multiplies by its vocab shard [ceil(V/g), H] and the group takes the
distributed argmax; each rank keeps its own segment of rows. Advanced path: the local
full-vocab head (replicated under ADP), sampled with the draft stream, no collective.

A reduced draft vocabulary (``d2t``: draft index -> target id, N << V) keeps only those
rows of the LM head; logits outside it are -inf, so q is zero there and rejection
sampling stays exact.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from specloop.comm import Communicator, distributed_argmax, distributed_topk
from specloop.models._linear import PackedLinear

from ._protocol import DraftContext, sample_draft_step


class DraftHead:
    def __init__(self, weight: torch.Tensor, *, lm_head_tp: bool, max_rows: int,
                 d2t: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> None:
        self.vocab_size = weight.shape[0]          # V of the target
        self.d2t = None if d2t is None else d2t.to(weight.device)   # [N] i64 or None
        # An increasing map (a trained head's is): the fused argmax reads it once.
        self.d2t_increasing = d2t is not None and bool((d2t[1:] > d2t[:-1]).all())
        # [V, H] shared with the target, or a private copy: the draft rows [N, H], and/or
        # in the head's dtype (``dtype``, speculative.draft_dtype).
        rows = (weight if self.d2t is None else weight[self.d2t]).to(dtype or weight.dtype)
        self.weight = rows if rows is weight else rows.contiguous()
        self._private = self.weight is not weight
        # A private copy on the CPU runs on oneDNN-packed weights (PackedLinear: 2-32 rows
        # in fp32, from 1 row in bf16); 1 fp32 row fastest against the weight stored
        # [H, N] (MKL's gemv in that layout: ~2x F.linear's for [16384, 576] on this
        # project's x86 box, 4.3 vs 15 ms one thread). Draft numerics need no exactness:
        # VERIFY decides.
        cpu32 = self._private and self.weight.device.type == "cpu" and \
            self.weight.dtype == torch.float32
        self._weight_t = self.weight.t().contiguous() if cpu32 else None
        self._packed = PackedLinear()
        self.lm_head_tp = lm_head_tp
        self.max_rows = max_rows                   # M = max_batch_size

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> f32 logits over the target vocabulary [B, V]."""
        logits = self._matmul(hidden).float()
        if self.d2t is None:
            return logits
        full = logits.new_full((hidden.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.d2t, logits)

    def greedy(self, hidden: torch.Tensor, *, out: torch.Tensor | None = None,
               fused: bool = False) -> torch.Tensor:
        """hidden [B, H] -> argmax draft tokens [B] (target ids; into ``out`` when given):
        ``logits(hidden).argmax(-1)``. ``fused`` (CUDA): the draft rows' logits then one
        kernel for the argmax and the map to target ids (ties to the smallest target id,
        as argmax over the -inf-padded vocabulary), not a [B, V] scatter and an argmax."""
        if fused:
            from specloop.models import _kernels  # noqa: PLC0415
            return _kernels.argmax_map(self._matmul(hidden), self.d2t, out,
                                       increasing=self.d2t_increasing)
        if self.d2t is not None and self.d2t_increasing:
            # The first maximum (or NaN) of the draft rows is the smallest target id's
            # among them: the padded argmax's pick without the [B, V] scatter (on the CPU
            # that and the argmax over V cost ~0.8 ms a step against ~0.1 here).
            tokens = self.d2t[self._matmul(hidden).float().argmax(dim=-1)]
        else:
            tokens = self.logits(hidden).argmax(dim=-1)
        return tokens if out is None else out.copy_(tokens)

    def top(self, hidden: torch.Tensor, k: int, *, fused: bool = False,
            into: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """hidden [R, H] -> the k most likely draft tokens [R, k] (target ids), most likely
        first: a top-k over the draft rows' logits, mapped through ``d2t`` (no scatter to
        the whole vocabulary; a draft tree's children, ``tree_from_root``). ``fused``
        (CUDA, where ``fused_top_fits(k)``): one kernel for the top-k and the map
        (``_kernels.topk_map``: ties to the smallest target id; torch.topk's radix select
        cost ~50 us a depth on the H200); ``into`` = (tokens [B, W], dest [R / B, k]):
        the kernel writes rank j of row r into ``tokens[r // (R / B), dest[r % (R / B),
        j]]`` (skipped where -1) and this returns None. Elsewhere among equal logits the
        order is torch.topk's (drafts only: VERIFY decides what is kept)."""
        logits = self._matmul(hidden)
        if fused:
            from specloop.models import _kernels  # noqa: PLC0415
            if not self.fused_top_fits(k):
                raise ValueError(f"a fused top-{k} of {self.weight.shape[0]} draft rows")
            out, dest = into if into is not None else (None, None)
            ids = _kernels.topk_map(logits, k, self.d2t, increasing=self.d2t_increasing,
                                    out=out, dest=dest)
            return None if into is not None else ids
        ids = logits.topk(k, dim=-1).indices
        return ids if self.d2t is None else self.d2t[ids]

    def fused_top_fits(self, k: int) -> bool:
        """Whether ``top(..., k, fused=True)`` runs in one kernel (a row in one block)."""
        from specloop.models import _kernels  # noqa: PLC0415
        rows: int = self.weight.shape[0]
        return rows <= _kernels.TOPK_MAX_N and 1 <= k <= min(_kernels.TOPK_MAX_K, rows)

    def _matmul(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(self.weight.dtype)
        if self._weight_t is not None and hidden.shape[0] == 1 and not hidden.requires_grad:
            return hidden @ self._weight_t
        # CUDA: few rows on the skinny-GEMM kernel (models/_linear); a private copy on the
        # CPU packed; the target's shared [V, H] on the CPU through F.linear (no second
        # packed copy of it).
        if hidden.is_cuda or self._private:
            return self._packed(hidden, self.weight)
        return F.linear(hidden, self.weight)

    def uses_collectives(self, ctx: DraftContext) -> bool:
        # Reads the one predicate (group-synced when the gate is on); config decides TP.
        return self.lm_head_tp and not ctx.spec.wants_advanced_draft_sampling

    async def tokens(self, ctx: DraftContext, hidden: torch.Tensor, step: int
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [B, H] -> (draft tokens [B], q [B, V] or None)."""
        if self.uses_collectives(ctx):
            return await self._tp_argmax(ctx, hidden), None
        logits = await ctx.run_sync(lambda: self.logits(hidden))
        return sample_draft_step(ctx, logits, step)

    async def top_tokens(self, ctx: DraftContext, hidden: torch.Tensor, k: int, *,
                         per_row: int) -> torch.Tensor:
        """``top(hidden, k)`` for a draft tree's depth: with the local head, or under
        LM-head TP across the group's vocabulary shards (every rank calls it, an idle one
        with no rows; ``per_row``: the depth's rows a request, so every rank's rows pad
        to ``max_rows * per_row``)."""
        if not self.uses_collectives(ctx):
            ids = await ctx.run_sync(lambda: self.top(hidden, k))
            assert ids is not None
            return ids
        comm = ctx.comm
        shard_logits = await self._tp_shard_logits(ctx, hidden, self.max_rows * per_row)
        ids = await distributed_topk(comm, shard_logits, k, vocab_size=self.weight.shape[0])
        return self._own(ids, comm.rank * self.max_rows * per_row, hidden.shape[0])

    async def _tp_argmax(self, ctx: DraftContext, hidden: torch.Tensor) -> torch.Tensor:
        comm = ctx.comm
        shard_logits = await self._tp_shard_logits(ctx, hidden, self.max_rows)
        ids = await distributed_argmax(comm, shard_logits, vocab_size=self.weight.shape[0])
        return self._own(ids, comm.rank * self.max_rows, hidden.shape[0])

    async def _tp_shard_logits(self, ctx: DraftContext, hidden: torch.Tensor, m: int
                               ) -> torch.Tensor:
        """Every rank's rows (``hidden`` padded to ``m``) against this rank's vocabulary
        shard: [g*m, ceil(V/g)]; one all_gather."""
        comm = ctx.comm
        # In the head's dtype whatever the caller's rows (an idle rank's are empty): every
        # rank's all_gather must match.
        padded = hidden.new_zeros(m, hidden.shape[1], dtype=self.weight.dtype)
        padded[:hidden.shape[0]] = hidden
        stacked = await comm.all_gather(padded)                  # [g, m, H]
        return await ctx.run_sync(lambda: self._shard_logits(stacked, comm))

    def _own(self, ids: torch.Tensor, start: int, rows: int) -> torch.Tensor:
        """This rank's own rows of the group's ids, as target ids."""
        ids = ids[start:start + rows]
        return ids if self.d2t is None else self.d2t[ids]

    def _shard_logits(self, stacked: torch.Tensor, comm: Communicator) -> torch.Tensor:
        vocab, g = self.weight.shape[0], comm.world_size
        size = math.ceil(vocab / g)
        lo, hi = comm.rank * size, min((comm.rank + 1) * size, vocab)
        flat = stacked.reshape(-1, stacked.shape[-1])            # [g*M, H]
        logits = flat.new_zeros(flat.shape[0], size, dtype=torch.float32)
        if hi > lo:                                              # columns >= V stay padding
            logits[:, :hi - lo] = F.linear(flat, self.weight[lo:hi]).float()
        return logits                                            # [g*M, ceil(V/g)]
