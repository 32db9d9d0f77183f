"""Triton kernels of the fused decoder layer (CUDA; the interpreter runs them on CPU in tests).

Each kernel computes what a few plain tensor ops of the reference layer compute
(``DecoderModel._layer``), in fp32 registers with one rounding at the store:
- ``add_rms_norm``: the residual add and the next RMSNorm, one pass over a row;
- ``rope_cache_write``: RoPE on q and k, and k, v stored in place in their cache pages
  (each token's position, page and offset found from its row's start and slot through
  the block table, as ``KVCache.locate`` does, so a fused forward builds no index tensors;
  ``_skinny.skinny_rope_linear`` runs the same arithmetic as the qkv GEMM's epilogue);
- ``paged_attention``: causal attention of T queries per row over the row's real length
  (its ``start_pos`` + T), reading K/V pages through the block table: decode (T = 1),
  VERIFY (T = K + 1) and prefill chunks alike, with lengths as device tensors so one
  captured graph serves any lengths; at small batches split-KV (each row's positions cut
  into ranges on the device, a second kernel combining their partials);
- ``silu_mul``: SwiGLU's activation on the fused gate-up output;
- ``eagle_prologue``: an EAGLE head's input norms (embedding gather, two RMSNorms, concat);
- ``argmax_map``: a draft step's greedy token (argmax over the reduced vocabulary, mapped
  to a target id) in one kernel; ``topk_map`` a draft tree's children (the top k, mapped,
  written into their nodes' columns); either with a row over one program, or split over
  several whose last combines their keys (``_topk_split_kernel``, the same picks).

On Hopper each kernel is launched with Programmatic Dependent Launch (``GDC`` True,
``launch_pdl=True``; the switch and the rules are ``specloop.samplers._pdl``'s): a program
loads its weights (norm weights) before ``gdc_wait`` and everything else, and every store
or atomic, after it; every program waits, before any early return.

The "last program combines" counters (split-KV attention, the split top-k: one buffer a
device, ``_counters``) stay correct under PDL: a counter is reset (atomic_xchg to 0) by the
program that completes its group, before that grid completes; the next kernel that counts
(next layer, next depth or next step) increments counters only after its own
``gdc_wait``, i.e. after the kernel before it has completed, and that one completed only
after its own wait, and so on back to the kernel that reset them: every reset is visible
before the next increment, as without PDL. Within one grid nothing
changes (programs of one grid never depended on the launch order of grids).
"""

from __future__ import annotations

import functools
import math
import os

import torch

from specloop.samplers import _pdl

from ._skinny import RopeWrite

