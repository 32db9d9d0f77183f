"""EAGLE-3 drafting: the mtp_eagle loop on the target's low, middle and high layers.

The head reads, at step 0, the residual streams after three of the target's layers
(default: SpecForge's choice, layers 1, L/2 - 1 and L - 4, 0-based), each RMS-normed
(``fnorm``) and fused by one projection ``fc3`` [H, 3H] into the hidden state the
mtp_eagle input expects: ``fc([enorm(emb(t_{p+1})); hnorm(fc3(features_p))])``, one
decoder layer, the target's LM head (or a reduced draft vocabulary via ``d2t``). Steps
j >= 1 read the head's own output, as in mtp_eagle. The target exposes the features
through ``ModelRunner.feature_layers`` (the engine sets it from ``Eagle3Drafter``), so
VERIFY and prefill hand the drafter [rows, 3H] instead of the final hidden state; a target
run without this drafter captures nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from ._errors import DrafterConfigError
from ._mtp import MtpEagleDrafter
from ._mtp_head import MtpEagleHead, load_or_init
from ._protocol import DrafterDeps

if TYPE_CHECKING:
    from specloop.models import DecoderModel, KVCache, TreeMask


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle, high (0-based, increasing, distinct; fewer on very shallow targets)."""
    picks = (1, num_layers // 2 - 1, num_layers - 4)
    return tuple(sorted({min(max(i, 0), num_layers - 1) for i in picks}))


class Eagle3Head(MtpEagleHead):
    def __init__(self, target: DecoderModel, *, dtype: torch.dtype, device: torch.device | str,
                 feature_layers: tuple[int, ...]) -> None:
        super().__init__(target, dtype=dtype, device=device)
        h, n = target.args.hidden_size, len(feature_layers)
        if not 2 <= n or list(feature_layers) != sorted(set(feature_layers)) or \
                feature_layers[-1] >= target.args.num_layers:
            raise DrafterConfigError(
                "speculative.method", "eagle3", f"feature layers {feature_layers} must be "
                f">= 2 distinct increasing layers of the target's {target.args.num_layers}",
                "use a target with at least 2 layers, or the head trained for it")
        self.feature_layers = tuple(feature_layers)
        self.fc3 = torch.nn.Parameter(torch.empty(h, n * h, dtype=dtype, device=device),
                                      requires_grad=False)
        self.fnorm = torch.nn.Parameter(torch.ones(n, h, dtype=dtype, device=device),
                                        requires_grad=False)

    @property
    def feature_size(self) -> int:
        return int(self.fc3.shape[1])


    def save(self, path: str, metadata: dict[str, str] | None = None) -> None:
        meta = {"feature_layers": ",".join(map(str, self.feature_layers)), **(metadata or {})}
        super().save(path, meta)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """[..., F*H] target features -> [..., H] (in the head's dtype)."""
        parts = features.to(self.dtype).unflatten(-1, tuple(self.fnorm.shape))  # [..., F, H]
        # Each part normed with its own weight row (fused: one kernel, weight row r % F
        # for row r, as rms_norm does: normalise in fp32, cast, multiply).
        normed = self.norm(parts, self.fnorm)
        return self.block.linear(normed.flatten(-2), self.fc3)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, start_pos: torch.Tensor,
                slots: torch.Tensor, cache: KVCache, kv_len: int | None = None,
                pos_offset: int = 0, tree: TreeMask | None = None,
                last: torch.Tensor | None = None, hidden_rows: torch.Tensor | None = None
                ) -> torch.Tensor:
        # Target rows carry F*H features (F >= 2); the head's own outputs (steps >= 1), H.
        if hidden.shape[-1] != self.block.args.hidden_size:
            if hidden_rows is not None:     # (the tree's parents are the head's own rows)
                hidden, hidden_rows = hidden.index_select(1, hidden_rows), None
            hidden = self.project(hidden)
        return super().forward(tokens, hidden, start_pos, slots, cache, kv_len=kv_len,
                               pos_offset=pos_offset, tree=tree, last=last,
                               hidden_rows=hidden_rows)


def file_feature_layers(path: str | Path) -> tuple[int, ...] | None:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    text = meta.get("feature_layers")
    return tuple(int(x) for x in text.split(",")) if text else None


class Eagle3Drafter(MtpEagleDrafter):
    """MtpEagleDrafter whose head reads the target's feature layers (``feature_layers``,
    read by the engine to make the target capture them)."""

    head: Eagle3Head

    def _make_head(self, config: Any, deps: DrafterDeps) -> Eagle3Head:
        target = deps.target.model
        path = self.weights_path(config, deps)
        layers = (file_feature_layers(path) if path is not None else None) or \
            default_feature_layers(target.args.num_layers)
        return load_or_init(Eagle3Head(target, dtype=self.dtype, device=target.device,
                                       feature_layers=layers), path)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.feature_layers
