"""The n-gram draft on the device, for a step chained behind VERIFY (engine/_chain.py).

Each request's committed tokens live in a device buffer (``history``: one row per slot,
plus the scratch slot's row for padding). One call of ``chain_step``, for every row b:

1. writes VERIFY n's committed tokens ``verified[b, 0..accepted[b]]`` at positions
   ``start[b] + 1 ..`` of its history row (the row's new length is
   ``L = start + accepted + 2``);
2. finds, for n from ``ngram_max`` down to ``ngram_min``, the latest earlier occurrence of
   the row's last n tokens (an n-gram ending before the last token) and drafts the K
   tokens after it: ``history[min(p + j, L - 1)]`` for j < K, where p is the position
   after the match, or L when no n matches (the last token repeated). This is
   ``NgramDrafter.propose_row`` exactly (its table keeps the latest occurrence of each
   n-gram ending before the last token; a draft running past the end repeats the last);
3. writes VERIFY n+1's first token (the bonus, ``verified[b, accepted[b]]``) and its
   position ``position[b] + accepted[b]`` into ``bonus`` / ``start_pos``.

Padding rows (``is_real`` 0) count no accepted token and use the scratch row. On CUDA it
is one Triton kernel (one launch inside the captured draft graph); elsewhere, and where
Triton is missing, the same function in tensor ops (``chain_step_ops``, the reference the
kernel is tested against).
"""

from __future__ import annotations

import torch

from specloop.samplers import _pdl

try:  # Triton is optional: without it the tensor-op function runs.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# meta rows: VERIFY n's start (L - 1), the history row (the KV slot; scratch on padding),
# 1 on real rows, VERIFY n+1's position less the accepted count (start + 1; 0 on padding).
START, ROW, IS_REAL, POSITION = range(4)


def chain_step(history: torch.Tensor, verified: torch.Tensor, accepted: torch.Tensor,
               meta: torch.Tensor, *, k: int, ngram_min: int, ngram_max: int,
               bonus: torch.Tensor, start_pos: torch.Tensor,
               next_meta: torch.Tensor | None = None) -> torch.Tensor:
    """-> drafts [B, k] (int64); writes ``history``, ``bonus`` [B] and ``start_pos`` [B]
    in place (see the module doc), and ``next_meta`` [4, B] when given: ``meta`` of the
    step after it for the same rows (each real row's start and position one past its
    accepted tokens: what the host would build once VERIFY n is read back). verified
    [B, K + 1], accepted [B], meta [4, B]."""
    if history.is_cuda and triton is not None:
        return _chain_step_triton(history, verified, accepted, meta, k=k,
                                  ngram_min=ngram_min, ngram_max=ngram_max, bonus=bonus,
                                  start_pos=start_pos, next_meta=next_meta)
    return chain_step_ops(history, verified, accepted, meta, k=k, ngram_min=ngram_min,
                          ngram_max=ngram_max, bonus=bonus, start_pos=start_pos,
                          next_meta=next_meta)


def chain_step_ops(history: torch.Tensor, verified: torch.Tensor, accepted: torch.Tensor,
                   meta: torch.Tensor, *, k: int, ngram_min: int, ngram_max: int,
                   bonus: torch.Tensor, start_pos: torch.Tensor,
                   next_meta: torch.Tensor | None = None) -> torch.Tensor:
    """``chain_step`` in tensor ops (static shapes: capturable, any device)."""
    start, row, is_real, position = meta[START], meta[ROW], meta[IS_REAL], meta[POSITION]
    rows, width = verified.shape
    stride = history.shape[1]
    acc = accepted * is_real
    # The next step's meta, computed now, written last (it may be ``meta`` itself).
    following = torch.stack([start + acc + is_real, row, is_real, position + acc + is_real])
    j = torch.arange(width, device=history.device)
    flat = (row * stride + start + 1)[:, None] + j[None]
    keep = j[None] <= acc[:, None]
    flat_hist = history.view(-1)
    # Rows past their accepted count write back what is there (a masked scatter).
    flat_hist[flat.reshape(-1)] = torch.where(keep, verified, flat_hist[flat]).reshape(-1)
    bonus.copy_(verified.gather(1, acc[:, None])[:, 0])
    start_pos.copy_(position + acc)
    # Adaptive K's K = 0: the bonus token and its position only.
    drafts = _match_drafts(history, row, start + acc + 2, k=k, ngram_min=ngram_min,
                           ngram_max=ngram_max) if k else verified.new_zeros(rows, 0)
    if next_meta is not None:
        next_meta.copy_(following)
    return drafts


