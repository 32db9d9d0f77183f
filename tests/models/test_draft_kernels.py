"""The fused EAGLE draft step's kernels equal the plain ops (Triton's interpreter on CPU,
float32, in a child process: the interpreter is chosen before Triton is imported).

Covered: the target's feature capture stored by the next norm kernel, positions given as
start + pos_offset inside the kernels, the head's prologue kernel (embedding, enorm,
hnorm, concat), the per-part fnorm, the greedy draft token as one argmax-and-map
kernel (ties to the smallest target id, whatever the map's order), and a draft tree's
children as one top-k-and-map kernel (the same order, k times), written into their nodes'
columns; the prologue reading strided rows (a tree's parents as a view) or rows by index
(parents that are no view); the draft graph
step's integer glue in one kernel; the head's output for one row of each (its final
norm reading that row alone). The same comparisons
run on CUDA in bf16 in tests/models/test_gpu.py.
"""

import pytest

from ..interpreted import run_interpreted

pytest.importorskip("triton")

CHILD = r"""
import sys, torch
from specloop.models import KVCache, PageTable, load_model, _kernels
from specloop.models.drafters._eagle3 import Eagle3Head
from specloop.models.drafters._lm_head import DraftHead

torch.manual_seed(0)
model = load_model(sys.argv[1]).model
V, H = model.args.vocab_size, model.args.hidden_size
starts, slots = torch.tensor([0, 5, 9]), torch.tensor([0, 1, 2])
tokens = torch.randint(0, V, (3, 4))

def run(fused, fn):
    model.kernels = fused
    pages = PageTable(3, 64, 4)
    for s in range(3):
        pages.resize(s, 20)
    return fn(model.make_cache(3, 64, pages=pages))

# Target: features captured after layers 0 and 1 (the last: by the final norm kernel).
ref, got = (run(f, lambda c: model(tokens, starts, slots, c, capture=(0, 1)))
            for f in (False, True))
for a, b in zip(ref, got):
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
assert got[1].shape == (3, 4, 2 * H)

# Head: catch-up on features, then a step at start + pos_offset (offset in the kernels).
head = Eagle3Head(model, dtype=torch.float32, device="cpu", feature_layers=(0, 1))
head.init_random()
with torch.no_grad():
    head.fnorm.copy_(torch.rand_like(head.fnorm) + 0.5)
    head.enorm.copy_(torch.rand_like(head.enorm) + 0.5)
feats = got[1] * 3
outs = {}
for fused in (False, True):
    head.block.kernels = fused
    cache = KVCache(head.block.args, 3, 64, dtype=torch.float32, device="cpu")
    cu = head(tokens, feats, starts, slots, cache)
    step = head(tokens[:, :1], cu[:, -1:], starts + 6, slots, cache, pos_offset=-2)
    # The step's K/V went to position start + 4 (after the catch-up's 0..3).
    page, off = cache.locate(slots, (starts + 4)[:, None])
    # The catch-up again with one row of each out (the final norm reads it alone): the
    # same K/V written, that row's output.
    last = torch.tensor([3, 0, 2])
    k_before = cache.k.clone()
    picked = head(tokens, feats, starts, slots, cache, last=last)
    assert torch.equal(cache.k, k_before)
    torch.testing.assert_close(picked, cu[torch.arange(3), last], rtol=0, atol=0)
    outs[fused] = (cu, step, cache.k[0][page, off], cache.v[0][page, off], picked)
for a, b in zip(outs[False], outs[True]):
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
assert outs[True][2].abs().sum() > 0

# The draft picks (argmax_map, topk_map) three ways: one program a row, the row split
# over programs of 1,024 logits whose last combines their keys, and of 64 (a row of the
# 200-id map in 4 chunks, a tiny vocabulary's in several): the same picks each way.
def picks(split, chunk):
    _kernels._TOP_SPLIT, _kernels._TOP_CHUNK = split, chunk
    # Greedy token: argmax over the draft rows mapped to target ids == argmax over the
    # target vocabulary (-inf outside the map), ties included, map in any order.
    d2t = torch.randperm(V)[:200]
    lm = DraftHead(model.lm_head_weight, lm_head_tp=False, max_rows=8, d2t=d2t)
    hidden = torch.randn(8, H)
    logits = lm._matmul(hidden)
    logits[:4, 10] = logits[:4, 150] = logits[:4].max(dim=1).values + 1    # ties
    full = torch.full((8, V), float("-inf")).index_copy_(1, d2t, logits)
    want = full.argmax(dim=-1)
    out = torch.zeros(8, 3, dtype=torch.int64)
    _kernels.argmax_map(logits, d2t, out[:, 1])
    assert torch.equal(out[:, 1], want), (out[:, 1], want)
    assert torch.equal(out[:4, 1], torch.minimum(d2t[10], d2t[150]).expand(4))
    assert torch.equal(_kernels.argmax_map(full, None), want)
    assert torch.equal(lm.greedy(hidden, fused=True), lm.greedy(hidden, fused=False))
    # An increasing map (ties decided on the index, the map read once).
    inc = torch.sort(d2t).values
    full = torch.full((8, V), float("-inf")).index_copy_(1, inc, logits)
    assert torch.equal(_kernels.argmax_map(logits, inc, increasing=True), full.argmax(dim=-1))
    # Rows longer than one pass (16k): the passes' maxima and ties combine.
    x = torch.randn(2, 40000)
    x[0, 39000] = x[0, 7] = x[1, 20000] = 9.0
    assert _kernels.argmax_map(x, None).tolist() == [7, 20000]
    big = torch.arange(40000) * 2 + 1
    assert _kernels.argmax_map(x, big, increasing=True).tolist() == [15, 40001]
    assert _kernels.argmax_map(x, big.flip(0)).tolist() == [1 + 2 * (39999 - 39000), 40001 - 2]
    # NaN logits (a broken head): NaN is the maximum, as torch.argmax over the target
    # vocabulary has it; never an id outside the map. One NaN, all NaN, NaN and +inf, a NaN in
    # a later pass than a larger number; each map kind. A row of -inf only: the smallest mapped
    # id (torch's argmax over the padded vocabulary gives id 0, mapped or not).
    y = logits.clone()
    y[0, 5] = float("nan")
    y[1, :] = float("nan")
    y[2, 7] = float("inf")
    y[2, 9] = float("nan")
    y[3, :] = float("-inf")
    for index_map, kind in ((d2t, {}), (inc, {"increasing": True})):
        full = torch.full((8, V), float("-inf")).index_copy_(1, index_map, y)
        got, want = _kernels.argmax_map(y, index_map, **kind), full.argmax(dim=-1)
        assert torch.equal(got[[0, 1, 2, 4, 5, 6, 7]], want[[0, 1, 2, 4, 5, 6, 7]]), (got, want)
        assert got[3] == index_map.min() and got[1] == index_map.min(), got
    assert torch.equal(_kernels.argmax_map(y, None), y.argmax(dim=-1))
    # The unfused greedy with an increasing map (the CPU's: argmax over the draft rows, then
    # the map; no [B, V] scatter) picks as the kernel does: ties, NaN, +inf, a row of -inf.
    lm_inc = DraftHead(model.lm_head_weight, lm_head_tp=False, max_rows=8, d2t=inc)
    assert lm_inc.d2t_increasing
    for z in (logits, y):
        lm_inc._matmul = lambda h, z=z: z
        assert torch.equal(lm_inc.greedy(hidden), _kernels.argmax_map(z, inc, increasing=True))
    x[0, 30000] = float("nan")
    x[1, 3] = float("nan")
    x[1, 35000] = float("nan")
    assert _kernels.argmax_map(x, None).tolist() == [30000, 3] == x.argmax(dim=-1).tolist()

    # A draft tree's children: the top k of the draft rows, largest first, mapped; ties to the
    # smallest target id (argmax_map's order k times), NaN as -inf; each map kind. Rows: a
    # three-way tie at the top, a NaN, all -inf (the k smallest ids), +0.0 and -0.0 at the top
    # (equal), and plain ones.
    z = logits.clone()
    z[:4, 10] = z[:4, 150] = z[:4, 20] = z[:4].max(dim=1).values + 1
    z[5, 3] = float("nan")
    z[6, :] = float("-inf")
    z[7, :] = -1.0                  # zeros of both signs at the top: equal, so by id
    z[7, [40, 3, 17, 90]] = torch.tensor([0.0, -0.0, -0.0, 0.0])
    plain = torch.where(z.isnan(), float("-inf"), z)
    for index_map, kind in ((d2t, {}), (inc, {"increasing": True}), (None, {})):
        ids = torch.arange(z.shape[1]) if index_map is None else index_map
        for k in (1, 5, 9):
            got = _kernels.topk_map(z, k, index_map, **kind)
            for r in range(8):
                order = sorted(range(z.shape[1]), key=lambda c: (-plain[r, c].item(), ids[c].item()))
                assert got[r].tolist() == [ids[c].item() for c in order[:k]], (r, k, got[r])
    assert torch.equal(lm.top(hidden, 4, fused=True), lm.top(hidden, 4, fused=False))
    # ... written straight into a tree's node columns: z's 8 rows as 2 requests x 4 rows of a
    # depth, dest [4, k] naming each (row, rank)'s node, -1 for none (a row without children).
    dest = torch.tensor([[3, 1, -1], [-1, -1, -1], [2, -1, 6], [-1, 5, -1]])
    for index_map, kind in ((d2t, {}), (inc, {"increasing": True}), (None, {})):
        top = _kernels.topk_map(z, 3, index_map, **kind)
        out = torch.full((2, 8), -7, dtype=torch.int64)
        assert _kernels.topk_map(z, 3, index_map, **kind, out=out, dest=dest) is out
        want = torch.full((2, 8), -7, dtype=torch.int64)
        for r in range(8):
            for j in range(3):
                if dest[r % 4, j] >= 0:
                    want[r // 4, dest[r % 4, j]] = top[r, j]
        assert torch.equal(out, want), (out, want)


for split, chunk in ((False, 1024), (True, 1024), (True, 64)):
    picks(split, chunk)
_kernels._TOP_SPLIT, _kernels._TOP_CHUNK = False, 1024

# The draft graph step's integer glue in one kernel (draft_glue) equals its torch ops: the
# last catch-up row (0 on padding rows), tokens clamped at 0 (a VERIFY's -1 past its
# bonus), the start as it was, and lengths = offsets + start + last; rows of a packed
# VERIFY output (a view with one more column) and of a flat input buffer alike.
gen = torch.Generator().manual_seed(3)
for B, W in ((1, 4), (5, 3), (8, 1)):
    packed = torch.randint(-1, 50, (B, W + 2), generator=gen)
    verified = packed[:, :W + 1]                      # rows contiguous, a row stride W + 2
    verified[:, W] = torch.randint(0, W, (B,), generator=gen)
    meta = torch.stack([torch.arange(B), (torch.arange(B) < B - 1).long(),
                        torch.randint(0, 3, (B,), generator=gen),
                        torch.randint(0, 3, (B,), generator=gen)])
    lengths = torch.randint(0, 100, (2, B), generator=gen)
    want_lengths = lengths.clone()
    last = verified[:, W] * meta[1]
    at = want_lengths[1] + last
    want = (last, verified[:, :W].clamp(min=0), lengths[1].clone())
    torch.add(meta[2:], at, out=want_lengths)
    assert _kernels.draft_glue_fits(verified, meta, lengths)
    # VERIFY's first token into a column of its tokens buffer (strided) too.
    first = torch.full((B, 6), -7)
    position = torch.full((B,), -7)
    got = _kernels.draft_glue(verified, meta, lengths, first=first[:, 0], position=position)
    for g, w in zip(got, want):
        assert torch.equal(g, w), (B, W, g, w)
    assert torch.equal(lengths, want_lengths), (lengths, want_lengths)
    assert torch.equal(first[:, 0], want[1].gather(1, last[:, None])[:, 0]), first
    assert (first[:, 1:] == -7).all()
    assert torch.equal(position, want_lengths[1]), position
assert not _kernels.draft_glue_fits(verified, meta.t().contiguous().t(), lengths)

# The head's prologue reads its rows through their strides: a slice of a tree's rows and
# one row repeated (stride 0) give what their copies give.
emb = model.embed_tokens
rows = torch.randn(2, 7, H)
toks = torch.randint(0, V, (2, 7))
ones = torch.ones(H)
for view, tview in ((rows[:, 2:5], toks[:, 2:5]), (rows[:, 1:2].expand(-1, 4, -1), toks[:, 1:5]),
                    (rows[:, 3], toks[:, 3])):
    got = _kernels.eagle_prologue(tview, emb, view, ones, ones * 2, 1e-5)
    want = _kernels.eagle_prologue(tview.contiguous(), emb, view.contiguous(), ones, ones * 2,
                                   1e-5)
    assert torch.equal(got, want) and got.shape == (*view.shape[:-1], 2 * H)
# Or by index (a tree's parents that form no view): hidden's rows [0, 0, 3, 6, 2] read as
# index_select gives them.
index = torch.tensor([0, 0, 3, 6, 2])
got = _kernels.eagle_prologue(toks[:, :5], emb, rows, ones, ones * 2, 1e-5, rows=index)
want = _kernels.eagle_prologue(toks[:, :5], emb, rows.index_select(1, index), ones, ones * 2,
                               1e-5)
assert torch.equal(got, want) and got.shape == (2, 5, 2 * H)
print("ok")
"""


@pytest.mark.xdist_group("interpreted")   # one interpreter server (tests/interpreted.py)
@pytest.mark.slow
def test_fused_draft_kernels_equal_plain_ops(tiny_dirs):
    run_interpreted(CHILD, str(tiny_dirs["llama"]))
