"""Our decoder against transformers on the same tiny random checkpoints, fp32."""

import pytest
import torch

from specloop.models import load_model

# transformers' model classes cost ~5 s CPU to import: imported on first use (not at
# collection), and the module's tests run on one xdist worker, so only one pays it: the
# SmolLM2 tests' (tests/conftest.py), whose reference imports them too.
pytestmark = pytest.mark.xdist_group("smollm2")

FAMILIES = ["llama", "llama_untied", "qwen2", "llama3_rope"]


def _hf(directory):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _ref_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [T, V]


@pytest.mark.parametrize("family", FAMILIES)
def test_full_forward_matches(tiny_dirs, family):
    lm, hf = load_model(tiny_dirs[family]), _hf(tiny_dirs[family])
    ids = torch.randint(0, lm.args.vocab_size, (2, 37), generator=torch.Generator().manual_seed(0))
    cache = lm.model.make_cache(num_slots=3, max_seq_len=128)
    hidden = lm.model(ids, torch.tensor([0, 0]), torch.tensor([2, 0]), cache)
    ours = lm.model.logits(hidden)
    assert ours.dtype == torch.float32 and ours.shape == (2, 37, lm.args.vocab_size)
    for row in range(2):
        torch.testing.assert_close(ours[row], _ref_logits(hf, ids[row].tolist()), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_rows_at_different_positions_and_slots(tiny_dirs, family):
    """Rows prefilled to different lengths in different slots, then one batched step of T=3."""
    lm, hf = load_model(tiny_dirs[family]), _hf(tiny_dirs[family])
    model, V = lm.model, lm.args.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (5, 70, 1)]
    slots = [2, 0, 3]
    cache = model.make_cache(num_slots=4, max_seq_len=256)
    for prompt, slot in zip(prompts, slots):
        model(torch.tensor([prompt]), torch.tensor([0]), torch.tensor([slot]), cache)
    step = torch.randint(0, V, (3, 3), generator=gen)
    start = torch.tensor([len(p) for p in prompts])
    ours = model.logits(model(step, start, torch.tensor(slots), cache))  # [3, 3, V]
    for row, prompt in enumerate(prompts):
        ref = _ref_logits(hf, prompt + step[row].tolist())[len(prompt) :]
        torch.testing.assert_close(ours[row], ref, atol=1e-4, rtol=1e-4)


def test_early_exit_matches_truncated_transformers(tiny_dirs, tmp_path):
    """num_layers=N equals a checkpoint of the first N layers (plus the final norm and head)."""
    import json
    import shutil

    src = tiny_dirs["qwen2"]
    trunc = tmp_path / "trunc"
    shutil.copytree(src, trunc)
    config = json.loads((trunc / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (trunc / "config.json").write_text(json.dumps(config))
    hf = _hf(trunc)
    lm = load_model(src)
    ids = torch.randint(0, lm.args.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    cache = lm.model.make_cache(1, 64)
    ours = lm.model.logits(lm.model(ids, torch.tensor([0]), torch.tensor([0]), cache, num_layers=2))
    torch.testing.assert_close(ours[0], _ref_logits(hf, ids[0].tolist()), atol=1e-4, rtol=1e-4)
