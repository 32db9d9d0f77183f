"""The trainable head computes what the drafter's head computes (TTT unroll == drafting)."""

import pytest
import torch

from specloop.models import load_model
from specloop.models.drafters import MtpEagleHead
from specloop.models.testing import write_tiny_checkpoint
from specloop.train import TrainableMtpHead, ttt_mask


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("t") / "m", vocab_size=384,
                                 num_layers=2, hidden=64, seed=3)
    return load_model(path, dtype=torch.float64)


def _pair(tiny, tmp_path):
    model = tiny.model
    d2t = torch.arange(0, 384, 3)
    train = TrainableMtpHead(tiny.args, model.embed_tokens, model.lm_head_weight, d2t, 64)
    train.init_from_target(model, seed=5)
    with torch.no_grad():                      # break the identity init's symmetry
        for p in train.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    train = train.double()
    head = MtpEagleHead(model, dtype=torch.float64, device="cpu")
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in train.export_state().items()},
              str(tmp_path / "h.safetensors"))
    head.load(str(tmp_path / "h.safetensors"))
    assert torch.equal(head.d2t, d2t)
    return train, head


def test_ttt_mask_shape():
    m = ttt_mask(3, 2, "cpu")
    assert m.tolist() == [[1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1]]


def test_unrolled_steps_equal_chained_drafting(tiny, tmp_path):
    train, head = _pair(tiny, tmp_path)
    model = tiny.model
    T, steps = 12, 3
    tokens = torch.randint(0, 384, (1, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model(tokens, torch.tensor([0]), torch.tensor([0]), model.make_cache(1, 64))
        unrolled = train.unroll(tokens, hidden, steps)
        for p in (0, 4, 7):
            cache = head.block.make_cache(1, 64)
            # Catch-up: rows 0..p with the target's hidden states, as drafting sees them.
            g = head(tokens[:, 1:p + 2], hidden[:, :p + 1], torch.tensor([0]),
                     torch.tensor([0]), cache)[:, -1]
            for j in range(steps):
                if j:
                    g = head(tokens[:, p + 1 + j:p + 2 + j], g[:, None], torch.tensor([p + j]),
                             torch.tensor([0]), cache)[:, 0]
                want = torch.nn.functional.linear(g, model.lm_head_weight[train.d2t])
                torch.testing.assert_close(unrolled[j][0, p], want[0], rtol=1e-6, atol=1e-6)
