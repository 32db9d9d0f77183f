"""DecoderModel: a Llama / Qwen2 decoder over a paged, slot-indexed KV cache.

Weights are stacked per kind over layers (fused qkv and gate-up) so a forward is one
short Python loop, no nn.Module call per layer. Two paths compute the same function:
plain tensor ops (the reference; CPU, float64 tests) and, on CUDA, fused Triton kernels
(residual add + RMSNorm, RoPE + cache write, paged attention over real lengths, SwiGLU:
nine kernels per layer with the four GEMMs; for few rows the GEMMs run on the
skinny-GEMM kernel, which takes SwiGLU into the gate-up projection and RoPE + the cache
write into the qkv projection, see _linear).
``DecoderModel.kernels`` picks one.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import attrs
import structlog
import torch
import torch.nn.functional as F
from torch import nn

from ._args import ModelArgs
from ._cache import KVCache
from ._layers import apply_rope, rms_norm, rope_tables
from ._linear import PackedLinear
from ._skinny import RopeWrite
from . import _kernels
from ._grad import no_grad

log = structlog.get_logger(__name__)

# The dynamic path attends over a cache prefix rounded up to this, so shapes repeat.
KV_LEN_MULTIPLE = 64

# DecoderModel.embed: above this many tokens a CUDA lookup indexes the table (see there).
EMBED_INDEX_FROM = 1


class _Step(NamedTuple):
    """Per-forward tensors shared by every layer."""

    # The reference path's (the fused kernels compute them from start_pos and slots):
    pos: torch.Tensor | None  # [B, T] absolute positions
    page: torch.Tensor | None  # [B, T] cache page of each new token
    offset: torch.Tensor | None  # [B, T] its offset in the page
    slots: torch.Tensor  # [B]
    start_pos: torch.Tensor  # [B]
    cos: torch.Tensor | None  # [B, T, 1, D] (reference path)
    sin: torch.Tensor | None  # [B, T, 1, D]
    mask: torch.Tensor | None  # [B, 1, G*T, kv_len] bool, True = attend (reference path)
    kv_len: int
    pos_offset: int  # added to start_pos by the fused kernels (the reference path's is in)
    # The fused kernels' draft tree: RoPE offsets [T] and visibility words [T] (``bits``),
    # and the tree's rows stored before the forward's own (TreeMask).
    tree_offsets: torch.Tensor | None = None
    tree_bits: torch.Tensor | None = None
    tree_back: int = 0


@attrs.frozen(eq=False, slots=False)     # (no slots: ``bits`` is cached on the instance)
class TreeMask:
    """The T rows of a forward are a draft tree's (samplers/_tree.py), or one depth's of
    them: row t is stored at start_pos + t (as any forward's), sits at position start_pos
    + ``offsets[t]`` (RoPE), and attends the cache before the tree's rows and, among
    them, those ``visible[t]`` marks (itself and its ancestors). The tree's W rows
    stored so far end with the forward's own: they sit at start_pos + T - W ..
    start_pos + T - 1 (W = T: the whole tree in one forward, as VERIFY runs it)."""

    offsets: torch.Tensor   # [T] i64
    visible: torch.Tensor   # [T, W] bool

    def check(self, rows: int) -> None:
        shape = tuple(self.visible.shape)
        if self.offsets.shape != (rows,) or len(shape) != 2 or shape[0] != rows or \
                shape[1] < rows:
            raise ValueError(f"tree mask for {tuple(self.offsets.shape)} rows (visible "
                             f"{shape}), forward of {rows}")

    def among_rows(self, start_pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        """bool [B, T, kv_len]: False where key j is one of the tree's rows that query t
        must not see; True elsewhere (the causal mask does the rest)."""
        rows, width = self.visible.shape
        dev = start_pos.device
        first = start_pos + rows - width                                       # [B]
        rel = torch.arange(kv_len, device=dev)[None, :] - first[:, None]     # [B, kv]
        inside = (rel >= 0) & (rel < width)
        seen = self.visible.to(dev)[:, rel.clamp(0, width - 1)]                # [T, B, kv]
        return ~inside[:, None, :] | seen.permute(1, 0, 2)

    @property
    def back(self) -> int:
        """The tree's rows stored before the forward's own (W - T)."""
        return int(self.visible.shape[1] - self.visible.shape[0])

    @functools.cached_property
    def bits(self) -> torch.Tensor:
        """int64 [T] on ``visible``'s device: bit j of row t's word set where it sees the
        tree's row j (the fused attention kernel's form; 63 rows at most). Built once per
        mask, outside any graph capture (a tree's masks are made once)."""
        width = self.visible.shape[1]
        if width > 63:
            raise ValueError(f"tree mask over {width} rows: the fused kernels take 63")
        weights = torch.tensor([1 << j for j in range(width)], dtype=torch.int64)
        return (self.visible.cpu().long() * weights).sum(dim=1).to(self.visible.device)


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
        # None: fused kernels on CUDA when Triton imports, plain ops elsewhere; tests set it.
        self.kernels: bool | None = None
        # Every matmul of both paths: F.linear, but VERIFY-sized row counts on the CPU run
        # on oneDNN-packed weights (packed on first use), and 1..32 rows on CUDA in bf16 /
        # fp16 on the skinny-GEMM kernel (see _linear; ``self.linear.skinny = False`` or
        # SPECLOOP_SKINNY=0: cuBLAS).
        self.linear = PackedLinear()
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
        """tokens [B, T] i64 -> embeddings [B, T, H]; the same values either way. On CUDA
        for more than EMBED_INDEX_FROM tokens by indexing (PyTorch's vectorized gather):
        F.embedding's index_select kernel walks up to 16 indices one after another (an
        H100, captured: 1.6-1.8 us for 1 token, 3.3-3.8 for 4, 11.1 for a 15-node tree's 16
        VERIFY rows) where the gather took 1.5-1.6 us for 4 to 32; for one token indexing
        runs a slower kernel (4.6-4.8 us). bench_tree_verify_gpu.py --kernels and
        profile_spec_gpu.py's critical paths, 2026-12-05."""
        if tokens.is_cuda and tokens.numel() > EMBED_INDEX_FROM:
            return self.embed_tokens[tokens]
        return F.embedding(tokens, self.embed_tokens)

    def logits(self, hidden: torch.Tensor, *, keep_dtype: bool = False) -> torch.Tensor:
        """hidden [..., H] -> f32 logits [..., V] (``keep_dtype``: in the model's dtype,
        for a reader that widens them itself: the greedy VERIFY kernels compare bf16 as
        f32, an exact widening, so the f32 copy of VERIFY's [B, T, V] logits, a kernel of
        its own, buys them nothing)."""
        with torch.no_grad():
            out = self.linear(hidden, self.lm_head_weight)
            return out if keep_dtype else out.float()

    def make_cache(self, num_slots: int, max_seq_len: int, **kw: Any) -> KVCache:
        """A KVCache for this model, on its device and in its dtype (``kw``: page_size,
        pages: see KVCache)."""
        return KVCache(self.args, num_slots, max_seq_len, self.dtype, self.device, **kw)

    def forward(
        self,
        tokens: torch.Tensor,
        start_pos: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache,
        *,
        num_layers: int | None = None,
        kv_len: int | None = None,
        capture: tuple[int, ...] = (),
        tree: TreeMask | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] i64 at positions start_pos [B].. of cache slots [B] -> hidden [B, T, H].

        Writes K/V for positions start_pos..start_pos+T-1 of each row's slot, then attends
        causally within the slot. ``num_layers`` = early exit after that many layers (then
        the final norm). ``kv_len`` fixes the attended cache length (static shapes, e.g.
        ``cache.max_seq_len`` for graph capture); by default it is the needed prefix rounded
        up to KV_LEN_MULTIPLE, which reads ``start_pos`` on the host. ``capture`` (layer
        indices, 0-based) also returns the residual stream after each of those layers,
        concatenated: (hidden, features [B, T, len(capture) * H]), e.g. for an EAGLE-3 head.
        ``tree``: the T rows are a draft tree's (``TreeMask``), not a sequence.
        """
        gather = None
        if self.uses_kernels and tokens.dim() == 2 and self.linear.gather_embeddings:
            embeds = self.embed_tokens.new_empty(*tokens.shape, self.args.hidden_size)
            # The first layer's qkv GEMM loads the embeddings itself where it can (it
            # writes them into ``embeds``, the residual stream): no kernel for the lookup.
            if self.linear.gathers_embeddings(
                    embeds, self.attn_norm[0], self.wqkv[0],
                    None if self.bqkv is None else self.bqkv[0], self.args.head_dim):
                gather = (tokens, self.embed_tokens)
        if gather is None:
            embeds = self.embed(tokens)
        return self.forward_embeds(
            embeds, start_pos, slots, cache, num_layers=num_layers, kv_len=kv_len,
            capture=capture, tree=tree, gather=gather,
        )

    @no_grad
    def forward_embeds(
        self,
        embeds: torch.Tensor,
        start_pos: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache,
        *,
        num_layers: int | None = None,
        kv_len: int | None = None,
        capture: tuple[int, ...] = (),
        pos_offset: int = 0,
        tree: TreeMask | None = None,
        last: torch.Tensor | None = None,
        gather: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Like ``forward`` on input embeddings [B, T, H] (e.g. an MTP head's fused input).
        ``pos_offset``: the rows sit at start_pos + pos_offset.. (the fused kernels add it
        themselves: a draft step needs no position tensor of its own). ``last`` [B]: the
        output of row last[b] of each b alone, [B, H] (every row still runs and writes its
        K/V; the final norm reads the one row: a draft's catch-up, no gather after it).
        ``gather`` (tokens [B, T], the embedding table; the fused path): ``embeds`` is
        written by the first layer's qkv GEMM, which looks the tokens up as it loads them
        (``forward``)."""
        n = self._num_layers(num_layers, cache)
        if list(capture) != sorted(set(capture)) or any(not 0 <= i < n for i in capture):
            raise ValueError(f"capture={capture}: layers must be increasing and < {n}")
        if last is not None and capture:
            raise ValueError("forward_embeds: last= with captured layers")
        fused = self.uses_kernels
        if tree is not None:
            tree.check(embeds.shape[1])
        if pos_offset and not fused:
            start_pos = start_pos + pos_offset
        step = self._step(embeds.shape[1], start_pos, slots, cache, kv_len, fused, pos_offset,
                          tree)
        weights = self._layer_weights(n)
        eps = self.args.rms_norm_eps
        if fused:
            H = self.args.hidden_size
            # The residual stream after captured layer i is the sum the next norm kernel
            # forms (layer i + 1's, or the final norm's): that kernel also stores it here.
            feats = embeds.new_empty(*embeds.shape[:-1], len(capture) * H) if capture else None
            into = {i: feats[..., j * H:(j + 1) * H] for j, i in enumerate(capture)} \
                if feats is not None else {}
            x, delta = embeds, None  # residual stream, and what is still to be added to it
            # Where the next layer's qkv GEMM normalises the stream as it loads it (the
            # same for every layer: one shape), the down GEMM adds the MLP's output to the
            # stream; not before a captured layer or the final norm (their norm kernels run
            # anyway: models/_linear's out_norm_mlp).
            w0 = weights[0]
            feeds = n > 1 and self.linear.takes_stream(embeds, w0.attn_norm, w0.wqkv, w0.bqkv,
                                                       self.args.head_dim)
            for i, w in enumerate(weights):
                x, delta = self._fused_layer(i, w, x, delta, step, cache, into.get(i - 1),
                                             feeds and i + 1 < n and i not in into,
                                             gather if i == 0 else None)
            out = _kernels.add_rms_norm(x, delta, self.norm, eps, into.get(n - 1),
                                        pick=last)[0]
            return (out, feats) if feats is not None else out
        x = embeds  # [B, T, H]
        captured = []  # the residual stream after the captured layers
        for i, w in enumerate(weights):
            x = self._layer(i, w, x, step, cache)
            if i in capture:
                captured.append(x)
        if last is not None:
            x = x.gather(1, last.reshape(-1, 1, 1).expand(-1, 1, x.shape[-1]))[:, 0]
        out = rms_norm(x, self.norm, eps)
        return (out, torch.cat(captured, dim=-1)) if capture else out

    @property
    def uses_kernels(self) -> bool:
        """The fused path: ``kernels`` if set, else on CUDA in 16-bit floats when Triton is
        there (fp32 keeps the reference path: the kernels' dots would run in TF32)."""
        if self.kernels is not None:
            return self.kernels
        d = self.args.head_dim
        return (self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16)
                and d >= 16 and d & (d - 1) == 0 and _kernels.available())

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
        self, T: int, start_pos: torch.Tensor, slots: torch.Tensor, cache: KVCache,
        kv_len: int | None, fused: bool, pos_offset: int = 0, tree: TreeMask | None = None,
    ) -> _Step:
        if self.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            cache.pages.sync()
        dev = self.device
        start_pos, slots = start_pos.to(dev, non_blocking=True), slots.to(dev, non_blocking=True)
        if fused:  # the kernels find positions, pages and lengths on the device
            if tree is None:
                return _Step(None, None, None, slots, start_pos, None, None, None, 0,
                             pos_offset)
            return _Step(None, None, None, slots, start_pos, None, None, None, 0, pos_offset,
                         tree.offsets.to(dev), tree.bits.to(dev), tree.back)
        pos = start_pos[:, None] + torch.arange(T, device=dev)  # [B, T]
        page, offset = cache.locate(slots, pos)
        kv_len = _resolve_kv_len(start_pos, T, cache, kv_len)
        # A tree's row sits at its depth's position (RoPE), stored at its own index.
        rope_pos = pos if tree is None else start_pos[:, None] + tree.offsets.to(dev)[None, :]
        rope_pos = rope_pos.clamp(max=self.rope_cos.shape[0] - 1)
        cos = self.rope_cos[rope_pos][:, :, None, :]
        sin = self.rope_sin[rope_pos][:, :, None, :]
        mask = torch.arange(kv_len, device=dev)[None, None, :] <= pos[:, :, None]  # [B, T, kv]
        if tree is not None:
            mask = mask & tree.among_rows(start_pos, kv_len)
        groups = self.args.num_heads // self.args.num_kv_heads
        B = pos.shape[0]
        mask = mask[:, None, None].expand(B, 1, groups, T, kv_len).reshape(B, 1, groups * T, kv_len)
        return _Step(pos, page, offset, slots, start_pos, cos, sin, mask, kv_len, 0)

    def _layer(self, i: int, w: _LayerWeights, x: torch.Tensor, step: _Step, cache: KVCache) -> torch.Tensor:
        """The reference layer: plain tensor ops, K/V gathered from the pages."""
        a = self.args
        B, T, _ = x.shape
        Hq, Hkv, D = a.num_heads, a.num_kv_heads, a.head_dim
        G = Hq // Hkv
        h = rms_norm(x, w.attn_norm, a.rms_norm_eps)
        qkv = self.linear(h, w.wqkv, w.bqkv).view(B, T, Hq + 2 * Hkv, D)
        qk = apply_rope(qkv[:, :, : Hq + Hkv], step.cos, step.sin)  # [B, T, Hq+Hkv, D]
        cache.write(i, step.page, step.offset, qk[:, :, Hq:], qkv[:, :, Hq + Hkv :])
        keys, values = cache.read(i, step.slots, step.kv_len)  # [B, Hkv, kv, D]
        # Query heads sharing a KV head are stacked along the query axis: [B, Hkv, G*T, D].
        q = qk[:, :, :Hq].reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=step.mask)
        o = o.reshape(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hq * D)
        x = x + self.linear(o, w.wo)
        h = rms_norm(x, w.mlp_norm, a.rms_norm_eps)
        gate, up = self.linear(h, w.w_gate_up).chunk(2, dim=-1)  # [B, T, I] each
        return x + self.linear(F.silu(gate) * up, w.w_down)

    def _fused_layer(self, i: int, w: _LayerWeights, x: torch.Tensor, delta: torch.Tensor | None,
                     step: _Step, cache: KVCache, capture: torch.Tensor | None = None,
                     feeds_stream: bool = False,
                     gather: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The same layer in nine kernels (5 with the skinny fusions: the norms in the
        qkv and gate-up GEMMs' prologues, RoPE + the cache write in qkv's epilogue,
        SwiGLU in gate-up's; 7 where the norms stay apart); returns the
        residual stream and the MLP output still to be added (the next layer's norm kernel
        adds it; None where the down GEMM added it: ``feeds_stream``, the next layer's
        qkv GEMM normalising the stream as it loads it). ``capture``: where the first norm
        kernel also stores its input stream x + delta (the last layer's output)."""
        a = self.args
        # The GEMMs through the one dispatcher: the skinny-GEMM kernel for few rows on
        # CUDA (models/_linear; ``self.linear.skinny``), else F.linear; each residual add
        # + RMSNorm is the add_rms_norm kernel, or the GEMM's prologue (``skinny_norm``).
        # RoPE + the K/V cache write after the qkv GEMM, or its epilogue (norm_linear_rope).
        rope = RopeWrite(step.start_pos, step.slots, cache.pages.table, cache.max_seq_len,
                         cache.pages.scratch_page, self.rope_cos, self.rope_sin, cache.k[i],
                         cache.v[i], a.num_heads, step.pos_offset, step.tree_offsets)
        q, x = self.linear.norm_linear_rope(x, delta, w.attn_norm, a.rms_norm_eps, w.wqkv,
                                            w.bqkv, capture, rope, gather)
        o = _kernels.paged_attention(q, cache.k[i], cache.v[i], cache.pages.table, step.slots,
                                     step.start_pos, step.pos_offset,
                                     tree_bits=step.tree_bits, tree_back=step.tree_back)
        # The o GEMM and the MLP: on the skinny path SwiGLU in the gate-up GEMM's epilogue
        # (or the down GEMM's prologue), else silu_mul between the two GEMMs; with
        # ``mlp_stream`` the residual add in o's epilogue, the norm in gate-up's prologue
        # (models/_linear out_norm_mlp).
        mlp, x = self.linear.out_norm_mlp(x, o, w.wo, w.mlp_norm, a.rms_norm_eps, w.w_gate_up,
                                          w.w_down, feeds_stream)
        return x, mlp


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
