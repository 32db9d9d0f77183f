"""Shipped draft heads: found by registry name, checked against their card's sha256 and
against the target's shape (a head for another target is refused, naming both shapes)."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from specloop.engine import AsyncEngine, ConfigError, EngineConfig
from specloop.models import load_model
from specloop.models.drafters import MtpEagleHead
from specloop.models.drafters._heads import file_sha256, head_metadata, heads_dir, shipped_heads
from specloop.models.testing import write_tiny_checkpoint


@pytest.fixture(scope="module")
def two_targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    a = write_tiny_checkpoint(root / "a", vocab_size=384, num_layers=2, hidden=64, seed=1)
    b = write_tiny_checkpoint(root / "b", vocab_size=384, num_layers=3, hidden=32,
                              num_heads=2, num_kv_heads=1, intermediate=64, seed=2)
    return a, b


def _config(model_dir, weights, method="mtp_eagle"):
    return EngineConfig.from_dict({
        "model": {"name": str(model_dir), "device": "cpu", "max_seq_len": 64,
                  "chat_template": False},
        "speculative": {"method": method, "num_draft_tokens": 2,
                        "draft_weights": str(weights)}})


async def _build(model_dir, weights, method="mtp_eagle"):
    async with AsyncEngine(_config(model_dir, weights, method)) as engine:
        return engine.worker.drafter


def _random_head(method, model_dir, path):
    from specloop.models.drafters import Eagle3Head

    target = load_model(model_dir).model
    if method == "eagle3":
        head = Eagle3Head(target, dtype=torch.float32, device="cpu", feature_layers=(0, 1))
    else:
        head = MtpEagleHead(target, dtype=torch.float32, device="cpu")
    head.init_random()
    head.save(str(path), {"method": method})
    return path


@pytest.mark.parametrize("method", ["mtp_eagle", "eagle3"])
async def test_head_for_another_target_is_refused_naming_both_shapes(two_targets, tmp_path,
                                                                     method):
    a, b = two_targets
    path = _random_head(method, a, tmp_path / "for-a.safetensors")
    assert (await _build(a, path, method)).head.d2t is None     # its own target loads it
    with pytest.raises(ConfigError) as err:
        await _build(b, path, method)
    msg = str(err.value)
    assert "speculative.draft_weights" in msg
    assert "hidden_size=64, vocab_size=384, num_layers=2" in msg      # the head's target
    assert "hidden_size=32, vocab_size=384, num_layers=3" in msg      # this target


async def test_sha256_mismatch_with_the_card_is_refused(two_targets, tmp_path):
    a, _ = two_targets
    head = MtpEagleHead(load_model(a).model, dtype=torch.float32, device="cpu")
    head.init_random()
    path = tmp_path / "h.safetensors"
    head.save(str(path))
    (tmp_path / "h.json").write_text(json.dumps({"sha256": file_sha256(path)}))
    await _build(a, path)                                  # card and file agree
    data = bytearray(path.read_bytes())
    data[-1] ^= 1                                          # one bit of the last weight
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="sha256"):
        await _build(a, path)


async def test_unknown_head_name_lists_the_shipped_ones(two_targets):
    with pytest.raises(ConfigError, match="shipped heads: .*smollm2-135m-instruct-eagle"):
        await _build(two_targets[0], "no-such-head")


def test_shipped_heads_match_their_cards():
    assert {"smollm2-135m-instruct-eagle3", "smollm2-135m-instruct-eagle"} <= set(shipped_heads())
    for name in shipped_heads():
        path = heads_dir() / f"{name}.safetensors"
        card = json.loads(path.with_suffix(".json").read_text())
        assert card["sha256"] == file_sha256(path), name
        assert card["target"]["hidden_size"] > 0 and card["command"].startswith("specloop")
        assert path.stat().st_size < 16 * 2**20          # a head, not a model
        assert card["method"] == head_metadata(path)["method"]


@pytest.mark.parametrize("name", ["smollm2-135m-instruct-eagle3", "smollm2-135m-instruct-eagle"])
def test_shipped_head_holds_only_its_own_bf16_weights(name):
    """No target embedding or LM head in the file (the drafter reads the target's rows
    through d2t): no tensor has a vocabulary-sized dimension, every float is bf16, and d2t
    maps the draft vocabulary to distinct target ids."""
    path = heads_dir() / f"{name}.safetensors"
    meta = head_metadata(path)
    vocab = int(meta["target_vocab_size"])
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for key, t in tensors.items():
        assert vocab not in t.shape, key
        assert t.dtype == (torch.int64 if key == "d2t" else torch.bfloat16), key
    d2t = tensors["d2t"]
    assert d2t.numel() == int(meta["draft_vocab_size"]) < vocab
    assert d2t.unique().numel() == d2t.numel() and 0 <= int(d2t.min()) <= int(d2t.max()) < vocab


async def test_eagle3_head_read_as_mtp_eagle_is_refused(two_targets, tmp_path):
    from specloop.models.drafters import Eagle3Head

    a, _ = two_targets
    head = Eagle3Head(load_model(a).model, dtype=torch.float32, device="cpu",
                      feature_layers=(0, 1))
    head.init_random()
    path = tmp_path / "e3.safetensors"
    head.save(str(path), {"method": "eagle3"})
    with pytest.raises(ConfigError, match="trained for speculative.method = 'eagle3'"):
        await _build(a, path)                              # _config asks for mtp_eagle
