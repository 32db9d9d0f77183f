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


TREE_VERIFY_CHILD = r"""
import random, torch
from specloop.models import _kernels, KVCache, PageTable
from specloop.models._args import ModelArgs
from specloop.samplers._tree import DraftTree, TreeTables, accept_tree
from specloop.samplers._triton_greedy import tree_greedy_verify

gen = torch.Generator().manual_seed(0)
rng = random.Random(0)
trees = [DraftTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]),
         DraftTree.chain(3), DraftTree([(0,), (1,)]),
         # 31 nodes of depth 4 (32 rows, paths of 5): the engine examples' largest
         DraftTree([(a,) for a in range(9)] + [(0, b) for b in range(6)] + [(1, 0), (1, 1),
                   (2, 0), (3, 0), (4, 0)] + [(0, 0, c) for c in range(4)] + [(0, 1, 0),
                   (1, 0, 0), (0, 2, 0)] + [(0, 0, 0, 0), (0, 0, 1, 0), (0, 1, 0, 0)])]
for tree in trees:
    tables = TreeTables.of(tree, "cpu")
    B, R, V = 5, tree.size + 1, 300
    # Tokens from a vocabulary of 4 on the tree's rows, the argmax planted among them:
    # matches, misses and sibling repeats all occur.
    tokens = torch.randint(0, 4, (B, R), generator=gen)
    logits = torch.randn(B, R, V, generator=gen)
    best = torch.randint(0, 4, (B, R), generator=gen)
    logits.scatter_(2, best[..., None], 10.0)
    want = accept_tree(tables, tokens, logits.argmax(-1))
    for walk in ("store", "registers"):     # the parents' targets through memory, or not
        packed, path = tree_greedy_verify(tokens, logits, tables.parents, tables.ancestors,
                                          tables.depths, chunk=128, block=64, walk=walk)
        assert torch.equal(packed[:, :-1], want.token_ids), (tree, walk, packed)
        assert torch.equal(packed[:, -1], want.num_accepted)
        assert torch.equal(path, want.path)
    assert want.num_accepted.max() > 0
# The path move: the kernel's cache equals KVCache.keep_path's (every layer, pages of 4,
# rows crossing pages, one row past max_seq_len's end on the scratch page).
args = ModelArgs(model_type="llama", vocab_size=16, hidden_size=32, intermediate_size=64,
                 num_layers=3,
                 num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
                 rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True)
""" + r"""
pages = PageTable(3, 32, 4)
for slot in range(3):
    pages.resize(slot, 32)
caches = []
for kernel in (False, True):
    cache = KVCache(args, 3, 32, pages=pages)
    cache.k.copy_(torch.randn(cache.k.shape, generator=torch.Generator().manual_seed(1)))
    cache.v.copy_(torch.randn(cache.v.shape, generator=torch.Generator().manual_seed(2)))
    slots, start = torch.tensor([2, 0, 1]), torch.tensor([5, 13, 27])
    path = torch.tensor([[0, 2, 5, 6], [0, 1, 3, 3], [0, 1, 4, 4]])
    if kernel:
        _kernels.keep_path(cache.k, cache.v, pages.table, slots, start, path, 32,
                           pages.scratch_page)
    else:
        cache.keep_path(slots, start, path)
    caches.append(cache)
assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
# With the path's feature rows gathered by one program more a row: the same moves, and the
# rows equal torch's gather (F not a power of two: the masked tail).
feats = torch.randn(3, 7, 40)
for kernel in (False, True):
    cache = KVCache(args, 3, 32, pages=pages)
    cache.k.copy_(torch.randn(cache.k.shape, generator=torch.Generator().manual_seed(1)))
    cache.v.copy_(torch.randn(cache.v.shape, generator=torch.Generator().manual_seed(2)))
    if kernel:
        kept = _kernels.keep_path(cache.k, cache.v, pages.table, slots, start, path, 32,
                                  pages.scratch_page, feats)
    else:
        kept = cache.keep_path(slots, start, path, feats)
    assert torch.equal(cache.k, caches[0].k) and torch.equal(cache.v, caches[0].v)
    want = torch.stack([feats[b, path[b]] for b in range(3)])
    assert torch.equal(kept, want), kernel
print("ok")
"""


@pytest.mark.xdist_group("interpreted")   # one interpreter server (tests/interpreted.py)
@pytest.mark.slow
def test_tree_verify_kernels_equal_the_torch_ops():
    """The tree's greedy VERIFY kernel (argmax partials, the walk, packed and path) equals
    samplers/_tree.accept_tree of the argmax, and the path-move kernel equals
    KVCache.keep_path (interpreted)."""
    run_interpreted(TREE_VERIFY_CHILD)


GATHER_CHILD = r"""
import random, sys, torch
from specloop.models import PageTable, load_model, _linear, _skinny
from specloop.models._linear import PackedLinear

model = load_model(sys.argv[1], dtype=torch.float16).model
a = model.args
H, D = a.hidden_size, a.head_dim
qkv_n = (a.num_heads + 2 * a.num_kv_heads) * D
# The qkv GEMM on the one-tile tl.dot (RoPE in its epilogue, the stream normed as loaded)
# at 5-32 rows; the other GEMMs as the dispatcher has them without a table entry.
_linear.SKINNY_TABLE[(qkv_n, H, False)] = ((32, f"d{D}x{1 << (H - 1).bit_length()}s1w4n1"),)
gathered = []
real = _skinny.skinny_rope_linear


def counted(x, *args, **kw):
    gathered.append(kw.get("gather") is not None)
    return real(x, *args, **kw)


_skinny.skinny_rope_linear = counted
model.kernels = True
V, P, T = a.vocab_size, 7, 5
out = {}
for gather in (True, False):
    lin = PackedLinear(skinny=True)
    lin.skinny_on_cpu, lin.gather_embeddings = True, gather
    model.linear = lin
    rng = random.Random(0)
    pages = PageTable(2, 64, 4)
    cache = model.make_cache(2, 64, pages=pages)
    for slot in (0, 1):
        pages.resize(slot, P + T)
    # Two prompts of 7 rows in one forward (14 rows: gathered too), then a VERIFY of 5
    # rows each.
    ids = torch.tensor([[rng.randrange(V) for _ in range(P)] for _ in (0, 1)])
    model(ids, torch.tensor([0, 0]), torch.tensor([0, 1]), cache)
    tokens = torch.tensor([[rng.randrange(V) for _ in range(T)] for _ in (0, 1)])
    hidden = model(tokens, torch.tensor([P, P]), torch.tensor([0, 1]), cache)
    out[gather] = (hidden, cache.k.clone(), cache.v.clone())
    # Every layer of both forwards took the tl.dot; the first layer's with the lookup in
    # it where gathering.
    assert gathered == ([gather] + [False] * (a.num_layers - 1)) * 2, gathered
    gathered.clear()
for x, y in zip(out[True], out[False]):
    assert torch.equal(x, y)
assert torch.isfinite(out[True][0]).all()
print("ok")
"""


@pytest.mark.xdist_group("interpreted")   # one interpreter server (tests/interpreted.py)
def test_first_layer_lookup_in_the_qkv_gemm_gives_the_same_bits(tiny_dirs):
    """The first layer's qkv GEMM looking the tokens' embeddings up itself
    (``PackedLinear.gather_embeddings``, ``skinny_rope_linear(gather=...)``) gives the
    decoder the bits of the embedding lookup first: hidden states and both caches,
    prefill rows and a VERIFY of 5 rows (interpreted, float16, the tiny llama)."""
    run_interpreted(GATHER_CHILD, str(tiny_dirs["llama"]))