try:  # Triton is optional: without it the decoder runs its reference path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available() -> bool:
    return triton is not None


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _per_row(*index_args: str, varying: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """``triton.jit`` options for a kernel's per-row index tensors (``index_args``: each
    program loads a scalar or two from them, so their pointers' 16-byte alignment buys
    nothing) and ints that vary between calls but only offset positions (``varying``):
    neither is part of the compiled specialisation. Else an eager step handed a view
    (the engine's slots are row 1 of a [2, B] tensor: 8-byte aligned at odd B) compiled
    a variant of its own while serving (2026-12-02, H200: two eager DRAFTs stalled 0.8 s
    each at batch 1)."""
    return {"do_not_specialize": list(varying),
            "do_not_specialize_on_alignment": list(index_args)}


if triton is not None:

    @triton.jit(**_per_row("pick_ptr"))
    def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, h_ptr, out_ptr, copy_ptr, pick_ptr, H,
                             copy_stride, T, eps, W_ROWS: tl.constexpr,
                             HAS_DELTA: tl.constexpr, HAS_COPY: tl.constexpr,
                             PICK: tl.constexpr, BLOCK: tl.constexpr,
                             GDC: tl.constexpr = False):
        # PICK: program b normalizes row b * T + pick[b] alone, into h row b (one row of
        # each T: a catch-up's last, no gather kernel after). W_ROWS > 1 with PICK: the
        # weight row of the row normalized.
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < H
        if GDC:
            tl.extra.cuda.gdc_launch_dependents()
        if not PICK:
            # W_ROWS > 1: row r is scaled by weight row r % W_ROWS (one weight per feature
            # part).
            w = tl.load(w_ptr + (row % W_ROWS) * H + cols, mask=m, other=0.0)  # before
        if GDC:
            tl.extra.cuda.gdc_wait()
        h_row = row
        if PICK:    # the pick is an earlier kernel's output: after the wait
            row = row * T + tl.load(pick_ptr + row)
            w = tl.load(w_ptr + (row % W_ROWS) * H + cols, mask=m, other=0.0)
        x = tl.load(x_ptr + row * H + cols, mask=m, other=0.0)
        if HAS_DELTA:
            # Rounded to the stream's dtype like the reference's ``x + y``.
            x = (x.to(tl.float32) + tl.load(d_ptr + row * H + cols, mask=m, other=0.0)
                 .to(tl.float32)).to(x.dtype)
            tl.store(out_ptr + row * H + cols, x, mask=m)
        if HAS_COPY:
            # The sum also into a strided buffer (an EAGLE-3 head's captured features).
            tl.store(copy_ptr + row * copy_stride + cols, x, mask=m)
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
        tl.store(h_ptr + h_row * H + cols, w * (xf * inv).to(x.dtype), mask=m)

    @triton.jit(**_per_row("tok_ptr", "rows_ptr"))
    def _eagle_prologue_kernel(tok_ptr, emb_ptr, hid_ptr, ew_ptr, hw_ptr, out_ptr, rows_ptr,
                               H, eps, T, tok_sb, tok_st, hid_sb, hid_st,
                               BLOCK: tl.constexpr, ROWS: tl.constexpr = False,
                               GDC: tl.constexpr = False):
        # One token row of an EAGLE head's input: [enorm(emb(t)); hnorm(h)] (each norm as
        # _add_rms_norm_kernel computes it, so the bits are the unfused kernels'). Row
        # (b, t) of [B, T] reads tokens and hidden through their strides (a draft tree's
        # parents as a view: a slice, or one row repeated with stride 0; no gather), or
        # with ROWS hidden's row rows[t] (a tree's parents that are no view: a constant
        # table, made once a tree, so read before the wait with the weights).
        row = tl.program_id(0)
        b, t = row // T, row % T
        cols = tl.arange(0, BLOCK)
        m = cols < H
        if GDC:
            tl.extra.cuda.gdc_launch_dependents()
        ew = tl.load(ew_ptr + cols, mask=m, other=0.0)  # the norm weights: before the wait
        hw = tl.load(hw_ptr + cols, mask=m, other=0.0)
        h_t = t
        if ROWS:
            h_t = tl.load(rows_ptr + t)
        if GDC:
            tl.extra.cuda.gdc_wait()
        # a token: after (so its embedding row)
        tok = tl.load(tok_ptr + b.to(tl.int64) * tok_sb + t * tok_st).to(tl.int64)
        e = tl.load(emb_ptr + tok * H + cols, mask=m, other=0.0)
        ef = e.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(ef * ef, axis=0) / H + eps)
        tl.store(out_ptr + row * 2 * H + cols, ew * (ef * inv).to(e.dtype), mask=m)
        x = tl.load(hid_ptr + b.to(tl.int64) * hid_sb + h_t.to(tl.int64) * hid_st + cols,
                    mask=m, other=0.0)
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
        tl.store(out_ptr + row * 2 * H + H + cols, hw * (xf * inv).to(x.dtype), mask=m)

    @triton.jit
    def _top_key(v, ids, m, NAN_MAX: tl.constexpr):
        """One int64 key a value, ordered as (value, -id): the float's bits made monotonic
        (negatives' magnitude bits flipped) above, 2^32 - 1 - id below (ids < 2^32), so
        a top-k round is ONE max reduction (not a max, then a min over the ties' ids).
        -0.0 counts as 0.0 (equal values tie on the id). NaN counts as -inf, or with
        NAN_MAX as the maximum (every NaN one value: torch.argmax's order). Past the
        data (``m`` false): the smallest int64, never picked while a lane holds data."""
        if NAN_MAX:
            bits = tl.where(v == 0.0, 0.0, v).to(tl.int32, bitcast=True)
            bits = tl.where(v != v, 0x7FC00000, bits)
        else:
            v = tl.where(v != v, float("-inf"), v)
            bits = tl.where(v == 0.0, 0.0, v).to(tl.int32, bitcast=True)
        mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        least = -9223372036854775807 - 1
        return tl.where(m, (mono.to(tl.int64) << 32) | (4294967295 - ids), least)

    @triton.jit
    def _top_keys(key, K: tl.constexpr, K_P2: tl.constexpr):
        """The K largest of ``key`` (a 1-D block of _top_key's keys), largest first, as a
        [K_P2] vector (the smallest int64 past K): K rounds of one max reduction, each
        taking its pick out. The picks gather in registers: nothing is stored or loaded
        between consecutive reductions."""
        least = -9223372036854775807 - 1
        jj = tl.arange(0, K_P2)
        tops = tl.full([K_P2], least, tl.int64)
        for j in tl.static_range(K):
            top = tl.max(key, axis=0)
            key = tl.where(key == top, least, key)
            tops = tl.where(jj == j, top, tops)
        return tops

    @triton.jit
    def _row_top_keys(x_ptr, map_ptr, row, N, n, K: tl.constexpr, K_P2: tl.constexpr,
                      MAP: tl.constexpr, NAN_MAX: tl.constexpr):
        """The top K keys (_top_keys) of row ``row``'s values at columns ``n`` (those < N)
        of x [R, N], with their ids: the columns, or (MAP == 2) map[n]."""
        m = n < N
        v = tl.load(x_ptr + row * N + n, mask=m, other=float("-inf")).to(tl.float32)
        if MAP == 2:
            ids = tl.load(map_ptr + n, mask=m, other=0).to(tl.int64)
        else:
            ids = n.to(tl.int64)
        return _top_keys(_top_key(v, ids, m, NAN_MAX), K, K_P2)

    @triton.jit
    def _store_picks(tops, row, map_ptr, out_ptr, dest_ptr, out_stride, E, K: tl.constexpr,
                     K_P2: tl.constexpr, MAP: tl.constexpr, DEST: tl.constexpr):
        """Row ``row``'s top keys [K_P2] -> their ids (mapped where MAP == 1: an increasing
        map, ties decided on the index), stored in out[row, :K], or with DEST pick j to
        out[row // E, dest[row % E, j]] (none where -1)."""
        jj = tl.arange(0, K_P2)
        km = jj < K
        picks = 4294967295 - (tops & 4294967295)
        if MAP == 1:
            picks = tl.load(map_ptr + picks, mask=km, other=0)
        if DEST:
            col = tl.load(dest_ptr + (row % E) * K + jj, mask=km, other=-1)
            tl.store(out_ptr + (row // E).to(tl.int64) * out_stride + tl.maximum(col, 0),
                     picks, mask=km & (col >= 0))
        else:
            tl.store(out_ptr + row * out_stride + jj, picks, mask=km)

    @triton.jit
    def _topk_map_kernel(x_ptr, map_ptr, out_ptr, dest_ptr, N, out_stride, E,
                         K: tl.constexpr, K_P2: tl.constexpr, MAP: tl.constexpr,
                         BLOCK: tl.constexpr, DEST: tl.constexpr = False,
                         GDC: tl.constexpr = False):
        # Row-wise top K of x [B, N] (N <= BLOCK: the row stays in registers), largest first,
        # mapped through map [N] as _argmax_map_kernel's MAP: K rounds of its argmax (ties
        # to the smallest mapped id), each taking its pick out. NaN counts as -inf (draft
        # tree children only: VERIFY decides). torch.topk's radix select took ~50 us a
        # call on the H200 for a draft tree's depth (16384 draft rows), ~16 % of a tree
        # iteration. DEST: pick j of row r goes to out[r // E, dest[r % E, j]] (none
        # where -1): a draft tree's children straight into their nodes' columns.
        if GDC:  # nothing to load before the wait (see the module doc)
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0)
        tops = _row_top_keys(x_ptr, map_ptr, row, N, tl.arange(0, BLOCK), K, K_P2, MAP,
                             False)
        _store_picks(tops, row, map_ptr, out_ptr, dest_ptr, out_stride, E, K, K_P2, MAP, DEST)

    @triton.jit
    def _topk_split_kernel(x_ptr, map_ptr, keys_ptr, cnt_ptr, out_ptr, dest_ptr, N,
                           out_stride, E, K: tl.constexpr, K_P2: tl.constexpr,
                           MAP: tl.constexpr, CHUNK: tl.constexpr, S_P2: tl.constexpr,
                           NAN_MAX: tl.constexpr, DEST: tl.constexpr = False,
                           GDC: tl.constexpr = False):
        # _topk_map_kernel's picks (with NAN_MAX and K = 1 _argmax_map_kernel's) from a
        # row cut into S = num_programs(1) chunks of CHUNK: program (row, s) keeps its
        # chunk's top K keys in a scratch [R, S, K_P2]; the last of a row's programs to
        # finish takes the top K of their S * K_P2 keys and stores the picks. The keys are
        # distinct (an id a value), so the top K of the union is the union's top K
        # whatever order the programs finish in: the same picks as one program a row, with
        # a row's values read by S SMs at once instead of one (batch 1's draft step: one
        # program on one SM for its 16384 logits). The counter discipline is
        # _paged_attention_kernel's "last program combines" (module doc): every call
        # leaves the row's counter zero.
        if GDC:  # nothing to load before the wait (see the module doc)
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0)
        s = tl.program_id(1)
        S = tl.num_programs(1)
        tops = _row_top_keys(x_ptr, map_ptr, row, N, s * CHUNK + tl.arange(0, CHUNK), K, K_P2,
                             MAP, NAN_MAX)
        jj = tl.arange(0, K_P2)
        tl.store(keys_ptr + (row * S + s).to(tl.int64) * K_P2 + jj, tops)
        # The barrier puts every thread's stores before the release of this program's
        # increment; the program that brings it to S acquires them all, resets it for the
        # next call and reads the keys through L2 (.cg: never a stale L1 line).
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
        if done == S - 1:
            tl.atomic_xchg(cnt_ptr + row, 0, sem="relaxed", scope="gpu")
            least = -9223372036854775807 - 1
            at = tl.arange(0, S_P2 * K_P2)
            keys = tl.load(keys_ptr + row.to(tl.int64) * S * K_P2 + at, mask=at < S * K_P2,
                           other=least, cache_modifier=".cg")
            _store_picks(_top_keys(keys, K, K_P2), row, map_ptr, out_ptr, dest_ptr,
                         out_stride, E, K, K_P2, MAP, DEST)

    @triton.jit
    def _argmax_map_kernel(x_ptr, map_ptr, out_ptr, N, out_stride, MAP: tl.constexpr,
                           BLOCK: tl.constexpr, GDC: tl.constexpr = False):
        # Row-wise argmax of x [B, N], mapped through map [N] (draft index -> target id);
        # ties go to the smallest mapped id: torch.argmax over the target vocabulary with
        # -inf outside the map. MAP 0: no map; 1: an increasing map (the smallest index
        # is the smallest id: the map is read once); 2: any order (ids read with x).
        if GDC:  # nothing to load before the wait (see the module doc)
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        # NaN is the maximum, as torch.argmax has it (and the greedy VERIFY kernel,
        # samplers/_triton_greedy.py): a NaN row gives its smallest mapped id, never one
        # outside the map (a broken head's NaN logits gave INT64_MAX before, and the next
        # step's embedding lookup a device-side assert that ends every request).
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        best = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
        best_id = tl.max(tl.full([BLOCK], -1, tl.int64), axis=0)
        best_nan = tl.max(tl.full([BLOCK], 0, tl.int32), axis=0)
        for n0 in range(0, N, BLOCK):
            n = n0 + cols
            m = n < N
            v = tl.load(x_ptr + row * N + n, mask=m, other=float("-inf")).to(tl.float32)
            if MAP == 2:
                ids = tl.load(map_ptr + n, mask=m, other=0).to(tl.int64)
            else:
                ids = n.to(tl.int64)
            nan = m & (v != v)
            any_nan = tl.max(nan.to(tl.int32), axis=0)
            top = tl.max(tl.where(nan, float("-inf"), v), axis=0)
            pick = tl.where(any_nan > 0, nan, m & (v == top))
            cand = tl.min(tl.where(pick, ids, 9223372036854775807), axis=0)
            beats = (any_nan > 0) | (top > best) | ((top == best) & (cand < best_id)) \
                | (best_id < 0)
            take = tl.where(best_nan > 0, (any_nan > 0) & (cand < best_id), beats)
            best_id = tl.where(take, cand, best_id)
            best = tl.where(take, top, best)
            best_nan = tl.maximum(best_nan, any_nan)
        if MAP == 1:
            best_id = tl.load(map_ptr + best_id)
        tl.store(out_ptr + row * out_stride, best_id)

    @triton.jit(**_per_row("start_ptr", "slot_ptr", "rope_ptr", varying=("pos_offset",)))
    def _rope_write_kernel(qkv_ptr, q_ptr, kc_ptr, vc_ptr, start_ptr, slot_ptr, table_ptr,
                           cos_ptr, sin_ptr, rope_ptr, T, pos_offset, max_pos, s_page, s_off,
                           s_table, pages_per_slot, max_seq_len, scratch_page,
                           HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                           PAGE: tl.constexpr, BLOCK_QK: tl.constexpr,
                           BLOCK_V: tl.constexpr, TREE: tl.constexpr = False,
                           GDC: tl.constexpr = False):
        tok = tl.program_id(0)
        if GDC:
            tl.extra.cuda.gdc_launch_dependents()
        # Nothing to load before the wait: the rotation tables are read at the position.
        if GDC:
            tl.extra.cuda.gdc_wait()
        half: tl.constexpr = D // 2
        # The token's position and its cache page and offset (KVCache.locate, here, so a
        # forward builds no index tensors): positions past max_seq_len go to scratch.
        row = tok // T
        p = tl.load(start_ptr + row) + pos_offset + tok % T
        index = tl.minimum(p // PAGE, pages_per_slot - 1)
        page = tl.load(table_ptr + tl.load(slot_ptr + row) * s_table + index).to(tl.int64)
        page = tl.where(p < max_seq_len, page, scratch_page)
        off = p % PAGE
        if TREE:    # a draft tree's row: stored at p, rotated at its depth's position
            pos = tl.minimum(p - tok % T + tl.load(rope_ptr + tok % T), max_pos)
        else:
            pos = tl.minimum(p, max_pos)
        d = tl.arange(0, half)
        heads = tl.arange(0, BLOCK_QK)[:, None]
        hm = heads < HQ + HKV
        base = qkv_ptr + tok * (HQ + 2 * HKV) * D + heads * D + d[None, :]
        x1 = tl.load(base, mask=hm, other=0.0).to(tl.float32)
        x2 = tl.load(base + half, mask=hm, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + pos * D + d).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + pos * D + d).to(tl.float32)[None, :]
        o1 = (x1 * c - x2 * s).to(q_ptr.dtype.element_ty)
        o2 = (x2 * c + x1 * s).to(q_ptr.dtype.element_ty)
        is_q = heads < HQ
        q_out = q_ptr + tok * HQ * D + heads * D + d[None, :]
        tl.store(q_out, o1, mask=is_q)
        tl.store(q_out + half, o2, mask=is_q)
        k_out = kc_ptr + page * s_page + off * s_off + (heads - HQ) * D + d[None, :]
        is_k = hm & (heads >= HQ)
        tl.store(k_out, o1, mask=is_k)
        tl.store(k_out + half, o2, mask=is_k)
        vh = tl.arange(0, BLOCK_V)[:, None]
        dv = tl.arange(0, D)[None, :]
        vm = vh < HKV
        v = tl.load(qkv_ptr + tok * (HQ + 2 * HKV) * D + (HQ + HKV + vh) * D + dv, mask=vm)
        tl.store(vc_ptr + page * s_page + off * s_off + vh * D + dv, v, mask=vm)

    @triton.jit
    def _split_chunk(n_end, SPLITS: tl.constexpr, SPLIT_MIN: tl.constexpr,
                     BLOCK_N: tl.constexpr):
        # (chunk, active): the positions a split of a row block covers, from the block's
        # real end n_end (a device value: a graph reads the lengths at replay): below
        # SPLIT_MIN one split covers them all, else SPLITS equal chunks of whole BLOCK_N
        # tiles (whole pages when the page size divides BLOCK_N); and the block's active
        # splits, cdiv(n_end, chunk) (at least 1), which the split kernel and both
        # combines count alike from here.
        # (Plain integer ops, not tl.cdiv: a jit call costs ~1 ms a program interpreted.)
        chunk = ((n_end + SPLITS - 1) // SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        chunk = tl.maximum(tl.where(n_end < SPLIT_MIN, n_end, chunk), 1)
        return chunk, tl.maximum((n_end + chunk - 1) // chunk, 1)

    # (cnt_ptr: split-KV's counters, or start_pos again where none are used; tree_ptr: a
    # draft tree's visibility bits, or start_pos again without a tree.)
    @triton.jit(**_per_row("slot_ptr", "start_ptr", "cnt_ptr", "tree_ptr",
                           varying=("pos_offset", "tree_back")))
    def _paged_attention_kernel(q_ptr, kc_ptr, vc_ptr, table_ptr, slot_ptr, start_ptr, o_ptr,
                                m_ptr, l_ptr, acc_ptr, cnt_ptr, tree_ptr, T, pos_offset,
                                tree_back, scale, s_page, s_off, s_table, pages_per_slot,
                                HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                                PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                                SPLIT_MIN: tl.constexpr, LAST_COMBINES: tl.constexpr,
                                SC: tl.constexpr, S_BLOCK: tl.constexpr,
                                TREE: tl.constexpr = False,
                                GDC: tl.constexpr = False):
        # One program per (row, KV head, block of query rows, split). SPLITS = 1: the one
        # kernel (a program walks all of its row's positions). SPLITS > 1 (flash-decoding):
        # a row block's positions are cut into active splits on the device (_split_chunk);
        # the rest of its programs return at once. A block with one active split (short
        # rows) runs exactly the one kernel's loop and normalisation and writes the output
        # itself; with more, each writes its partial max, sum and unnormalised output to
        # scratch, added by _attention_combine_kernel or (LAST_COMBINES) by the last of
        # them to finish.
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        blk = tl.program_id(2) // SPLITS
        split = tl.program_id(2) % SPLITS
        G: tl.constexpr = HQ // HKV
        if GDC:
            tl.extra.cuda.gdc_launch_dependents()
        # Before the start position (written by earlier kernels) and before the return of
        # the programs past a row's active splits: every program waits (no weights here).
        if GDC:
            tl.extra.cuda.gdc_wait()
        start = tl.load(start_ptr + b) + pos_offset
        t_last = tl.minimum(T - 1, (blk * BLOCK_M + BLOCK_M - 1) // G)
        n_end = start + t_last + 1
        chunk, active = _split_chunk(n_end, SPLITS, SPLIT_MIN, BLOCK_N)
        if split >= active:
            return  # no position here: no store, no counter (the combines count alike)
        # Query rows of this KV head, token-major: row r is token r // G, head kvh*G + r % G.
        r = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        t = r // G
        head = kvh * G + r % G
        rm = t < T
        slot = tl.load(slot_ptr + b)
        d = tl.arange(0, D)
        q_off = ((b * T + t) * HQ + head)[:, None] * D + d[None, :]
        q = tl.load(q_ptr + q_off, mask=rm[:, None], other=0.0)
        limit = start + t  # the last position each query row may see (causal)
        if TREE:
            # A draft tree's rows: bit j of a query row's word marks the tree row stored
            # at start - tree_back + j as one it sees (itself, its ancestors); positions
            # before the tree's rows are all seen.
            seen = tl.load(tree_ptr + t, mask=rm, other=0)
            first = start - tree_back
        lo = split * chunk
        hi = tl.minimum(lo + chunk, n_end)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nm = n < hi
            pidx = tl.minimum(n // PAGE, pages_per_slot - 1)
            page = tl.load(table_ptr + slot * s_table + pidx, mask=nm, other=0).to(tl.int64)
            kv_off = page[:, None] * s_page + (n % PAGE)[:, None] * s_off + kvh * D + d[None, :]
            k = tl.load(kc_ptr + kv_off, mask=nm[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            # Masks only where a tile needs them (uniform branches; on an H100 at context
            # 320, bench_tree_attention_gpu.py): without a tree, only tiles reaching the
            # rows' first position (those before it are seen by every row and lie inside
            # the split's range: its bounds are whole tiles, or its end n_end > start),
            # 7.6-7.7 -> 7.0-7.2 us a call at 1-16 rows; with one, the causal mask in every
            # tile and the words only in tiles reaching the tree's rows, 9.1 -> 7.2 at 16
            # rows (the words in the causal branch too: 7.3, and 10 us more a VERIFY).
            # (int32 words shifted in 32 bits were slower still: 10.2 us.)
            if TREE:
                ok = (n[None, :] <= limit[:, None]) & nm[None, :]
                if n0 + BLOCK_N > first:
                    rel = n - first
                    bit = (seen[:, None] >> tl.minimum(tl.maximum(rel, 0), 63)[None, :]) & 1
                    ok = ok & ((rel < 0)[None, :] | (bit != 0))
                s = tl.where(ok, s, float("-inf"))
            elif n0 + BLOCK_N > start:
                ok = (n[None, :] <= limit[:, None]) & nm[None, :]
                s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row may see none of a later split's range (VERIFY's earlier rows near its
            # start): its max stays -inf, and exp(-inf - -inf) would be NaN. (The first
            # range holds position 0, seen by every row: there m_safe is m_new.)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(vc_ptr + kv_off, mask=nm[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
        if active == 1:
            out = acc / tl.maximum(l_i, 1e-30)[:, None]
            tl.store(o_ptr + q_off, out.to(o_ptr.dtype.element_ty), mask=rm[:, None])
        else:
            row = (b * T + t) * HQ + head
            part = row * SPLITS + split
            tl.store(m_ptr + part, m_i, mask=rm)
            tl.store(l_ptr + part, l_i, mask=rm)
            tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=rm[:, None])
            if LAST_COMBINES:
                # A counter per (row, KV head, row block) in a zeroed buffer: the barrier
                # puts every thread's stores before the release of this program's
                # increment; the program that brings it to `active` acquires all of them,
                # resets it for the next call and combines (loads through L2: .cg, never a
                # stale L1 line).
                tl.debug_barrier()
                group = (b * HKV + kvh) * (tl.num_programs(2) // SPLITS) + blk
                done = tl.atomic_add(cnt_ptr + group, 1, sem="acq_rel", scope="gpu")
                if done == active - 1:
                    tl.atomic_xchg(cnt_ptr + group, 0, sem="relaxed", scope="gpu")
                    # As _attention_combine_kernel, in a fixed order (the same bits every
                    # call): the active splits' maxima and sums at once, then their outputs
                    # SC splits a step, unrolled (steps past `active` masked: no memory
                    # traffic) so that no step's loads wait on another's.
                    sa = tl.arange(0, S_BLOCK)
                    ok = rm[:, None] & (sa < active)[None, :]
                    idx = row[:, None] * SPLITS + sa[None, :]
                    pm = tl.load(m_ptr + idx, mask=ok, other=float("-inf"),
                                 cache_modifier=".cg")
                    pl = tl.load(l_ptr + idx, mask=ok, other=0.0, cache_modifier=".cg")
                    mx = tl.max(pm, axis=1)
                    mx = tl.where(mx == float("-inf"), 0.0, mx)  # rows past T: no NaN
                    den = tl.sum(tl.where(ok, tl.exp(pm - mx[:, None]), 0.0) * pl, axis=1)
                    sb = tl.arange(0, SC)
                    out = tl.zeros([BLOCK_M, D], tl.float32)
                    for j0 in tl.static_range(0, SPLITS, SC):
                        js = j0 + sb
                        ok = rm[:, None] & (js < active)[None, :]
                        idx = row[:, None] * SPLITS + js[None, :]
                        pm = tl.load(m_ptr + idx, mask=ok, other=float("-inf"),
                                     cache_modifier=".cg")
                        pa = tl.load(acc_ptr + idx[:, :, None] * D + d[None, None, :],
                                     mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
                        w = tl.where(ok, tl.exp(pm - mx[:, None]), 0.0)
                        out += tl.sum(w[:, :, None] * pa, axis=1)
                    out = out / tl.maximum(den, 1e-30)[:, None]
                    tl.store(o_ptr + q_off, out.to(o_ptr.dtype.element_ty), mask=rm[:, None])

    @triton.jit(**_per_row("slot_ptr", "start_ptr", "path_ptr"))
    def _keep_path_kernel(k_ptr, v_ptr, table_ptr, slot_ptr, start_ptr, path_ptr, src_ptr,
                          dst_ptr, D1, s_layer, s_page, s_off, s_table, pages_per_slot,
                          max_seq_len, scratch_page, R, F, WIDTH: tl.constexpr,
                          PAGE: tl.constexpr, D_P2: tl.constexpr, BLOCK: tl.constexpr,
                          ROWS: tl.constexpr = False, F_BLOCK: tl.constexpr = 1,
                          GDC: tl.constexpr = False):
        # Program (row b, layer): the K/V of tree row path[b, j] (stored at start + it)
        # move to start + j, j < D1, WIDTH = Hkv * D values each. Every load first, a
        # barrier, then the stores: a row's destination may be another's source. ROWS: one
        # program more a row (the last along axis 1) gathers the path's rows of src
        # [B, R, F] into dst [B, D1, F] (VERIFY's feature rows for the drafter: no gather
        # kernel of their own).
        if GDC:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        b = tl.program_id(0)
        layer = tl.program_id(1).to(tl.int64)
        j = tl.arange(0, D_P2)
        rows = j < D1
        if ROWS:
            if tl.program_id(1) == tl.num_programs(1) - 1:
                f = tl.arange(0, F_BLOCK)
                got = tl.load(path_ptr + b * D1 + j, mask=rows, other=0)
                fm = rows[:, None] & (f < F)[None, :]
                x = tl.load(src_ptr + (b.to(tl.int64) * R + got)[:, None] * F + f[None, :],
                            mask=fm)
                tl.store(dst_ptr + (b.to(tl.int64) * D1 + j)[:, None] * F + f[None, :], x,
                         mask=fm)
                return
        e = tl.arange(0, BLOCK)
        start = tl.load(start_ptr + b)
        slot = tl.load(slot_ptr + b)
        src = start + tl.load(path_ptr + b * D1 + j, mask=rows, other=0)
        dst = start + j
        moves = rows & (src != dst)
        # Each position's page and offset (KVCache.locate; past max_seq_len: scratch).
        s_page_of = tl.load(table_ptr + slot * s_table + tl.minimum(src // PAGE,
                                                                    pages_per_slot - 1),
                            mask=moves, other=0).to(tl.int64)
        s_page_of = tl.where(src < max_seq_len, s_page_of, scratch_page)
        d_page_of = tl.load(table_ptr + slot * s_table + tl.minimum(dst // PAGE,
                                                                    pages_per_slot - 1),
                            mask=moves, other=0).to(tl.int64)
        d_page_of = tl.where(dst < max_seq_len, d_page_of, scratch_page)
        m = moves[:, None] & (e < WIDTH)[None, :]
        src_off = (layer * s_layer + s_page_of * s_page + (src % PAGE) * s_off)[:, None] + \
            e[None, :]
        dst_off = (layer * s_layer + d_page_of * s_page + (dst % PAGE) * s_off)[:, None] + \
            e[None, :]
        k = tl.load(k_ptr + src_off, mask=m)
        v = tl.load(v_ptr + src_off, mask=m)
        tl.debug_barrier()
        tl.store(k_ptr + dst_off, k, mask=m)
        tl.store(v_ptr + dst_off, v, mask=m)

    @triton.jit(**_per_row("start_ptr", varying=("pos_offset",)))
    def _attention_combine_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, start_ptr, n_rows, T,
                                  pos_offset, HQ: tl.constexpr, HKV: tl.constexpr,
                                  D: tl.constexpr, BLOCK_M: tl.constexpr,
                                  BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                                  SPLIT_MIN: tl.constexpr, S_BLOCK: tl.constexpr,
                                  ROWS: tl.constexpr, GDC: tl.constexpr = False):
        # ROWS query rows: each one's active partials (its row block's count, computed as
        # the split kernel does) rescaled to their common max and summed in one fixed order
        # (the same bits on every call). Rows whose block had one active split: their
        # output is written already; nothing to do. Split 0 holds position 0: a row's max
        # is finite.
        if GDC:  # nothing to load before the wait (see the module doc)
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        G: tl.constexpr = HQ // HKV
        b = rows // (T * HQ)
        t = (rows // HQ) % T
        blk = (t * G + rows % HQ % G) // BLOCK_M
        t_last = tl.minimum(T - 1, (blk * BLOCK_M + BLOCK_M - 1) // G)
        live = rows < n_rows
        n_end = tl.load(start_ptr + b, mask=live, other=0) + pos_offset + t_last + 1
        _, active = _split_chunk(n_end, SPLITS, SPLIT_MIN, BLOCK_N)
        active = tl.where(live, active, 1)
        if tl.max(active, axis=0) == 1:
            return
        live = active > 1
        s = tl.arange(0, S_BLOCK)
        valid = live[:, None] & (s[None, :] < active[:, None])
        part = rows[:, None] * SPLITS + s[None, :]
        m = tl.load(m_ptr + part, mask=valid, other=float("-inf"))
        l = tl.load(l_ptr + part, mask=valid, other=0.0)
        mx = tl.max(m, axis=1)
        mx = tl.where(mx == float("-inf"), 0.0, mx)  # rows not combined here: no -inf - -inf
        w = tl.where(valid, tl.exp(m - mx[:, None]), 0.0)
        d = tl.arange(0, D)
        acc = tl.load(acc_ptr + part[:, :, None] * D + d[None, None, :],
                      mask=valid[:, :, None], other=0.0)
        out = tl.sum(w[:, :, None] * acc, axis=1) / tl.maximum(tl.sum(w * l, axis=1),
                                                              1e-30)[:, None]
        tl.store(o_ptr + rows[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=live[:, None])

    @triton.jit(**_per_row("v_ptr", "meta_ptr", "len_ptr"))
    def _draft_glue_kernel(v_ptr, meta_ptr, len_ptr, last_ptr, tok_ptr, start_ptr, first_ptr,
                           pos_ptr, W, s_v, s_meta, s_len, s_first, BLOCK_W: tl.constexpr,
                           FIRST: tl.constexpr = False, POS: tl.constexpr = False,
                           GDC: tl.constexpr = False):
        # draft_glue's row b (see there): integer ops, the same values as the torch ops.
        if GDC:  # nothing to load before the wait (see the module doc)
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        b = tl.program_id(0)
        w = tl.arange(0, BLOCK_W)
        row = v_ptr + b.to(tl.int64) * s_v
        tok = tl.load(row + w, mask=w < W, other=0)
        tl.store(tok_ptr + b.to(tl.int64) * W + w, tl.maximum(tok, 0), mask=w < W)
        last = tl.load(row + W) * tl.load(meta_ptr + s_meta + b)
        if FIRST:   # VERIFY's first token: the last catch-up row's
            tl.store(first_ptr + b.to(tl.int64) * s_first,
                     tl.sum(tl.where(w == last, tl.maximum(tok, 0), 0), axis=0))
        start = tl.load(len_ptr + s_len + b)
        at = start + last
        tl.store(last_ptr + b, last)
        tl.store(start_ptr + b, start)
        tl.store(len_ptr + b, tl.load(meta_ptr + 2 * s_meta + b) + at)
        position = tl.load(meta_ptr + 3 * s_meta + b) + at
        tl.store(len_ptr + s_len + b, position)
        if POS:     # VERIFY's position into its own input too
            tl.store(pos_ptr + b, position)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr,
                         GDC: tl.constexpr = False):
        if GDC:  # nothing to load before the wait (see the module doc)
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < inter
        g = tl.load(gu_ptr + row * 2 * inter + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=m, other=0.0).to(tl.float32)
        out = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=m)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, copy_to: torch.Tensor | None = None,
                 pick: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(x + delta), x + delta) for x, delta [..., H]; delta None: no add.
    ``weight`` [H], or [W, H]: row r of x scaled by weight row r % W. ``copy_to`` [..., H]
    (rows strided, last dim contiguous): also receives x + delta (same store). ``pick``
    [B] (x [B, T, H]): the norm of row pick[b] of each b alone, [B, H] (the sum still at
    its own row of the second output, whose other rows are then unwritten)."""
    H = x.shape[-1]
    x = x.contiguous()
    if pick is None:
        rows, T = x.numel() // H, 1
        h = torch.empty_like(x)
    else:
        if x.dim() != 3 or pick.shape != (x.shape[0],) or copy_to is not None:
            raise ValueError(f"add_rms_norm: pick {tuple(pick.shape)} for x "
                             f"{tuple(x.shape)} (one row of each [T, H], no copy_to)")
        rows, T = x.shape[0], x.shape[1]
        h = x.new_empty(rows, H)
        pick = pick.contiguous()
    out = torch.empty_like(x) if delta is not None else x
    d = delta.contiguous() if delta is not None else x
    copy_stride = 0
    if copy_to is not None:
        if copy_to.stride(-1) != 1 or copy_to.numel() != x.numel():
            raise ValueError("add_rms_norm: copy_to must hold x's rows, last dim contiguous")
        copy_stride = copy_to.stride(-2) if copy_to.dim() > 1 else H
        if copy_to.dim() > 2 and copy_to.stride(-3) != copy_stride * copy_to.shape[-2]:
            raise ValueError("add_rms_norm: copy_to's rows must be evenly strided")
    _add_rms_norm_kernel[(rows,)](x, d, weight, h, out, x if copy_to is None else copy_to,
                                  x if pick is None else pick, H, copy_stride, T, eps,
                                  W_ROWS=weight.numel() // H, HAS_DELTA=delta is not None,
                                  HAS_COPY=copy_to is not None, PICK=pick is not None,
                                  BLOCK=_pow2(H), num_warps=4, **_pdl.launch_kw(x))
    return h, out


def eagle_prologue(tokens: torch.Tensor, embedding: torch.Tensor, hidden: torch.Tensor,
                   enorm: torch.Tensor, hnorm: torch.Tensor, eps: float,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """tokens [B, T] or [B] i64, hidden [B, T, H] or [B, H] -> [..., 2H] =
    [rms_norm(embedding[tokens], enorm); rms_norm(hidden, hnorm)] in one kernel (an EAGLE
    head's fc input). Both are read through their strides: views (a slice of a draft
    tree's rows, a row expanded) need no copy. ``rows`` [T] i64 (tokens [B, T], hidden
    [B, S, H]): hidden's rows ``rows`` are the T rows (``hidden.index_select(1, rows)``
    without its kernel; a constant table: it is read before PDL's wait)."""
    H = embedding.shape[1]
    flat = hidden.dim() == 2
    if flat:
        hidden, tokens = hidden.unsqueeze(1), tokens.unsqueeze(1)
    if hidden.dim() != 3 or hidden.stride(-1) != 1:
        raise ValueError(f"eagle_prologue: hidden {tuple(hidden.shape)} with strides "
                         f"{hidden.stride()} (want [B, T, H], H contiguous)")
    B, T = hidden.shape[0], tokens.shape[1]
    if (hidden.shape[1] != T) if rows is None else (
            flat or rows.shape != (T,) or rows.dtype != torch.int64):
        raise ValueError(f"eagle_prologue: tokens {tuple(tokens.shape)}, hidden "
                         f"{tuple(hidden.shape)}, rows "
                         f"{None if rows is None else tuple(rows.shape)} (rows [T] int64 "
                         "index hidden's rows; else hidden has tokens' T rows)")
    out = hidden.new_empty(B, T, 2 * H)
    _eagle_prologue_kernel[(B * T,)](tokens, embedding, hidden, enorm, hnorm, out,
                                     hidden if rows is None else rows.contiguous(), H, eps,
                                     T, tokens.stride(0), tokens.stride(1), hidden.stride(0),
                                     hidden.stride(1), BLOCK=_pow2(H), ROWS=rows is not None,
                                     num_warps=4, **_pdl.launch_kw(hidden))
    return out.squeeze(1) if flat else out


def argmax_map(x: torch.Tensor, index_map: torch.Tensor | None,
               out: torch.Tensor | None = None, *, increasing: bool = False,
               split: bool | None = None) -> torch.Tensor:
    """x [B, N] -> i64 [B]: index_map[argmax] (argmax itself without a map); ties go to
    the smallest mapped id; NaN is the maximum. ``increasing``: the map is (then ties are
    decided on the index, without reading the map's N ids). ``out``: a [B] view to write
    (e.g. a column of [B, K]). ``split``: the row over several programs
    (``_topk_split_kernel``; None: SPECLOOP_DRAFT_TOPK's default), the same picks."""
    B, N = x.shape
    x = x.contiguous()
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=x.device)
    kind = 0 if index_map is None else 1 if increasing else 2
    if _runs_split(N, split):
        _top_split(x, index_map, kind, 1, out, None, 1, nan_max=True)
        return out
    # One program a row, the whole row (up to 16k) in one pass: a launch-bound draft step
    # pays ~3 us for it, not a loop of block reductions (~9 us at 2k a pass).
    _argmax_map_kernel[(B,)](x, x if index_map is None else index_map, out, N,
                             out.stride(0), MAP=kind, BLOCK=min(_pow2(N), 16384),
                             num_warps=16, **_pdl.launch_kw(x))
    return out


# A draft step's argmax / top-k over its draft vocabulary: one program a row (the row
# kernels), or the row cut into chunks of _TOP_CHUNK over that many programs, the last to
# finish combining their keys (``_topk_split_kernel``: the same picks). H200, batch 1: the
# row kernels took 5.3 us (argmax, eagle3 K = 3) and 6.8 us (a tree's top-k) a draft depth
# on the critical path, one SM reading a row's 16384 logits; split, on an H100, eagle3
# K = 3's iteration took 0.676 -> 0.665 ms of GPU time, the 15-node tree's 0.733 -> 0.724
# (bench/results/h100_1205k_*). SPECLOOP_DRAFT_TOPK=row keeps one program a row (read
# once, at import, for an A/B of whole runs); a call's ``split`` decides for itself.
_TOP_SPLIT = os.environ.get("SPECLOOP_DRAFT_TOPK", "split") != "row"
# A split program's logits and warps (powers of two; SPECLOOP_DRAFT_TOPK_CHUNK and
# SPECLOOP_DRAFT_TOPK_WARPS for an A/B: with one warp a round's reduction needs no barrier,
# with smaller chunks more programs share a row). H100: 1024 and 4 measured, others not.
_TOP_CHUNK = int(os.environ.get("SPECLOOP_DRAFT_TOPK_CHUNK") or 1024)
_TOP_WARPS = int(os.environ.get("SPECLOOP_DRAFT_TOPK_WARPS") or 4)
# At most this many chunks a row: the last program holds S * K_P2 keys in registers.
_TOP_MAX_CHUNKS = 64


def _runs_split(n: int, split: bool | None) -> bool:
    """Whether a row of ``n`` runs split (``split`` None: the module's default)."""
    return (_TOP_SPLIT if split is None else split) and n <= _TOP_CHUNK * _TOP_MAX_CHUNKS


def _top_split(x: torch.Tensor, index_map: torch.Tensor | None, kind: int, k: int,
               out: torch.Tensor, dest: torch.Tensor | None, e: int, *, nan_max: bool) -> None:
    """``_topk_split_kernel`` over x [R, N] (contiguous): the picks into ``out`` (rows of
    stride out.stride(0)), or through ``dest`` [E, k] (``topk_map``'s, E = ``e``)."""
    R, N = x.shape
    chunk = min(_TOP_CHUNK, _pow2(N))
    S = -(-N // chunk)
    k_p2 = _pow2(k)
    keys = torch.empty(R * S * k_p2, dtype=torch.int64, device=x.device)
    _topk_split_kernel[(R, S)](
        x, x if index_map is None else index_map, keys, _counters(x.device, R), out,
        x if dest is None else dest, N, out.stride(0), e, K=k, K_P2=k_p2, MAP=kind,
        CHUNK=chunk, S_P2=_pow2(S), NAN_MAX=nan_max, DEST=dest is not None,
        num_warps=_TOP_WARPS, **_pdl.launch_kw(x))


# A row of topk_map in one block (the shipped heads' draft vocabulary: 16384) and at most
# this many picks (a draft tree's widest node: 9 children in the 31-node tree).
TOPK_MAX_N, TOPK_MAX_K = 16384, 16


def topk_map(x: torch.Tensor, k: int, index_map: torch.Tensor | None, *,
             increasing: bool = False, out: torch.Tensor | None = None,
             dest: torch.Tensor | None = None, split: bool | None = None) -> torch.Tensor:
    """x [R, N] -> i64 [R, k]: index_map[the k largest of each row], largest first (the
    indices themselves without a map); ties go to the smallest mapped id, as ``argmax_map``
    k times; NaN counts as -inf. ``increasing``: as ``argmax_map``'s. N <= TOPK_MAX_N,
    1 <= k <= min(N, TOPK_MAX_K) (``DraftHead.top`` uses torch.topk elsewhere).
    ``out`` [B, W] i64 with ``dest`` [E, k] (R = B * E): pick j of row r is written to
    ``out[r // E, dest[r % E, j]]`` instead, none where dest is -1 (a draft tree's
    children into their nodes' columns: no gather and scatter after); returns ``out``.
    ``split``: as ``argmax_map``'s."""
    R, N = x.shape
    if N > TOPK_MAX_N or not 1 <= k <= min(N, TOPK_MAX_K):
        raise ValueError(f"topk_map: k = {k} of N = {N} (at most {TOPK_MAX_K} of "
                         f"{TOPK_MAX_N})")
    x = x.contiguous()
    kind = 0 if index_map is None else 1 if increasing else 2
    if dest is None:
        out = torch.empty(R, k, dtype=torch.int64, device=x.device)
        e = 1
    else:
        if out is None or out.stride(1) != 1 or dest.shape[1] != k or \
                R != out.shape[0] * dest.shape[0]:
            raise ValueError(f"topk_map: dest {tuple(dest.shape)} for {R} rows of top-{k} "
                             f"into out {None if out is None else tuple(out.shape)}")
        dest, e = dest.contiguous(), dest.shape[0]
    if _runs_split(N, split):
        _top_split(x, index_map, kind, k, out, dest, e, nan_max=False)
        return out
    _topk_map_kernel[(R,)](x, x if index_map is None else index_map, out,
                           x if dest is None else dest, N, out.stride(0), e, K=k,
                           K_P2=_pow2(k), MAP=kind, BLOCK=_pow2(N), DEST=dest is not None,
                           num_warps=16, **_pdl.launch_kw(x))
    return out


def rope_cache_write(qkv: torch.Tensor, start_pos: torch.Tensor, slots: torch.Tensor,
                     table: torch.Tensor, max_seq_len: int, scratch_page: int,
                     cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, num_heads: int, pos_offset: int = 0,
                     rope_offsets: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [B, T, (Hq + 2 Hkv) D] of positions start_pos [B] + pos_offset.. in slots [B]
    -> rotated q [B, T, Hq, D]; rotated k and v are written into k_cache / v_cache [pages, page_size,
    Hkv, D] at each position's page (through the block table ``table``; positions past
    ``max_seq_len``: ``scratch_page``) and offset, as ``KVCache.locate`` finds them.
    ``rope_offsets`` [T] (a draft tree's rows, models/_decoder.py ``TreeMask``): row t is
    still stored at start + t but rotated at start + ``rope_offsets[t]``."""
    B, T = qkv.shape[:2]
    _, page_size, hkv, D = k_cache.shape
    q = qkv.new_empty(B, T, num_heads, D)
    rope = RopeWrite(start_pos, slots, table, max_seq_len, scratch_page, cos, sin, k_cache,
                     v_cache, num_heads, pos_offset, rope_offsets)
    _rope_write_kernel[(B * T,)](
        qkv.contiguous(), q, *rope.kernel_args(T),
        HQ=num_heads, HKV=hkv, D=D, PAGE=page_size, BLOCK_QK=_pow2(num_heads + hkv),
        BLOCK_V=_pow2(hkv), num_warps=4, **({"TREE": True} if rope_offsets is not None else {}),
        **_pdl.launch_kw(qkv))
    return q


# Split-KV: the launch wants about this many programs per SM, and a split at least one tile
# (more splits than tiles in the cache's maximum length could never get a position).
# SPECLOOP_ATTENTION_MAX_SPLITS caps the splits for an A/B of whole runs (1: one kernel,
# as before split-KV); read once, at import, as the others.
_SPLIT_PROGRAMS_PER_SM = 3
_MAX_SPLITS = max(1, int(os.environ.get("SPECLOOP_ATTENTION_MAX_SPLITS") or 32))
# A row block shorter than this many positions is one split (the one kernel's loop, its
# output written by that program): splitting it would save a few tiles of a serial loop
# and cost the partials' combine. H200, SmolLM2 at batch 1 (~300-position chat rows): the
# one kernel 4.45 us a layer, split (1 tile a split) 3.34 us + combine 2.17 us; the kernel
# bench (random caches, L2-cold) gains from 256 on, the real model loses there: 512 keeps
# chat rows on the one kernel's path and every long-context win of the bench (1,024 and
# 2,048 positions: 4-8x at batch 1). SPECLOOP_ATTENTION_SPLIT_MIN moves it for an A/B.
_SPLIT_MIN = max(1, int(os.environ.get("SPECLOOP_ATTENTION_SPLIT_MIN") or 512))
# How split partials are added when the caller does not say ("last" or "kernel", see
# paged_attention); SPECLOOP_ATTENTION_COMBINE=kernel tries the other in whole runs.
_COMBINE = os.environ.get("SPECLOOP_ATTENTION_COMBINE") or "last"


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter on the CPU: as on an H200
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OLD_COUNTERS: list[torch.Tensor] = []


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` counters on ``device`` for combine="last"
    (each call leaves it zero). Made once, outside a graph capture if the first call is
    eager (warm-up runs before capture); a larger one replaces it, the old one kept alive
    for the graphs captured with it."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < n:
        if have is not None:
            _OLD_COUNTERS.append(have)
        with torch.inference_mode(False):
            have = _COUNTERS[device] = torch.zeros(max(n, 1 << 14), dtype=torch.int32,
                                                   device=device)
    return have


def attention_splits(batch: int, kv_heads: int, row_blocks: int, max_len: int, block_n: int,
                     sm_count: int, split_min: int | None = None) -> int:
    """How many ranges a row's KV positions may be cut into (1: one program walks them all).

    Decided from shapes only: the lengths are device tensors a captured graph reads at
    replay, so the launch cannot know them, only the cache's maximum ``max_len``. One
    program per (row, KV head, row block) walks its positions serially: at batch 1 that is
    HKV programs (3 on SmolLM2) on a GPU of ~132 SMs, each looping over the whole context.
    Splitting multiplies the programs, but only rows of at least ``split_min`` positions
    use them (cut on the device from the real length; a shorter row's extra programs
    return at once and it pays no combine), so S is sized for the long rows: it stops at
    about ``_SPLIT_PROGRAMS_PER_SM`` programs per SM, at ``_MAX_SPLITS`` and at the tiles in
    ``max_len``; 1 when no row can reach ``split_min``. Powers of two, so few kernel
    variants are compiled. The batch counts rounded up to a power of two: a long row's
    rounding depends on S, and so an eager call at batch B and a graph replayed at the next
    power-of-two bucket split alike."""
    split_min = _SPLIT_MIN if split_min is None else split_min
    if max_len < split_min:
        return 1
    programs = _pow2(batch) * kv_heads * row_blocks
    most = min(_MAX_SPLITS, -(-max_len // block_n))
    splits = 1
    while splits * 2 <= most and programs * splits * 2 <= _SPLIT_PROGRAMS_PER_SM * sm_count:
        splits *= 2
    return splits


def _row_blocks(T: int, hq: int, hkv: int, block_m: int | None = None) -> tuple[int, int]:
    """(BLOCK_M, row blocks) of one (row, KV head): its T * G query rows, token-major
    (``block_m``: a given BLOCK_M, a power of two >= 16)."""
    rows = T * (hq // hkv)
    if block_m is None:
        # 16 up to VERIFY's rows (a draft tree's, a chain's of K >= 5): on an H100 a call
        # at 18-96 rows took 7.5-7.7 us at 16 against 9.6-9.9 at 32 (context 320; 24 / 29
        # at 1000, 4.1 / 5.0 at 100: bench_tree_attention_gpu.py, 2026-12-05), more
        # programs each walking the positions with a smaller tile (32 spilled registers
        # in an offline sm_90 compile). Prefill chunks' rows: larger tiles.
        block_m = 16 if rows <= 96 else 32 if rows <= 256 else 64
    elif block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"paged_attention: block_m {block_m} (a power of two >= 16)")
    return block_m, -(-rows // block_m)


def default_splits(q: torch.Tensor, k_cache: torch.Tensor, table: torch.Tensor,
                   block_n: int = 64, split_min: int | None = None) -> int:
    """The split count ``paged_attention`` takes for these shapes (``attention_splits``);
    the cache's maximum length is its block table's pages a slot."""
    B, T, hq, _ = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    return attention_splits(B, hkv, _row_blocks(T, hq, hkv)[1], table.shape[1] * page,
                            block_n, _sm_count(q.device), split_min)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    table: torch.Tensor, slots: torch.Tensor, start_pos: torch.Tensor,
                    pos_offset: int = 0, *, splits: int | None = None, block_n: int = 64,
                    num_warps: int = 4, num_stages: int | None = None,
                    combine: str | None = None, split_min: int | None = None,
                    tree_bits: torch.Tensor | None = None, tree_back: int = 0,
                    block_m: int | None = None) -> torch.Tensor:
    """q [B, T, Hq, D] at positions start_pos [B] + pos_offset.. of slots [B] -> o [B, T,
    Hq D]: each query attends to its slot's positions 0..its own, read from pages via ``table``.

    ``splits``: at most this many KV ranges a row (split-KV); None: ``attention_splits``
    (from the shapes only), 1: the one kernel. A row (block of query rows) is split only
    when its real length reaches ``split_min`` positions (None: ``_SPLIT_MIN``), decided on
    the device; a shorter one runs the one kernel's loop in a single program, which writes
    its output (the bits of ``splits=1``). ``block_n``, ``num_warps``, ``num_stages``: the
    KV tile, warps and software-pipelining stages (None: Triton's default), and ``block_m``
    the query rows a program (None: ``_row_blocks``' rule), parameters for sweeps
    (bench/bench_paged_attention.py, bench/bench_tree_attention_gpu.py). ``combine``
    (None: "last" unless $SPECLOOP_ATTENTION_COMBINE says otherwise): how a split row's partials are added:
    "last", by the last of its programs to finish (no second launch; a counter buffer per
    device, kept zero between calls, so calls on one device must not run concurrently on
    two streams); "kernel", by a second kernel (launched whenever splits > 1, returning at
    once for rows that did not split). ``tree_bits`` [T] int64 (a draft tree's rows,
    models/_decoder.py ``TreeMask.bits``): query row t sees, besides its causal limit, only
    the tree rows whose bits its word sets, bit j the one stored at start - ``tree_back``
    + j (at most 63 of them); positions before them all."""
    B, T, hq, D = q.shape
    _, page, hkv, _ = k_cache.shape
    q = q.contiguous()
    o = torch.empty_like(q)
    block_m, row_blocks = _row_blocks(T, hq, hkv, block_m)
    split_min = _SPLIT_MIN if split_min is None else split_min
    if splits is None:
        splits = default_splits(q, k_cache, table, block_n, split_min)
    combine = _COMBINE if combine is None else combine
    if combine not in ("kernel", "last"):
        raise ValueError(f"combine={combine!r}: 'kernel' or 'last'")
    if tree_bits is not None and (tree_bits.shape != (T,) or T + tree_back > 63 or
                                  tree_back < 0 or tree_bits.dtype != torch.int64):
        raise ValueError(f"paged_attention: tree bits {tuple(tree_bits.shape)} "
                         f"{tree_bits.dtype} for {T} rows, {tree_back} tree rows before "
                         f"them (int64 words, 63 rows at most in all)")
    args = (T, pos_offset, tree_back, 1.0 / math.sqrt(D), k_cache.stride(0),
            k_cache.stride(1), table.stride(0), table.shape[1])
    pdl = _pdl.launch_kw(q)
    meta = dict(HQ=hq, HKV=hkv, D=D, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n,
                num_warps=num_warps, **pdl,
                **({"TREE": True} if tree_bits is not None else {}))
    if num_stages is not None:
        meta["num_stages"] = num_stages
    slots, start_pos = slots.contiguous(), start_pos.contiguous()
    bits = tree_bits.contiguous() if tree_bits is not None else start_pos
    if splits == 1:  # no scratch: every row block is one active split (SPLIT_MIN unused)
        _paged_attention_kernel[(B, hkv, row_blocks)](
            q, k_cache, v_cache, table, slots, start_pos, o, o, o, o, start_pos, bits, *args,
            SPLITS=1, SPLIT_MIN=0, LAST_COMBINES=False, SC=1, S_BLOCK=1, **meta)
        return o.view(B, T, hq * D)
    # Partials in fp32 (inside a graph capture these come from the graph's pool); only
    # split rows write theirs.
    n = B * T * hq * splits
    part_m = torch.empty(n, dtype=torch.float32, device=q.device)
    part_l = torch.empty(n, dtype=torch.float32, device=q.device)
    part_acc = torch.empty(n, D, dtype=torch.float32, device=q.device)
    last = combine == "last"
    counters = _counters(q.device, B * hkv * row_blocks) if last else start_pos
    # The last program adds SC splits' outputs a step: [BLOCK_M, SC, D] fp32, ~4k values.
    s_block = _pow2(splits)
    sc = max(1, min(s_block, 4096 // (block_m * D)))
    _paged_attention_kernel[(B, hkv, row_blocks * splits)](
        q, k_cache, v_cache, table, slots, start_pos, o, part_m, part_l, part_acc, counters,
        bits, *args, SPLITS=splits, SPLIT_MIN=split_min, LAST_COMBINES=last, SC=sc,
        S_BLOCK=s_block, **meta)
    if last:
        return o.view(B, T, hq * D)
    # A few rows a program: about 4k partial values (32 registers a thread at 4 warps), so
    # batch 1's 9 rows still spread over a few SMs (the combine waits on one load each).
    rows_per = max(1, 4096 // (s_block * D))
    n_rows = B * T * hq
    _attention_combine_kernel[(triton.cdiv(n_rows, rows_per),)](
        part_m, part_l, part_acc, o, start_pos, n_rows, T, pos_offset, HQ=hq, HKV=hkv, D=D,
        BLOCK_M=block_m, BLOCK_N=block_n, SPLITS=splits, SPLIT_MIN=split_min,
        S_BLOCK=s_block, ROWS=rows_per, num_warps=4, **pdl)
    return o.view(B, T, hq * D)


def keep_path(k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
              slots: torch.Tensor, start_pos: torch.Tensor, path: torch.Tensor,
              max_seq_len: int, scratch_page: int, rows: torch.Tensor | None = None
              ) -> torch.Tensor | None:
    """``KVCache.keep_path`` in one kernel: for every layer of k_cache / v_cache [L, pages,
    page_size, Hkv, D], row b's entries at start_pos[b] + path[b, j] move to start_pos[b]
    + j (pages through ``table``; positions past ``max_seq_len``: ``scratch_page``).
    ``rows`` [B, R, F]: also -> rows[b, path[b, j]] [B, D1, F] (one program more a row)."""
    L, _, page, hkv, D = k_cache.shape
    B, d1 = path.shape
    out = None
    if rows is not None:
        rows = rows.contiguous()
        out = rows.new_empty(B, d1, rows.shape[2])
    if B == 0:
        return out
    R, F = (rows.shape[1], rows.shape[2]) if rows is not None else (0, 0)
    _keep_path_kernel[(B, L + (rows is not None))](
        k_cache, v_cache, table, slots.contiguous(), start_pos.contiguous(),
        path.contiguous(), k_cache if rows is None else rows, k_cache if out is None else out,
        d1, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        table.stride(0), table.shape[1], max_seq_len, scratch_page, R, F, WIDTH=hkv * D,
        PAGE=page, D_P2=_pow2(d1), BLOCK=_pow2(hkv * D), ROWS=rows is not None,
        F_BLOCK=_pow2(F) if rows is not None else 1, num_warps=4,
        **_pdl.launch_kw(k_cache))
    return out


def draft_glue_fits(verified: torch.Tensor, meta: torch.Tensor, lengths: torch.Tensor
                    ) -> bool:
    """``draft_glue`` takes these: int64, rows contiguous, meta [4, B], lengths [2, B]."""
    B = verified.shape[0]
    return (verified.dim() == 2 and verified.shape[1] >= 1
            and all(t.dtype == torch.int64 and t.stride(-1) == 1
                    for t in (verified, meta, lengths))
            and meta.shape == (4, B) and lengths.shape == (2, B))


def draft_glue(verified: torch.Tensor, meta: torch.Tensor, lengths: torch.Tensor,
               first: torch.Tensor | None = None, position: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A draft graph step's integer glue (``MtpEagleDrafter.graph_step``) in one kernel:
    verified [B, W+1] (each row's catch-up tokens, then its last catch-up row), meta
    [4, B] (slot, 1 on real rows, the length's and VERIFY position's offsets), lengths
    [2, B] (the catch-up start in row 1) -> (last [B] = verified[:, W] * meta[1], tokens
    [B, W] = verified[:, :W] clamped at 0, the catch-up start [B] as it was), and lengths
    becomes meta[2:] + start + last (the length, VERIFY's position), which the torch ops
    write after the catch-up has read the start (here it reads the copy). All int64.
    ``first`` [B] (int64, any stride: a column of VERIFY's tokens): also receives
    tokens[b, last[b]], VERIFY's first token (no gather kernel for it). ``position`` [B]
    (int64, contiguous: VERIFY's own input): also receives VERIFY's position (lengths[1]
    after the call; no copy kernel for it)."""
    B = verified.shape[0]
    if not draft_glue_fits(verified, meta, lengths) or (
            first is not None and (first.dtype != torch.int64 or first.shape != (B,))) or (
            position is not None and not (position.dtype == torch.int64
                                          and position.shape == (B,)
                                          and position.is_contiguous())):
        raise ValueError(f"draft_glue: verified {tuple(verified.shape)}, meta "
                         f"{tuple(meta.shape)}, lengths {tuple(lengths.shape)}, first "
                         f"{None if first is None else tuple(first.shape)}, position "
                         f"{None if position is None else tuple(position.shape)} (int64, "
                         "rows contiguous; meta [4, B], lengths [2, B], first and position "
                         "[B])")
    B, W = verified.shape[0], verified.shape[1] - 1
    last = verified.new_empty(B)
    tokens = verified.new_empty(B, W)
    start = verified.new_empty(B)
    if B:
        _draft_glue_kernel[(B,)](verified, meta, lengths, last, tokens, start,
                                 last if first is None else first,
                                 last if position is None else position, W,
                                 verified.stride(0), meta.stride(0), lengths.stride(0),
                                 0 if first is None else first.stride(0),
                                 BLOCK_W=_pow2(max(W, 1)), FIRST=first is not None,
                                 POS=position is not None, num_warps=1,
                                 **_pdl.launch_kw(verified))
    return last, tokens, start


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 I] (gate, up) -> silu(gate) * up [..., I]."""
    inter = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    rows = gate_up.numel() // (2 * inter)
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block,
                                                       num_warps=4, **_pdl.launch_kw(out))
    return out
