"""Paged KV cache: K/V live in fixed-size pages; a block table maps each slot's positions.

``PageTable`` is the bookkeeping (which pages a slot owns, on the host, mirrored into one
device tensor the kernels read); ``KVCache`` is the storage of one model's layers. Caches
of one engine (the target's, a draft model's, an MTP head's) share one ``PageTable``: a
slot's positions sit at the same page and offset in each of them, so one allocation serves
every model that caches that request.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy
import structlog
import torch

from . import _kernels
from ._args import ModelArgs
from ._host import StagingRing

log = structlog.get_logger(__name__)

DEFAULT_PAGE_SIZE = 16
# Past any length a slot is asked to hold (the bounds of a full or an empty slot).
_UNBOUNDED = 1 << 62


class CacheFullError(RuntimeError):
    """No free page is left for a request that grows."""


class PageTable:
    """Pages ``0..num_pages-1`` are handed out; page ``num_pages`` is scratch (padding rows,
    positions past ``max_seq_len``, and every unallocated table entry point there).

    ``table`` [num_slots + 1, pages_per_slot] int32 on the device: ``table[s, i]`` is the page
    holding positions ``i*P .. i*P+P-1`` of slot ``s``; row ``num_slots`` (the scratch slot)
    is all scratch page. Host-side changes reach ``table`` in ``sync`` (one small copy of the
    changed entries, non-blocking), never inside a captured graph.

    ``preallocate=True`` gives every slot all its pages up front (a standalone cache then
    behaves like a dense one); the engine's table starts empty and grows per request.
    """

    def __init__(self, num_slots: int, max_seq_len: int, page_size: int = DEFAULT_PAGE_SIZE,
                 *, num_pages: int | None = None, device: torch.device | str = "cpu",
                 preallocate: bool = False) -> None:
        if num_slots < 1 or max_seq_len < 1 or page_size < 1:
            raise ValueError(f"num_slots ({num_slots}), max_seq_len ({max_seq_len}) and "
                             f"page_size ({page_size}) must be >= 1")
        self.num_slots, self.max_seq_len, self.page_size = num_slots, max_seq_len, page_size
        self.pages_per_slot = -(-max_seq_len // page_size)
        self.num_pages = num_slots * self.pages_per_slot if num_pages is None else num_pages
        self.scratch_page = self.num_pages
        # LIFO free list: a page freed by a rewind is the next one handed out (warm in cache).
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._owned: list[list[int]] = [[] for _ in range(num_slots + 1)]
        self.host = torch.full((num_slots + 1, self.pages_per_slot), self.scratch_page,
                               dtype=torch.int32)
        # The same memory as numpy: resize writes one entry at a time, ~0.1 us each here
        # against ~3 us through torch indexing (reserve and trim run every iteration).
        self._host_rows = self.host.numpy()
        # Table entries changed since the last ``sync``: flat index (slot * pages_per_slot
        # + i) -> page, the last write of each (a page taken and given back before a sync
        # leaves one entry, not two copies racing in one scatter).
        self._dirty: dict[int, int] = {}
        # Per slot, the lengths its page count holds as they are: ``resize(slot, length)``
        # changes nothing while ``shrink_at[slot] < length <= grow_at[slot]`` (one
        # comparison a row where only growth is asked for). Kept by ``resize``; read-only
        # to everyone else (the runner's per-row reservations and trims).
        self.grow_at = [0] * (num_slots + 1)
        self.shrink_at = [-_UNBOUNDED] * (num_slots + 1)
        if preallocate:
            for slot in range(num_slots):
                self.resize(slot, max_seq_len)
            self._dirty.clear()     # the table below is made from the filled host rows
        with torch.inference_mode(False):
            self.table = self.host.to(device)
        self._staging = StagingRing(self.table.device, torch.int32)

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_of(self, slot: int) -> tuple[int, ...]:
        return tuple(self._owned[slot])

    def pages_for(self, length: int) -> int:
        """Pages that hold positions ``0..length-1`` (capped at a slot's maximum)."""
        return min(-(-max(length, 0) // self.page_size), self.pages_per_slot)

    def resize(self, slot: int, length: int) -> None:
        """Own exactly the pages for positions ``< length``: allocate as a request grows,
        free past a page boundary when it rewinds (or finishes: ``length=0``)."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range 0..{self.num_slots - 1}")
        # Inline pages_for: this runs twice per request per iteration.
        want = -(-length // self.page_size) if length > 0 else 0
        if want > self.pages_per_slot:
            want = self.pages_per_slot
        owned = self._owned[slot]
        if want == len(owned):
            return
        if want > len(owned) and want - len(owned) > len(self._free):
            raise CacheFullError(
                f"slot {slot} needs {want - len(owned)} more KV pages for {length} positions, "
                f"{len(self._free)} free of {self.num_pages}; raise the page budget or "
                "lower scheduler.max_batch_size")
        row, dirty, base = self._host_rows[slot], self._dirty, slot * self.pages_per_slot
        while len(owned) < want:
            page = self._free.pop()
            row[len(owned)] = dirty[base + len(owned)] = page
            owned.append(page)
        while len(owned) > want:
            self._free.append(owned.pop())
            row[len(owned)] = dirty[base + len(owned)] = self.scratch_page
        self.grow_at[slot] = want * self.page_size if want < self.pages_per_slot else _UNBOUNDED
        self.shrink_at[slot] = (want - 1) * self.page_size if want else -_UNBOUNDED

    def resize_many(self, lengths: Iterable[tuple[int, int]], *, shrink: bool = True) -> None:
        """``resize(slot, length)`` of each (slot, length), in order; the slot's bounds
        (``grow_at``, ``shrink_at``) compared first, inline: most rows, most iterations,
        keep their pages (a row crosses a page every page_size tokens), and a call cost
        ~0.2 us a row (RESCAN's trims and the next step's reservations, per row per
        iteration). ``shrink`` False only adds
        pages: a slot holding enough for ``length`` positions keeps them all (a
        reservation for the next step must not give back what another path reserved for
        a longer one: the two would take and free the same page every iteration, each
        time a copy of the table)."""
        resize, grow_at = self.resize, self.grow_at
        if not shrink:
            for slot, length in lengths:
                if length > grow_at[slot]:
                    resize(slot, length)
            return
        shrink_at = self.shrink_at
        for slot, length in lengths:
            if length > grow_at[slot] or length <= shrink_at[slot]:
                resize(slot, length)

    def release(self, slot: int) -> None:
        self.resize(slot, 0)

    def sync(self) -> None:
        """Bring the device table up to date (the changed entries only; no device sync):
        their flat indices and pages in one pinned host buffer of the staging ring, one
        copy, one ``index_copy_``. A row crosses a page every page_size tokens, so at
        batch 8 and up some row does nearly every iteration, and RESCAN's trims and the
        next step's reservations each call it. Packing into a fresh pageable buffer, pinning
        it and scattering with advanced indexing took 59-76 us a call of the H200's host
        (bench/bench_page_sync_gpu.py)."""
        dirty = self._dirty
        if not dirty:
            return
        if self.table.data_ptr() == self.host.data_ptr():   # on the CPU: the same memory
            dirty.clear()
            return
        n = len(dirty)
        words, staged = self._staging.take(3 * n)
        # int32 words: the indices as int64 in words[0:2n] (index_copy_'s index type),
        # the pages in words[2n:3n].
        words[:2 * n].view(numpy.int64)[:] = numpy.fromiter(dirty, numpy.int64, n)
        words[2 * n:3 * n] = numpy.fromiter(dirty.values(), numpy.int32, n)
        dirty.clear()
        device = self._staging.copy(staged, 3 * n)
        self.table.view(-1).index_copy_(0, device[:2 * n].view(torch.int64),
                                        device[2 * n:3 * n])


class KVCache:
    """K and V pages ``[L, num_pages + 1, page_size, num_kv_heads, head_dim]`` of one model.

    Which positions of a slot are valid is the engine's bookkeeping: the decoder only ever
    attends to positions <= the query's, so rewinding rejected drafts within a page is free
    (stale entries are masked, then overwritten); pages past the rewind are given back.
    """

    def __init__(
        self,
        args: ModelArgs,
        num_slots: int,
        max_seq_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        num_layers: int | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        pages: PageTable | None = None,
    ) -> None:
        if pages is None:
            pages = PageTable(num_slots, max_seq_len, page_size, device=device, preallocate=True)
        if pages.num_slots != num_slots or pages.max_seq_len != max_seq_len:
            raise ValueError(f"shared page table is for {pages.num_slots} slots x "
                             f"{pages.max_seq_len} positions, not {num_slots} x {max_seq_len}")
        self.pages = pages
        layers = args.num_layers if num_layers is None else num_layers
        shape = (layers, pages.num_pages + 1, pages.page_size, args.num_kv_heads, args.head_dim)
        self.num_layers = layers
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.num_kv_heads = args.num_kv_heads
        # Normal (not inference-mode) tensors even when built under inference_mode, so later
        # in-place writes work in or out of it.
        with torch.inference_mode(False):
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        log.debug("kv_cache_allocated", shape=shape, dtype=str(dtype), nbytes=self.nbytes)

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    @property
    def page_size(self) -> int:
        return self.pages.page_size

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        return int(2 * self.k.numel() * self.k.element_size())

    def locate(self, slots: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset) [B, T] i64 of positions [B, T] in slots [B]; positions past
        ``max_seq_len`` land in the scratch page instead of failing an index."""
        P, table = self.page_size, self.pages.table
        index = (positions // P).clamp(max=self.pages.pages_per_slot - 1)
        page = table[slots[:, None], index].long()
        page = torch.where(positions < self.max_seq_len, page, self.pages.scratch_page)
        return page, positions % P

    def write(self, layer: int, page: torch.Tensor, offset: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store k, v [B, T, Hkv, D] in place at (page, offset) [B, T] of ``layer``."""
        self.k[layer].index_put_((page, offset), k)
        self.v[layer].index_put_((page, offset), v)

    def read(self, layer: int, slots: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``kv_len`` positions of each row's slot, gathered from its pages:
        k, v [B, Hkv, kv_len, D] (the reference path; kernels read pages directly)."""
        n = self.pages.pages_for(kv_len)
        pages = self.pages.table[slots, :n].long()  # [B, n]
        B = pages.shape[0]

        def gather(store: torch.Tensor) -> torch.Tensor:
            # index_select over the flat page list: half advanced indexing's time on the
            # CPU (one layer, 10 pages: 6 against 14 us), the same values.
            x = store[layer].index_select(0, pages.reshape(-1))  # [B*n, P, Hkv, D]
            return x.reshape(B, n * self.page_size, *x.shape[2:])[:, :kv_len].transpose(1, 2)

        return gather(self.k), gather(self.v)

    def keep_path(self, slots: torch.Tensor, start_pos: torch.Tensor, path: torch.Tensor,
                  rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """After a draft tree's VERIFY (rows stored at start_pos + row): the K/V of row
        ``path[b, j]`` move to position start_pos + j, every layer, so the accepted path
        sits where a chain's would (``path`` [B, D + 1], row 0 the root, stored there
        already). All are read before any is written (a row's index is at least its
        depth, so no source is overwritten first either way). Positions past a row's
        accepted drafts receive some row's entries: past the committed length, they are
        masked, then overwritten, as a chain's rejected drafts. On CUDA one kernel
        (``_kernels.keep_path``: the same moves), else the torch ops below. ``rows``
        [B, R, F] (VERIFY's per-row features): also -> the path's rows of it [B, D + 1, F]
        (in the same kernel on CUDA)."""
        if self.k.is_cuda and _kernels.available():
            return _kernels.keep_path(self.k, self.v, self.pages.table, slots, start_pos,
                                      path, self.max_seq_len, self.pages.scratch_page, rows)
        dest = start_pos[:, None] + torch.arange(path.shape[1], device=path.device)
        src_page, src_off = self.locate(slots, start_pos[:, None] + path)
        dst_page, dst_off = self.locate(slots, dest)
        for store in (self.k, self.v):
            store[:, dst_page, dst_off] = store[:, src_page, src_off]
        if rows is None:
            return None
        return rows.gather(1, path[:, :, None].expand(-1, -1, rows.shape[-1]))

    def clear_slot(self, slot: int) -> None:
        """Zero one slot's pages (never needed for correctness; useful for debugging)."""
        for page in self.pages.pages_of(slot):
            self.k[:, page].zero_()
            self.v[:, page].zero_()
