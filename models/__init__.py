"""specloop.models: reference Llama/Qwen2 decoder, paged KV cache, loading, tokenizer."""

from ._args import ModelArgs, RopeScaling
from ._cache import DEFAULT_PAGE_SIZE, CacheFullError, KVCache, PageTable
from ._decoder import KV_LEN_MULTIPLE, DecoderModel
from ._detokenizer import IncrementalDetokenizer
from ._errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError
from ._loading import LoadedModel, load_model, resolve_model_path
from ._registry import KNOWN_MODELS, KnownModel, cache_root, ensure_gguf_cached, ensure_model_cached
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
    "UnsupportedModelError",
    "cache_root",
    "ensure_gguf_cached",
    "ensure_model_cached",
    "load_model",
    "resolve_model_path",
]
