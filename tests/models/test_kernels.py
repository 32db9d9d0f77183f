"""The fused Triton layer equals the reference layer (Triton's interpreter on CPU, float32).

The interpreter must be chosen before Triton is first imported, so the comparison runs in
a child process. Skipped without Triton; the same comparison runs on CUDA in bf16 in
tests/models/test_gpu.py.
"""

import pytest

from ..interpreted import run_interpreted

pytest.importorskip("triton")

CHILD = r"""
import random, sys, torch
from specloop.models import PageTable, load_model

model = load_model(sys.argv[1]).model
V = model.args.vocab_size
for T in (1, 5, 9):  # decode, VERIFY with K=4, a prefill chunk
    out = {}
    for fused in (False, True):
        model.kernels = fused
        rng = random.Random(T)
        pages = PageTable(3, 64, 4)
        cache = model.make_cache(3, 64, pages=pages)
        # Ragged rows, some crossing a page boundary, each writing T new tokens. Starts
        # below 12 (were below 20: [4, 18, 2], [19, 8, 11], [14, 19, 11]; now [2, 9, 1],
        # [9, 4, 11], [7, 9, 5]): every T = 5 and 9 row still crosses a page of 4, every
        # row's keys still fit one attention tile (as before), about half the prefill.
        starts = [rng.randrange(0, 12) for _ in range(3)]
        for slot, start in enumerate(starts):
            pages.resize(slot, start + T)
            if start:
                ids = torch.tensor([[rng.randrange(V) for _ in range(start)]])
                model(ids, torch.tensor([0]), torch.tensor([slot]), cache)
        tokens = torch.tensor([[rng.randrange(V) for _ in range(T)] for _ in starts])
        out[fused] = model.logits(model(tokens, torch.tensor(starts), torch.tensor([0, 1, 2]),
                                        cache))
    torch.testing.assert_close(out[True], out[False], rtol=1e-4, atol=1e-4)
    assert not torch.equal(out[True][0], out[True][1])
# A row whose last positions lie past max_seq_len (a padding row near the end): their K/V
# go to the scratch page, not over the row's own last page (positions 28..31 here).
# max_seq_len 32 (was 64: a 60-token prefill, each token's programs slow to interpret): the
# 8 positions from 28 still end 4 past the slot's last page, as 60..67 did past 64.
out = {}
for fused in (False, True):
    model.kernels = fused
    pages = PageTable(2, 32, 4)
    cache = model.make_cache(2, 32, pages=pages)
    pages.resize(1, 32)
    model(torch.arange(28)[None] % V, torch.tensor([0]), torch.tensor([1]), cache)
    out[fused] = model.logits(model(torch.arange(8)[None] % V, torch.tensor([28]),
                                    torch.tensor([1]), cache, kv_len=32))[0, :4]
torch.testing.assert_close(out[True], out[False], rtol=1e-4, atol=1e-4)
print("ok")
"""


@pytest.mark.xdist_group("interpreted")   # one interpreter server (tests/interpreted.py)
@pytest.mark.slow
def test_fused_layer_equals_reference(tiny_dirs):
    run_interpreted(CHILD, str(tiny_dirs["llama"]))


TREE_CHILD = r"""
import random, sys, torch
from specloop.models import PageTable, TreeMask, load_model
from specloop.samplers._tree import DraftTree

model = load_model(sys.argv[1]).model
V = model.args.vocab_size
tree = DraftTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
depths, visible = torch.tensor(tree.depths), tree.visible()
# VERIFY's form (the whole tree, W = T), and one depth's rows of a head's forward (rows 4..6
# of the tree, rows 1..3 stored before them: W = 6, T = 3, RoPE at the rows' depth).
cases = [(TreeMask(depths, visible), 8),
         (TreeMask(torch.full((3,), 2 - 4), visible[4:7, 1:7]), 3)]
for mask, T in cases:
    out = {}
    for fused in (False, True):
        model.kernels = fused
        rng = random.Random(T)
        pages = PageTable(2, 64, 4)
        cache = model.make_cache(2, 64, pages=pages)
        starts = [7, 13]        # the tree's rows cross pages of 4 in both rows
        for slot, start in enumerate(starts):
            pages.resize(slot, start + T)
            ids = torch.tensor([[rng.randrange(V) for _ in range(start)]])
            model(ids, torch.tensor([0]), torch.tensor([slot]), cache)
        tokens = torch.tensor([[rng.randrange(V) for _ in range(T)] for _ in starts])
        out[fused] = model.logits(model(tokens, torch.tensor(starts), torch.tensor([0, 1]),
                                        cache, tree=mask))
    torch.testing.assert_close(out[True], out[False], rtol=1e-4, atol=1e-4)
    # The mask matters: the causal forward of the same rows gives other logits.
    model.kernels = True
    causal = model.logits(model(tokens, torch.tensor(starts), torch.tensor([0, 1]), cache))
    assert not torch.allclose(causal, out[True], rtol=1e-3, atol=1e-3)
# Split-KV with a tree: the rows' ranges cut into splits (some seeing none of a split's
# tree rows) add up to the one kernel's output.
from specloop.models import _kernels
gen = torch.Generator().manual_seed(1)
mask = cases[0][0]
q = torch.randn(2, 8, 4, 16, generator=gen)
k = torch.randn(33, 4, 2, 16, generator=gen)
v = torch.randn(33, 4, 2, 16, generator=gen)
table = torch.randperm(32, generator=gen).int().view(2, 16)
args = (q, k, v, table, torch.tensor([1, 0]), torch.tensor([19, 37]))
one = _kernels.paged_attention(*args, splits=1, block_n=16, tree_bits=mask.bits)
for combine in ("kernel", "last"):
    split = _kernels.paged_attention(*args, splits=4, block_n=16, split_min=8,
                                     combine=combine, tree_bits=mask.bits)
    torch.testing.assert_close(split, one, rtol=1e-5, atol=1e-5)
print("ok")
"""


@pytest.mark.xdist_group("interpreted")   # one interpreter server (tests/interpreted.py)
@pytest.mark.slow
def test_fused_tree_forward_equals_reference(tiny_dirs):
    """A draft tree through the fused kernels (RoPE at each row's depth, the attention's
    visibility words) equals the reference path's tree forward (interpreted, float32)."""
    run_interpreted(TREE_CHILD, str(tiny_dirs["llama"]))
