"""Trained draft heads shipped with specloop: registry names, model cards, checks on load.

A head is ``heads/<name>.safetensors`` (only the head's own weights; the target's
embedding and LM head are shared) beside its model card ``heads/<name>.json``. The
safetensors metadata names the target shape it was trained for; loading refuses a head
whose sha256 differs from its card's or whose target shape differs from the target's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open

from .._args import ModelArgs
from .._registry import sha256_of as file_sha256
from ._errors import DrafterConfigError

FIELD = "speculative.draft_weights"
# The target facts a head depends on; stored as safetensors metadata "target_<name>".
TARGET_KEYS = ("hidden_size", "vocab_size", "num_layers")


def heads_dir() -> Path:
    return Path(__file__).parent / "heads"


def shipped_heads() -> list[str]:
    """Registry names of the heads that ship with the package."""
    return sorted(p.stem for p in heads_dir().glob("*.safetensors"))


def card_path(weights: Path) -> Path:
    return weights.with_suffix(".json")


def resolve_head(name_or_path: str) -> tuple[Path, dict[str, Any] | None]:
    """(weights file, its model card or None) for a registry name or a file path."""
    shipped = heads_dir() / f"{name_or_path}.safetensors"
    path = shipped if shipped.is_file() else Path(name_or_path).expanduser()
    if not path.is_file():
        raise DrafterConfigError(FIELD, name_or_path, "neither a shipped head nor a file",
                                 f"shipped heads: {', '.join(shipped_heads()) or 'none'}; "
                                 "or the path of a .safetensors head")
    card = card_path(path)
    return path, (json.loads(card.read_text()) if card.is_file() else None)


def check_sha256(path: Path, card: dict[str, Any] | None) -> None:
    if card is None or "sha256" not in card:
        return
    actual = file_sha256(path)
    if actual != card["sha256"]:
        raise DrafterConfigError(FIELD, str(path), f"sha256 {actual} differs from its model "
                                 f"card's {card['sha256']} (corrupted or replaced file)",
                                 "reinstall specloop or retrain the head (specloop train-draft)")


def head_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def target_shape(args: ModelArgs) -> dict[str, int]:
    return {key: int(getattr(args, key)) for key in TARGET_KEYS}


def check_target(path: Path, meta: dict[str, str], args: ModelArgs) -> None:
    """Refuse a head trained for a target of another shape, naming both shapes."""
    have = target_shape(args)
    want = {k: int(meta[f"target_{k}"]) for k in TARGET_KEYS if f"target_{k}" in meta}
    if want and want != {k: have[k] for k in want}:
        def fmt(d: dict[str, int]) -> str:
            return ", ".join(f"{k}={v}" for k, v in d.items())
        raise DrafterConfigError(
            FIELD, str(path), f"this head was trained for a target with {fmt(want)}, but "
            f"the target model has {fmt(have)}",
            "use a head trained for this target (train one with `specloop train-draft`)")


def check_method(path: Path, meta: dict[str, str], method: str) -> None:
    """Refuse a head trained for another drafter (an eagle3 head read as mtp_eagle would
    ignore its feature projection and draft garbage)."""
    trained = meta.get("method")
    if trained and trained != method:
        raise DrafterConfigError(
            FIELD, str(path), f"this head was trained for speculative.method = {trained!r}, "
            f"not {method!r}", f"set speculative.method = {trained!r}")
