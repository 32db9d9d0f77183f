"""Reading HF-format safetensors checkpoints into DecoderModel's fused, stacked parameters."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import safe_open

from ._decoder import DecoderModel
from ._errors import ModelLoadError, ModelNotFoundError

log = structlog.get_logger(__name__)

_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's shards, from model.safetensors.index.json when present."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [directory / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelNotFoundError(f"shards listed in {index} are missing: {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in directory.glob("*.bin"))
        hint = f" (found {bins}: convert them to safetensors)" if bins else ""
        raise ModelNotFoundError(f"no *.safetensors weights in {directory}{hint}")
    return files


def _targets(model: DecoderModel) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF tensor name, destination view) for every tensor the model needs."""
    a = model.args
    q, kv, inter = a.q_size, a.kv_size, a.intermediate_size
    yield "model.embed_tokens.weight", model.embed_tokens
    yield "model.norm.weight", model.norm
    if model.lm_head is not None:
        yield "lm_head.weight", model.lm_head
    for i in range(a.num_layers):
        pre = f"model.layers.{i}."
        yield pre + "input_layernorm.weight", model.attn_norm[i]
        yield pre + "post_attention_layernorm.weight", model.mlp_norm[i]
        for kind, dst in (("weight", model.wqkv), ("bias", model.bqkv)):
            if dst is None:
                continue
            yield pre + f"self_attn.q_proj.{kind}", dst[i, :q]
            yield pre + f"self_attn.k_proj.{kind}", dst[i, q : q + kv]
            yield pre + f"self_attn.v_proj.{kind}", dst[i, q + kv :]
        yield pre + "self_attn.o_proj.weight", model.wo[i]
        yield pre + "mlp.gate_proj.weight", model.w_gate_up[i, :inter]
        yield pre + "mlp.up_proj.weight", model.w_gate_up[i, inter:]
        yield pre + "mlp.down_proj.weight", model.w_down[i]


def load_safetensors_weights(model: DecoderModel, files: list[Path]) -> None:
    """Copy every needed tensor from ``files`` into ``model`` (casting to its dtype/device)."""
    with ExitStack() as stack:
        handles: dict[str, Any] = {}     # name -> its file's safe_open handle
        for f in files:
            h = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            handles.update((name, h) for name in h.keys())
        targets = dict(_targets(model))
        missing = sorted(set(targets) - set(handles), key=_natural_key)
        if missing:
            raise ModelLoadError(f"checkpoint {files[0].parent} lacks {len(missing)} tensors: {missing[:8]}")
        with torch.no_grad():
            for name, dst in targets.items():
                src = handles[name].get_tensor(name)
                if tuple(src.shape) != tuple(dst.shape):
                    raise ModelLoadError(f"{name}: shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
                dst.copy_(src)
        unused = sorted(set(handles) - set(targets))
        if unused:
            log.debug("checkpoint_tensors_unused", count=len(unused), first=unused[:4])


def _natural_key(name: str) -> tuple[int, str]:
    m = _LAYER_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else (-1, name)
