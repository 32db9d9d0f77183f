"""specloop.models: reference Llama/Qwen2 decoder, paged KV cache, loading, tokenizer.

Public names load on first use (``specloop.samplers._lazy``), so that the CLI's config
checks (KNOWN_MODELS, ModelLoadError) import no torch; mypy reads the imports under
``TYPE_CHECKING``."""

from typing import TYPE_CHECKING

from specloop.samplers._lazy import lazy_exports

if TYPE_CHECKING:
    from ._args import ModelArgs, RopeScaling
    from ._cache import DEFAULT_PAGE_SIZE, CacheFullError, KVCache, PageTable
    from ._decoder import KV_LEN_MULTIPLE, DecoderModel, TreeMask
    from ._detokenizer import IncrementalDetokenizer
    from ._errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError
    from ._loading import LoadedModel, load_model, resolve_model_path
    from ._registry import (KNOWN_MODELS, KnownModel, cache_root, ensure_gguf_cached,
                            ensure_model_cached)
    from ._tokenizer import Tokenizer

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "KNOWN_MODELS",
    "CacheFullError",
    "KV_LEN_MULTIPLE",
    "DecoderModel",
    "IncrementalDetokenizer",
    "KVCache",
    "KnownModel",
    "LoadedModel",
    "ModelArgs",
    "ModelLoadError",
    "ModelNotFoundError",
    "PageTable",
    "RopeScaling",
    "Tokenizer",
    "TreeMask",
    "UnsupportedModelError",
    "cache_root",
    "ensure_gguf_cached",
    "ensure_model_cached",
    "load_model",
    "resolve_model_path",
]

if not TYPE_CHECKING:      # mypy reads the imports above: an unknown name stays an error
    __getattr__, __dir__ = lazy_exports(globals(), {
        "._args": ("ModelArgs", "RopeScaling"),
        "._cache": ("DEFAULT_PAGE_SIZE", "CacheFullError", "KVCache", "PageTable"),
        "._decoder": ("KV_LEN_MULTIPLE", "DecoderModel", "TreeMask"),
        "._detokenizer": ("IncrementalDetokenizer",),
        "._errors": ("ModelLoadError", "ModelNotFoundError", "UnsupportedModelError"),
        "._loading": ("LoadedModel", "load_model", "resolve_model_path"),
        "._registry": ("KNOWN_MODELS", "KnownModel", "cache_root", "ensure_gguf_cached",
                       "ensure_model_cached"),
        "._tokenizer": ("Tokenizer",),
    })
