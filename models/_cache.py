"""KVCache: static, slot-indexed key/value buffers shared by the target and early-exit drafts."""

from __future__ import annotations

import structlog
import torch

from ._args import ModelArgs

log = structlog.get_logger(__name__)


class KVCache:
    """K and V buffers ``[L, num_slots + 1, num_kv_heads, max_seq_len, head_dim]``.

    Slot ``num_slots`` is scratch for padding rows. Which positions of a slot are valid is
    the engine's bookkeeping: the decoder only ever attends to positions <= the query's, so
    rewinding rejected drafts is free (stale entries are masked, then overwritten).
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
    ) -> None:
        if num_slots < 1 or max_seq_len < 1:
            raise ValueError(f"num_slots ({num_slots}) and max_seq_len ({max_seq_len}) must be >= 1")
        layers = args.num_layers if num_layers is None else num_layers
        shape = (layers, num_slots + 1, args.num_kv_heads, max_seq_len, args.head_dim)
        self.num_layers = layers
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.num_kv_heads = args.num_kv_heads
        # Normal (not inference-mode) tensors even when built under inference_mode, so later
        # in-place writes work in or out of it.
        with torch.inference_mode(False):
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
            # [1, Hkv, 1]: the head index of a write, broadcast against [B, 1, T] slot/pos.
            self._heads = torch.arange(args.num_kv_heads, device=device).view(1, -1, 1)
        log.debug("kv_cache_allocated", shape=shape, dtype=str(dtype), nbytes=self.nbytes)

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store k, v [B, Hkv, T, D] at (slots [B, 1, T], positions [B, 1, T]) of ``layer``."""
        index = (slots, self._heads, positions)
        self.k[layer].index_put_(index, k)
        self.v[layer].index_put_(index, v)

    def read(self, layer: int, slots: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``kv_len`` positions of each row's slot: k, v [B, Hkv, kv_len, D]."""
        k = self.k[layer, :, :, :kv_len].index_select(0, slots)
        v = self.v[layer, :, :, :kv_len].index_select(0, slots)
        return k, v

    def clear_slot(self, slot: int) -> None:
        """Zero one slot (never needed for correctness; useful for debugging stale reads)."""
        self.k[:, slot].zero_()
        self.v[:, slot].zero_()
