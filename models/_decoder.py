"""DecoderModel: a Llama / Qwen2 decoder over a static slot-indexed KV cache.

Weights are stacked per kind over layers (fused qkv and gate-up) so a forward is one
short Python loop of plain tensor ops, no nn.Module call per layer.
"""

from __future__ import annotations

from typing import NamedTuple

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from ._args import ModelArgs
from ._cache import KVCache
from ._layers import apply_rope, rms_norm, rope_tables

log = structlog.get_logger(__name__)

# The dynamic path attends over a cache prefix rounded up to this, so shapes repeat.
KV_LEN_MULTIPLE = 64


class _Step(NamedTuple):
    """Per-forward tensors shared by every layer."""

    cos: torch.Tensor  # [B, T, 1, D]
    sin: torch.Tensor  # [B, T, 1, D]
    write_slots: torch.Tensor  # [B, 1, T]
    write_pos: torch.Tensor  # [B, 1, T]
    read_slots: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, 1, G*T, kv_len] bool, True = attend
    kv_len: int


class _LayerWeights(NamedTuple):
    attn_norm: torch.Tensor  # [H]
    wqkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    bqkv: torch.Tensor | None  # [(Hq + 2 Hkv) D]
    wo: torch.Tensor  # [H, Hq D]
    mlp_norm: torch.Tensor  # [H]
    w_gate_up: torch.Tensor  # [2 I, H]
    w_down: torch.Tensor  # [H, I]


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class DecoderModel(nn.Module):
    """``forward`` -> final-normed hidden states; ``logits`` -> f32 vocab scores."""

    def __init__(
        self, args: ModelArgs, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        self.args = args
        L, H, I, V = args.num_layers, args.hidden_size, args.intermediate_size, args.vocab_size
        qkv = args.q_size + 2 * args.kv_size
        p = dict(dtype=dtype, device=device)
        self.embed_tokens = _param(V, H, **p)
        self.attn_norm = _param(L, H, **p)
        self.wqkv = _param(L, qkv, H, **p)
        self.register_parameter("bqkv", _param(L, qkv, **p) if args.attention_bias else None)
        self.wo = _param(L, H, args.q_size, **p)
        self.mlp_norm = _param(L, H, **p)
        self.w_gate_up = _param(L, 2 * I, H, **p)
        self.w_down = _param(L, H, I, **p)
        self.norm = _param(H, **p)
        self.register_parameter("lm_head", None if args.tie_word_embeddings else _param(V, H, **p))
        cos, sin = rope_tables(args, args.max_position_embeddings, dtype, device)
        self.register_buffer("rope_cos", cos, persistent=False)  # [P, D]
        self.register_buffer("rope_sin", sin, persistent=False)  # [P, D]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, H]: the embedding when tied."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] i64 -> embeddings [B, T, H]."""
        return F.embedding(tokens, self.embed_tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> f32 logits [..., V]."""
        with torch.no_grad():
            return F.linear(hidden, self.lm_head_weight).float()

    def make_cache(self, num_slots: int, max_seq_len: int) -> KVCache:
        """A KVCache for this model, on its device and in its dtype."""
        return KVCache(self.args, num_slots, max_seq_len, self.dtype, self.device)

    def forward(
        self,
        tokens: torch.Tensor,
        start_pos: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache,
        *,
        num_layers: int | None = None,
        kv_len: int | None = None,
    ) -> torch.Tensor:
        """tokens [B, T] i64 at positions start_pos [B].. of cache slots [B] -> hidden [B, T, H].

        Writes K/V for positions start_pos..start_pos+T-1 of each row's slot, then attends
        causally within the slot. ``num_layers`` = early exit after that many layers (then
        the final norm). ``kv_len`` fixes the attended cache length (static shapes, e.g.
        ``cache.max_seq_len`` for graph capture); by default it is the needed prefix rounded
        up to KV_LEN_MULTIPLE, which reads ``start_pos`` on the host.
        """
        return self.forward_embeds(
            self.embed(tokens), start_pos, slots, cache, num_layers=num_layers, kv_len=kv_len
        )

    @torch.no_grad()
    def forward_embeds(
        self,
        embeds: torch.Tensor,
        start_pos: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache,
        *,
        num_layers: int | None = None,
        kv_len: int | None = None,
    ) -> torch.Tensor:
        """Like ``forward`` on input embeddings [B, T, H] (e.g. an MTP head's fused input)."""
        n = self._num_layers(num_layers, cache)
        step = self._step(embeds.shape[1], start_pos, slots, cache, kv_len)
        x = embeds  # [B, T, H]
        for i, w in enumerate(self._layer_weights(n)):
            x = self._layer(i, w, x, step, cache)
        return rms_norm(x, self.norm, self.args.rms_norm_eps)

    def _num_layers(self, num_layers: int | None, cache: KVCache) -> int:
        n = self.args.num_layers if num_layers is None else num_layers
        if not 1 <= n <= min(self.args.num_layers, cache.num_layers):
            raise ValueError(
                f"num_layers={n} out of range 1..{min(self.args.num_layers, cache.num_layers)}"
            )
        return n

    def _layer_weights(self, n: int) -> list[_LayerWeights]:
        stacks = [self.attn_norm, self.wqkv, self.bqkv, self.wo, self.mlp_norm, self.w_gate_up, self.w_down]
        per_kind = [[None] * n if s is None else s[:n].unbind(0) for s in stacks]
        return [_LayerWeights(*ws) for ws in zip(*per_kind)]

    def _step(
        self, T: int, start_pos: torch.Tensor, slots: torch.Tensor, cache: KVCache, kv_len: int | None
    ) -> _Step:
        kv_len = _resolve_kv_len(start_pos, T, cache, kv_len)
        dev = self.device
        start_pos, slots = start_pos.to(dev, non_blocking=True), slots.to(dev, non_blocking=True)
        pos = start_pos[:, None] + torch.arange(T, device=dev)  # [B, T]
        # Out-of-range positions write into the scratch slot instead of failing an index.
        in_range = pos < cache.max_seq_len
        write_slots = torch.where(in_range, slots[:, None], cache.scratch_slot)[:, None, :]
        write_pos = pos.clamp(max=cache.max_seq_len - 1)[:, None, :]
        rope_pos = pos.clamp(max=self.rope_cos.shape[0] - 1)
        cos = self.rope_cos[rope_pos][:, :, None, :]
        sin = self.rope_sin[rope_pos][:, :, None, :]
        mask = torch.arange(kv_len, device=dev)[None, None, :] <= pos[:, :, None]  # [B, T, kv]
        groups = self.args.num_heads // self.args.num_kv_heads
        B = pos.shape[0]
        mask = mask[:, None, None].expand(B, 1, groups, T, kv_len).reshape(B, 1, groups * T, kv_len)
        return _Step(cos, sin, write_slots, write_pos, slots, mask, kv_len)

    def _layer(self, i: int, w: _LayerWeights, x: torch.Tensor, step: _Step, cache: KVCache) -> torch.Tensor:
        a = self.args
        B, T, _ = x.shape
        Hq, Hkv, D = a.num_heads, a.num_kv_heads, a.head_dim
        G = Hq // Hkv
        h = rms_norm(x, w.attn_norm, a.rms_norm_eps)
        qkv = F.linear(h, w.wqkv, w.bqkv).view(B, T, Hq + 2 * Hkv, D)
        qk = apply_rope(qkv[:, :, : Hq + Hkv], step.cos, step.sin)  # [B, T, Hq+Hkv, D]
        k = qk[:, :, Hq:].transpose(1, 2)  # [B, Hkv, T, D]
        v = qkv[:, :, Hq + Hkv :].transpose(1, 2)  # [B, Hkv, T, D]
        cache.write(i, step.write_slots, step.write_pos, k, v)
        keys, values = cache.read(i, step.read_slots, step.kv_len)  # [B, Hkv, kv, D]
        # Query heads sharing a KV head are stacked along the query axis: [B, Hkv, G*T, D].
        q = qk[:, :, :Hq].reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=step.mask)
        o = o.reshape(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hq * D)
        x = x + F.linear(o, w.wo)
        h = rms_norm(x, w.mlp_norm, a.rms_norm_eps)
        gate, up = F.linear(h, w.w_gate_up).chunk(2, dim=-1)  # [B, T, I] each
        return x + F.linear(F.silu(gate) * up, w.w_down)


def _resolve_kv_len(start_pos: torch.Tensor, T: int, cache: KVCache, kv_len: int | None) -> int:
    if kv_len is not None:
        if not 1 <= kv_len <= cache.max_seq_len:
            raise ValueError(f"kv_len={kv_len} out of range 1..{cache.max_seq_len}")
        return kv_len
    end = int(start_pos.max()) + T  # host sync: the dynamic path needs the length on the host
    if end > cache.max_seq_len:
        raise ValueError(
            f"positions up to {end - 1} exceed the KV cache's max_seq_len={cache.max_seq_len}"
        )
    rounded = -(-end // KV_LEN_MULTIPLE) * KV_LEN_MULTIPLE
    return min(rounded, cache.max_seq_len)
