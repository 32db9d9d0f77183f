"""ModelArgs: the decoder's hyperparameters, parsed from an HF ``config.json`` dict."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ._errors import UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
_ROPE_TYPES = ("default", "llama3")


@attrs.frozen(kw_only=True)
class RopeScaling:
    """llama3-style frequency scaling (the only scaling supported)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@attrs.frozen(kw_only=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        """Parse a Llama- or Qwen2-family ``config.json``; raise UnsupportedModelError otherwise."""
        _check_supported(config)
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        theta, scaling = _parse_rope(config)
        return cls(
            model_type=config["model_type"],
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(config),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(config.get("eos_token_id")),
        )


def _check_supported(config: Mapping[str, Any]) -> None:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = config.get("architectures")
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r} (architectures {archs}); "
            f"specloop's decoder supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU)")
    if config.get("use_sliding_window"):
        raise UnsupportedModelError("use_sliding_window=true is not supported; full attention only")
    if config.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported")


def _attention_bias(config: Mapping[str, Any]) -> bool:
    # Qwen2 always has q/k/v biases (its config has no flag); Llama reads attention_bias.
    if config["model_type"] == "qwen2":
        return True
    return bool(config.get("attention_bias", False))


def _parse_rope(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes "rope_parameters"; older configs write rope_theta + rope_scaling.
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(config.get("rope_theta", params.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope scaling {rope_type!r}; supported: {', '.join(_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise UnsupportedModelError(f"llama3 rope scaling is missing {exc.args[0]!r}") from None
    return theta, scaling


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)

