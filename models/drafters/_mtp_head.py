"""The MTP-Eagle head: one decoder layer fed by the target's hidden state and next token.

The head fuses the target's hidden state at position p with the embedding of token p+1
(``fc([enorm(emb(t_{p+1})); hnorm(h_p)])``), runs one decoder layer with its own KV cache
and the target's LM head (shared, as the embedding); its output at p predicts token p+2.
The drafter that runs it is ``MtpEagleDrafter`` (_mtp.py); ``Eagle3Head`` (_eagle3.py)
reads the target's feature layers instead of its final hidden state.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import attrs
import torch
from safetensors.torch import load_file, save_file

from ._heads import target_shape

if TYPE_CHECKING:
    from specloop.models import DecoderModel, KVCache, TreeMask

HeadT = TypeVar("HeadT", bound="MtpEagleHead")


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
    def dtype(self) -> torch.dtype:
        """What the head computes in (``speculative.draft_dtype``); the embedding it shares
        with the target, and the target rows it reads, may be wider."""
        return self.fc.dtype

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
                pos_offset: int = 0, tree: TreeMask | None = None,
                last: torch.Tensor | None = None, hidden_rows: torch.Tensor | None = None
                ) -> torch.Tensor:
        """tokens [B, T] (t_{p+1}), hidden [B, T, H] (h_p) at positions start_pos +
        pos_offset.. -> the head's hidden [B, T, H]; logits come from the shared LM head.
        ``tree``: the rows are draft-tree nodes (models/_decoder.py ``TreeMask``).
        ``last`` [B]: row last[b]'s output alone, [B, H] (``forward_embeds``'s).
        ``hidden_rows`` [T] i64: hidden is [B, S, H] and row t reads its row
        hidden_rows[t] (a draft tree's parents; the prologue kernel reads them, no
        gather)."""
        if self.block.uses_kernels:
            # Embedding gather, both norms and the concat in one kernel (the same bits as
            # a norm kernel each: a draft step is launch-bound on the GPU).
            from specloop.models import _kernels  # noqa: PLC0415
            x = _kernels.eagle_prologue(tokens, self.block.embed_tokens, hidden, self.enorm,
                                        self.hnorm, self.block.args.rms_norm_eps,
                                        rows=hidden_rows)
        else:
            if hidden_rows is not None:
                hidden = hidden.index_select(1, hidden_rows)
            x = torch.cat([self.norm(self.block.embed(tokens).to(self.dtype), self.enorm),
                           self.norm(hidden.to(self.dtype), self.hnorm)], dim=-1)
        return self.block.forward_embeds(self.block.linear(x, self.fc), start_pos, slots, cache,
                                         kv_len=kv_len, pos_offset=pos_offset, tree=tree,
                                         last=last)


def load_or_init(head: HeadT, path: str | Path | None) -> HeadT:
    """The head with its trained weights from ``path``, or random ones (tests, training)
    when there is none."""
    if path is not None:
        head.load(str(path))
    else:
        head.init_random()
    return head