def _match_drafts(history: torch.Tensor, row: torch.Tensor, length: torch.Tensor, *, k: int,
                  ngram_min: int, ngram_max: int) -> torch.Tensor:
    """Each row's k drafts [B, k]: what followed the latest earlier occurrence of its
    longest suffix of ngram_max .. ngram_min tokens (its first ``length`` tokens in
    ``history``), the last token repeated past the end (no match: from the end)."""
    seq = history.index_select(0, row)                        # [B, S]
    best = length.clone()
    found = torch.zeros_like(length, dtype=torch.bool)
    for n in range(ngram_max, ngram_min - 1, -1):
        offs = torch.arange(n, device=history.device)
        suffix = seq.gather(1, (length[:, None] - n + offs[None]).clamp(min=0))
        windows = seq.unfold(1, n, 1)                         # [B, S - n + 1, n]
        match = (windows == suffix[:, None, :]).all(dim=-1)
        after = torch.arange(n, n + windows.shape[1], device=history.device)[None]
        ok = match & (after <= length[:, None] - 1)
        cand = torch.where(ok, after, -1).amax(dim=1)
        take = ~found & (cand >= 0)
        best = torch.where(take, cand, best)
        found = found | (cand >= 0)
    at = torch.minimum(best[:, None] + torch.arange(k, device=history.device)[None],
                       length[:, None] - 1)
    return seq.gather(1, at)


if triton is not None:

    @triton.jit
    def _ngram_chain_kernel(hist_ptr, stride, ver_ptr, ver_stride, acc_ptr, meta_ptr, out_ptr,
                            bonus_ptr, pos_ptr, next_ptr, rows, S: tl.constexpr,
                            W: tl.constexpr, WP: tl.constexpr, K: tl.constexpr,
                            KP: tl.constexpr, NMIN: tl.constexpr, NMAX: tl.constexpr,
                            BLOCK: tl.constexpr, NEXT: tl.constexpr = False,
                            GDC: tl.constexpr = False):
        if GDC:  # PDL (specloop.samplers._pdl): no weights, so the wait first
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        b = tl.program_id(0)
        start = tl.load(meta_ptr + b)
        row = tl.load(meta_ptr + rows + b)
        is_real = tl.load(meta_ptr + 2 * rows + b)
        position = tl.load(meta_ptr + 3 * rows + b)
        acc = tl.load(acc_ptr + b) * is_real
        base = hist_ptr + row * stride
        j = tl.arange(0, WP)
        tok = tl.load(ver_ptr + b * ver_stride + j, mask=j < W, other=0)
        tl.store(base + start + 1 + j, tok, mask=(j < W) & (j <= acc))
        tl.store(bonus_ptr + b, tl.sum(tl.where(j == acc, tok, 0), axis=0))
        tl.store(pos_ptr + b, position + acc)
        if NEXT:    # the next step's meta for this row (chain_step's ``next_meta``)
            tl.store(next_ptr + b, start + acc + is_real)
            tl.store(next_ptr + rows + b, row)
            tl.store(next_ptr + 2 * rows + b, is_real)
            tl.store(next_ptr + 3 * rows + b, position + acc + is_real)
        if K > 0:   # K = 0 (adaptive K): the bonus token and its position only
            tl.debug_barrier()      # the stores above are read below, by other threads
            length = start + acc + 2
            best = length
            found = length < 0      # False
            for i in tl.static_range(NMAX - NMIN + 1):     # n = NMAX - i, longest first
                cand = length * 0 - 1
                for blk in range(0, S, BLOCK):   # the positions past length: masked
                    p = blk + tl.arange(0, BLOCK)
                    ok = (p >= NMAX - i) & (p <= length - 1)
                    for m in tl.static_range(NMAX - i):
                        want = tl.load(base + length - (NMAX - i) + m,
                                       mask=length - (NMAX - i) + m >= 0, other=-1)
                        have = tl.load(base + p - (NMAX - i) + m, mask=ok, other=-2)
                        ok = ok & (have == want)
                    cand = tl.maximum(cand, tl.max(tl.where(ok, p, -1), axis=0))
                take = (cand >= 0) & (found == 0)
                best = tl.where(take, cand, best)
                found = found | (cand >= 0)
            d = tl.arange(0, KP)
            at = tl.minimum(best + d, length - 1)
            drafts = tl.load(base + at, mask=d < K, other=0)
            tl.store(out_ptr + b * K + d, drafts, mask=d < K)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _chain_step_triton(history: torch.Tensor, verified: torch.Tensor, accepted: torch.Tensor,
                       meta: torch.Tensor, *, k: int, ngram_min: int, ngram_max: int,
                       bonus: torch.Tensor, start_pos: torch.Tensor,
                       next_meta: torch.Tensor | None = None) -> torch.Tensor:
    rows, width = verified.shape
    # One column at least: at K = 0 the kernel stores none, but is handed a real buffer.
    out = torch.empty(rows, max(k, 1), dtype=torch.int64, device=history.device)
    # verified's rows may be strided: VERIFY's token ids are a view of its ``packed``
    # [B, K+2] when the all-greedy kernels wrote them (samplers/_triton_greedy.py).
    assert history.is_contiguous() and verified.stride(1) == 1 and meta.is_contiguous()
    assert next_meta is None or next_meta.is_contiguous()
    _ngram_chain_kernel[(rows,)](
        history, history.stride(0), verified, verified.stride(0), accepted.contiguous(),
        meta, out, bonus,
        start_pos, meta if next_meta is None else next_meta, rows, S=history.shape[1],
        W=width, WP=_pow2(width), K=k, KP=_pow2(max(k, 1)),
        NMIN=ngram_min, NMAX=ngram_max, BLOCK=512, NEXT=next_meta is not None,
        **_pdl.launch_kw(history))
    return out[:, :k]
