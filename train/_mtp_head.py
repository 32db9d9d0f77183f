"""The mtp_eagle head with gradients, unrolled for test-time training (TTT).

Same parameters (names, layouts) as ``specloop.models.drafters.MtpEagleHead.own_state()``,
so the trained state loads straight into the drafter. Step 0 reads the target's hidden
states h_p; step j >= 1 reads the head's own output of step j-1, as drafting does. For a
chain starting at p, step j sits at position p + j and attends to step-0 keys 0..p plus
its own chain's keys of steps 1..j (EAGLE-3's TTT mask) — the KV cache drafting sees.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from specloop.models._layers import apply_rope, rms_norm, rope_tables

if TYPE_CHECKING:
    from specloop.models import DecoderModel, ModelArgs


def _p(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape))


class _Block(nn.Module):
    """One decoder layer's weights, stacked over a layer axis of size 1 like DecoderModel."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        h, qkv, inter = args.hidden_size, args.q_size + 2 * args.kv_size, args.intermediate_size
        self.attn_norm, self.mlp_norm, self.norm = _p(1, h), _p(1, h), _p(h)
        self.wqkv, self.wo = _p(1, qkv, h), _p(1, h, args.q_size)
        self.bqkv = _p(1, qkv) if args.attention_bias else None
        self.w_gate_up, self.w_down = _p(1, 2 * inter, h), _p(1, h, inter)


class TrainableMtpHead(nn.Module):
    # The target layers whose residual streams the head reads at step 0 (EAGLE-3);
    # () = the target's final hidden state.
    feature_layers: tuple[int, ...] = ()

    def __init__(self, args: ModelArgs, embed: torch.Tensor, lm_head: torch.Tensor, d2t: torch.Tensor,
                 max_len: int) -> None:
        super().__init__()
        h = args.hidden_size
        self.args = args
        self.fc, self.enorm, self.hnorm = _p(h, 2 * h), _p(h), _p(h)
        self.block = _Block(args)
        # Frozen, shared with the target (not saved): embedding, draft rows of the LM head.
        self.register_buffer("embed", embed.detach().float(), persistent=False)
        self.register_buffer("draft_lm", lm_head.detach()[d2t].float(), persistent=False)
        self.register_buffer("d2t", d2t.clone())
        cos, sin = rope_tables(args, max_len, torch.float32, "cpu")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def init_from_target(self, target: DecoderModel, seed: int) -> None:
        """Decoder layer and final norm from the target's last layer; fc passes h through."""
        last = target.args.num_layers - 1
        b = self.block
        with torch.no_grad():
            for name in ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down"):
                getattr(b, name).copy_(getattr(target, name)[last:last + 1].float())
            if b.bqkv is not None:
                b.bqkv.copy_(target.bqkv[last:last + 1].float())
            b.norm.copy_(target.norm.float())
            # Damped residual branches: SmolLM2's start loss is lowest this way (11 vs 14
            # nats undamped, 16 zeroed), and the layer still starts from trained weights.
            b.wo.mul_(0.1)
            b.w_down.mul_(0.1)
            h = self.args.hidden_size
            gen = torch.Generator().manual_seed(seed)
            self.fc.copy_(torch.randn(h, 2 * h, generator=gen) * 0.02)
            self.fc[:, h:] += torch.eye(h, device=self.fc.device)
            self.enorm.fill_(1.0)
            self.hnorm.fill_(1.0)

    def export_state(self) -> dict[str, torch.Tensor]:
        """The drafter's own_state() names -> tensors, plus d2t."""
        return {k: v.detach() for k, v in self.state_dict().items()}

    def _layer(self, x: torch.Tensor, pos: torch.Tensor, keys: list[torch.Tensor],
               values: list[torch.Tensor]
               ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """x [B, T, H] at positions pos [T]; keys/values: earlier steps' [B, Hkv, T, D]."""
        a, b = self.args, self.block
        B, T, _ = x.shape
        hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        h = rms_norm(x, b.attn_norm[0], a.rms_norm_eps)
        qkv = F.linear(h, b.wqkv[0], None if b.bqkv is None else b.bqkv[0])
        qkv = qkv.view(B, T, hq + 2 * hkv, d)
        cos, sin = self.cos[pos][None, :, None], self.sin[pos][None, :, None]
        qk = apply_rope(qkv[:, :, :hq + hkv], cos, sin)
        q = qk[:, :, :hq].transpose(1, 2)                                  # [B, Hq, T, D]
        keys = keys + [qk[:, :, hq:].transpose(1, 2)]
        values = values + [qkv[:, :, hq + hkv:].transpose(1, 2)]
        mask = ttt_mask(T, len(keys), x.device)                            # [T, steps*T]
        g = hq // hkv
        o = F.scaled_dot_product_attention(
            q, torch.cat(keys, 2).repeat_interleave(g, 1),
            torch.cat(values, 2).repeat_interleave(g, 1), attn_mask=mask)
        x = x + F.linear(o.transpose(1, 2).reshape(B, T, hq * d), b.wo[0])
        h = rms_norm(x, b.mlp_norm[0], a.rms_norm_eps)
        gate, up = F.linear(h, b.w_gate_up[0]).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, b.w_down[0])
        return rms_norm(x, b.norm, a.rms_norm_eps), keys, values

    def step0_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's rows -> the hidden state step 0 reads (here: as they are)."""
        return hidden

    def unroll(self, tokens: torch.Tensor, hidden: torch.Tensor, steps: int
               ) -> list[torch.Tensor]:
        """tokens [B, T], target hidden [B, T, H] (or features [B, T, F*H]) -> per step j
        draft logits [B, T-1, N] for chains starting at p = 0..T-2 (step j predicts token
        p + 2 + j)."""
        return [F.linear(h, self.draft_lm) for h in self.unroll_hidden(tokens, hidden, steps)]

    def unroll_hidden(self, tokens: torch.Tensor, hidden: torch.Tensor, steps: int
                      ) -> list[torch.Tensor]:
        """As ``unroll``, but the head's output hidden states [B, T-1, H] per step (the
        draft LM head not applied: the trainer applies it to the labelled rows only)."""
        eps = self.args.rms_norm_eps
        n = tokens.shape[1] - 1
        pos = torch.arange(n, device=tokens.device)
        feed = self.step0_input(hidden[:, :-1].float())
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        out: list[torch.Tensor] = []
        for j in range(steps):
            tok = _shift(tokens[:, 1:], j)                                 # t_{p+1+j}
            x = torch.cat([rms_norm(F.embedding(tok, self.embed), self.enorm, eps),
                           rms_norm(feed, self.hnorm, eps)], dim=-1)
            feed, keys, values = self._layer(F.linear(x, self.fc), pos + j, keys, values)
            out.append(feed)
        return out


