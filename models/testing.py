"""Test helpers: tiny random-weight HF-format checkpoints that load in milliseconds."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and the "
    "target verifies them. A llama is a domesticated South American camelid. "
    "def main():\n    print('hello, world')\n    return 0\n"
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Ünïcödé: café, naïve, 日本語, emoji 🦙.\n"
)


def tiny_tokenizer(vocab_size: int) -> HFTokenizer:
    """A byte-level BPE with exactly ``vocab_size`` tokens (specials 0..2, reserved fillers last)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing < 0:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level vocabulary (>= 300)")
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    return tok


def _config(family: str, *, vocab_size: int, hidden: int, num_layers: int, num_heads: int,
            num_kv_heads: int, intermediate: int, tie: bool, max_pos: int) -> dict[str, Any]:
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    config = {
        "architectures": [arch],
        "model_type": family,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden // num_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": max_pos,
        "tie_word_embeddings": tie,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    if family == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
    return config


def _weights(config: dict[str, Any], *, seed: int) -> dict[str, torch.Tensor]:
    # Embeddings with std 0.4 give logits of std ~0.4*sqrt(H) (~3 at H=64): peaked but
    # far from one-hot, so temperature-1 sampling has moderate entropy.
    g = torch.Generator().manual_seed(seed)
    H, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    D = H // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * D, config["num_key_value_heads"] * D

    def rand(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + rand(H, std=0.1)

    w = {"model.embed_tokens.weight": rand(V, H, std=0.4), "model.norm.weight": norm_weight()}
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = rand(V, H, std=0.4)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight()
        w[p + "post_attention_layernorm.weight"] = norm_weight()
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            w[p + f"self_attn.{name}_proj.weight"] = rand(rows, H, std=1.5 / math.sqrt(H))
            if config["model_type"] == "qwen2":
                w[p + f"self_attn.{name}_proj.bias"] = rand(rows, std=0.1)
        w[p + "self_attn.o_proj.weight"] = rand(H, q, std=1 / math.sqrt(q))
        w[p + "mlp.gate_proj.weight"] = rand(I, H, std=1 / math.sqrt(H))
        w[p + "mlp.up_proj.weight"] = rand(I, H, std=1 / math.sqrt(H))
        w[p + "mlp.down_proj.weight"] = rand(H, I, std=1 / math.sqrt(I))
    return {k: v.contiguous() for k, v in w.items()}


def write_tiny_checkpoint(
    directory: str | Path,
    *,
    vocab_size: int = 512,
    num_layers: int = 2,
    hidden: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate: int = 128,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    family: str = "llama",
    tie: bool = True,
) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json."""
    if family not in ("llama", "qwen2"):
        raise ValueError(f"family must be 'llama' or 'qwen2', not {family!r}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(family, vocab_size=vocab_size, hidden=hidden, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate=intermediate,
                     tie=tie, max_pos=max_position_embeddings)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(_weights(config, seed=seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    tiny_tokenizer(vocab_size).save(str(out / "tokenizer.json"))
    tok_config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_position_embeddings,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return out
