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

