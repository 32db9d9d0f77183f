"""load_model: a registry name, a .gguf file or an HF-format directory -> LoadedModel."""

from __future__ import annotations

import json
import time
from pathlib import Path

import attrs
import structlog
import torch

from ._args import ModelArgs
from ._decoder import DecoderModel
from ._errors import ModelNotFoundError
from ._registry import KNOWN_MODELS, ensure_gguf_cached, ensure_model_cached
from ._tokenizer import Tokenizer
from ._weights import load_safetensors_weights, safetensors_files

log = structlog.get_logger(__name__)


@attrs.frozen
class LoadedModel:
    model: DecoderModel
    tokenizer: Tokenizer
    args: ModelArgs
    path: Path | None = None  # the HF-format directory it was read from


def resolve_model_path(name_or_path: str | Path) -> Path:
    """The HF-format directory for a registry name, a .gguf file or a directory."""
    if isinstance(name_or_path, str) and name_or_path in KNOWN_MODELS:
        return ensure_model_cached(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ensure_gguf_cached(path)
    if path.is_dir():
        return path
    raise ModelNotFoundError(
        f"{str(name_or_path)!r} is neither a registry name ({', '.join(KNOWN_MODELS)}), "
        "a .gguf file nor a checkpoint directory"
    )


def read_model_args(directory: Path) -> ModelArgs:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"{path} not found: not an HF-format checkpoint directory")
    return ModelArgs.from_hf_config(json.loads(path.read_text()))


def load_model(
    name_or_path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> LoadedModel:
    """Load weights (our safetensors reader) and tokenizer; GGUF is converted once and cached."""
    start = time.perf_counter()
    directory = resolve_model_path(name_or_path)
    args, tokenizer = load_tokenizer(directory)
    files = safetensors_files(directory)
    model = DecoderModel(args, dtype=dtype, device=device)
    load_safetensors_weights(model, files)
    model.eval()
    log.info(
        "model_loaded",
        path=str(directory),
        dtype=str(dtype),
        device=str(device),
        layers=args.num_layers,
        seconds=round(time.perf_counter() - start, 3),
    )
    return LoadedModel(model, tokenizer, args, directory)


def load_tokenizer(directory: Path) -> tuple[ModelArgs, Tokenizer]:
    """A checkpoint directory's args and tokenizer, without its weights (a process that
    tokenizes for a model another process runs: ``ProcessEngine``)."""
    args = read_model_args(directory)
    return args, Tokenizer.from_dir(directory, extra_eos_token_ids=_eos_ids(directory, args))


def _eos_ids(directory: Path, args: ModelArgs) -> tuple[int, ...]:
    gen = directory / "generation_config.json"
    extra: tuple[int, ...] = ()
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        extra = (value,) if isinstance(value, int) else tuple(value or ())
    return args.eos_token_ids + extra
