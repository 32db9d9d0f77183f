"""One-time GGUF -> HF safetensors conversion through transformers, safe under concurrency.

The result appears atomically: it is built in a temporary sibling directory, marked
complete, then renamed into place while holding an exclusive file lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from ._errors import ModelLoadError

# torch loads only when a conversion runs: the registry (and so the CLI's config errors)
# imports this module.
if TYPE_CHECKING:
    import torch

log = structlog.get_logger(__name__)

COMPLETE_MARKER = "specloop-converted.json"
_GGUF_EXTRA = "pip install 'specloop[gguf]' (transformers, gguf, accelerate)"


def is_converted(directory: Path) -> bool:
    return (directory / COMPLETE_MARKER).is_file()


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created if needed), held for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def convert_gguf_once(gguf_path: Path, out_dir: Path, *,
                      dtype: torch.dtype | None = None) -> Path:
    """Convert ``gguf_path`` into ``out_dir`` unless already done (as ``dtype``, float32 by
    default); returns ``out_dir``."""
    if is_converted(out_dir):
        return out_dir
    with file_lock(out_dir.with_name(out_dir.name + ".lock")):
        if is_converted(out_dir):  # another process finished while we waited
            return out_dir
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            _convert_into(gguf_path, tmp, dtype)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private
            if out_dir.exists():  # a leftover from an interrupted run without the marker
                shutil.rmtree(out_dir)
            os.rename(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _convert_into(gguf_path: Path, out: Path, dtype: torch.dtype | None) -> None:
    import torch

    dtype = torch.float32 if dtype is None else dtype
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelLoadError(f"converting a GGUF file needs transformers: {_GGUF_EXTRA}") from exc
    start = time.perf_counter()
    bound = log.bind(gguf=str(gguf_path), out=str(out))
    bound.info("gguf_conversion_started")
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except ImportError as exc:
        raise ModelLoadError(f"reading GGUF failed ({exc}); {_GGUF_EXTRA}") from exc
    # transformers refuses to save a GGUF-loaded model: rebuild a plain one and save that.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=dtype)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _clean_config(out / "config.json")
    marker = {"source": str(gguf_path), "dtype": str(dtype), "seconds": round(time.perf_counter() - start, 1)}
    (out / COMPLETE_MARKER).write_text(json.dumps(marker, indent=1))
    bound.info("gguf_conversion_finished", seconds=marker["seconds"])


def _clean_config(path: Path) -> None:
    # A leftover quantization_config would make transformers treat the directory as GGUF.
    config = json.loads(path.read_text())
    config.pop("quantization_config", None)
    path.write_text(json.dumps(config, indent=2))