def _shift(x: torch.Tensor, j: int) -> torch.Tensor:
    """x[:, j:] padded with zeros at the end to x's length."""
    if j == 0:
        return x
    return torch.cat([x[:, j:], x.new_zeros(x.shape[0], j, *x.shape[2:])], dim=1)


def ttt_mask(n: int, steps: int, device: torch.device | str) -> torch.Tensor:
    """bool [n, steps*n]: causal over step-0 keys, then each later step's own diagonal."""
    idx = torch.arange(n, device=device)
    blocks = [idx[None, :] <= idx[:, None]] + [idx[None, :] == idx[:, None]] * (steps - 1)
    return torch.cat(blocks, dim=1)


class TrainableEagle3Head(TrainableMtpHead):
    """The eagle3 head with gradients: TrainableMtpHead plus ``fnorm`` [F, H] and ``fc3``
    [H, F*H] fusing the target's feature layers at step 0 (names as Eagle3Head's)."""

    def __init__(self, args: ModelArgs, embed: torch.Tensor, lm_head: torch.Tensor,
                 d2t: torch.Tensor, max_len: int,
                 feature_layers: tuple[int, ...]) -> None:
        super().__init__(args, embed, lm_head, d2t, max_len)
        n, h = len(feature_layers), args.hidden_size
        self.feature_layers = tuple(feature_layers)
        self.fc3, self.fnorm = _p(h, n * h), _p(n, h)

    def init_from_target(self, target: DecoderModel, seed: int) -> None:
        """As mtp_eagle's; fc3 starts as the highest feature layer (normed) plus noise."""
        super().init_from_target(target, seed)
        n, h = self.fnorm.shape
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed + 1)
            self.fc3.copy_(torch.randn(h, n * h, generator=gen) * 0.02)
            self.fc3[:, (n - 1) * h:] += torch.eye(h, device=self.fc3.device)
            self.fnorm.fill_(1.0)

    def step0_input(self, hidden: torch.Tensor) -> torch.Tensor:
        parts = hidden.unflatten(-1, tuple(self.fnorm.shape))
        normed = rms_norm(parts, self.fnorm, self.args.rms_norm_eps)
        return F.linear(normed.flatten(-2), self.fc3)
