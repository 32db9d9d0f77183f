"""A draft tree's drafting (``MtpEagleDrafter.tree_from_root``) the three ways it runs:
the rank picks placed from the rows with children (the CPU's and LM-head TP's way: no LM
head row spent on a leaf), from every row of a depth (the GPU's: the head's output as it
is, no gather), and on CUDA through the fused top-k kernel that writes each pick straight
into its node's column (``_kernels.topk_map``'s ``dest``). All must draft the same tokens;
the trees have parents and rows with children that are runs (taken as views), one row
repeated, and neither (a gather)."""

from types import SimpleNamespace

import pytest
import torch

from specloop.models import load_model
from specloop.models.drafters._mtp import MtpEagleDrafter
from specloop.models.drafters._protocol import DrafterDeps
from specloop.models.testing import write_tiny_checkpoint
from specloop.samplers._tree import DraftTree

TREES = [
    [[0], [1], [0, 0], [0, 0, 0]],
    # The shipped 15-node tree's shape: depth 2's rows with children are 7, 8 and 10.
    [[0], [1], [2], [3], [4], [5], [0, 0], [0, 1], [0, 2], [1, 0], [2, 0], [0, 0, 0],
     [0, 0, 1], [0, 1, 0], [1, 0, 0]],
    [[0], [1], [2], [0, 0], [0, 3], [1, 0], [2, 1], [2, 2], [0, 0, 0], [2, 1, 4],
     [2, 2, 0], [2, 2, 1], [0, 0, 0, 0]],
]


def _drafter(device: str, dtype: torch.dtype, tmp_path) -> MtpEagleDrafter:
    loaded = load_model(write_tiny_checkpoint(tmp_path / "m", vocab_size=384),
                        dtype=dtype, device=device)
    spec = SimpleNamespace(num_draft_tokens=3, adaptive=False, draft_weights=None,
                           draft_dtype="auto", mtp_weights=None, method="mtp_eagle")
    config = SimpleNamespace(speculative=spec,
                             parallel=SimpleNamespace(lm_head_tp_in_adp=False))
    return MtpEagleDrafter(config, DrafterDeps(loaded, loaded.model.make_cache(4, 128), 4,
                                               128))


def _placed(drafter, root, seq_lens, slots, tree, *, whole_depth, fused=False):
    """``_tree_steps`` driven by hand: the picks returned by ``DraftHead.top`` and placed
    by the level (``_TreeLevel.place``)."""
    steps = drafter._tree_steps(root, seq_lens, slots, tree, None, whole_depth=whole_depth)
    ask = next(steps)
    try:
        while True:
            hidden, level, _ = ask
            ask = steps.send(drafter.lm.top(hidden, level.width, fused=fused))
    except StopIteration as done:
        return done.value


def _inputs(drafter, device):
    g = torch.Generator().manual_seed(0)
    H = drafter.head.block.args.hidden_size
    root = torch.randn(3, H, generator=g).to(device, drafter.dtype)
    return root, torch.tensor([9, 20, 33], device=device), torch.tensor([2, 0, 1],
                                                                         device=device)


@pytest.mark.parametrize("paths", TREES)
def test_whole_depths_draft_what_the_rows_with_children_draft(tmp_path, paths):
    drafter = _drafter("cpu", torch.float64, tmp_path)
    tree = DraftTree([tuple(p) for p in paths])
    root, seq_lens, slots = _inputs(drafter, "cpu")
    want = _placed(drafter, root, seq_lens, slots, tree, whole_depth=False)
    assert want.shape == (3, tree.size) and (want > 0).any()
    assert torch.equal(_placed(drafter, root, seq_lens, slots, tree, whole_depth=True), want)
    assert torch.equal(drafter.tree_from_root(root, seq_lens, slots, tree), want)
    # The first choices are the chain's: node (0,) * d is each depth's argmax.
    chain = drafter.tree_from_root(root, seq_lens, slots, DraftTree.chain(tree.depth))
    firsts = [tree.paths.index((0,) * d) for d in range(1, tree.depth + 1)]
    assert torch.equal(want[:, firsts], chain)


@pytest.mark.gpu
@pytest.mark.parametrize("paths", TREES)
def test_the_fused_tree_drafts_what_placing_the_fused_picks_drafts(tmp_path, paths):
    if not torch.cuda.is_available():
        pytest.skip("CUDA")
    drafter = _drafter("cuda", torch.bfloat16, tmp_path)
    assert drafter.head.block.uses_kernels
    tree = DraftTree([tuple(p) for p in paths])
    root, seq_lens, slots = _inputs(drafter, "cuda")
    want = _placed(drafter, root, seq_lens, slots, tree, whole_depth=False, fused=True)
    assert torch.equal(drafter.tree_from_root(root, seq_lens, slots, tree), want)
