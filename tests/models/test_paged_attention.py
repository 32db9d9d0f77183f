"""Paged attention, one kernel and split-KV (flash-decoding), against a float64 dense
reference: Triton's interpreter on the CPU in float32 (a child process: the interpreter is
chosen before Triton is imported), and on CUDA in bf16 inside a captured graph.

Covered: rows of very different lengths in one batch (short ones: one active split, the
one kernel's bits; long ones: every split), lengths at split_min - 1 and split_min and on
tile edges, ranges crossing pages of a shuffled block table, page sizes 4 and 16, decode,
VERIFY's causal rows (T = 6) and a prefill chunk's row blocks (T = 12: short and long
blocks in one row), a split count not a power of two, the automatic split count, both
combines (the last program of a row's splits; a second kernel), pos_offset, and
determinism (two calls give the same bits).
"""

import pytest
import torch

from specloop.graphs._cuda import capture_graph
from specloop.models import _kernels

from ..interpreted import run_interpreted

# A float64 dense reference and a random paged cache, shared by the interpreted child
# (which execs this source) and the GPU test.
REFERENCE = r"""
import torch

def reference(q, k_cache, v_cache, table, slots, start_pos, pos_offset=0, tree_bits=None,
              tree_back=0):
    # Row b's query t sees positions 0..start+t of its slot, gathered page by page; with
    # a draft tree's words, of the tree's rows (from start - tree_back) only those whose
    # bit its word sets.
    B, T, HQ, D = q.shape
    _, P, HKV, _ = k_cache.shape
    G = HQ // HKV
    out = torch.empty(B, T, HQ, D, dtype=torch.float64)
    for b in range(B):
        start = int(start_pos[b]) + pos_offset
        n = start + T
        pos = torch.arange(n)
        pages = table[int(slots[b])].long().cpu()[pos // P]
        k = k_cache.cpu().double()[pages, pos % P]  # [n, HKV, D]
        v = v_cache.cpu().double()[pages, pos % P]
        for t in range(T):
            seen = torch.ones(start + t + 1, dtype=torch.bool)
            if tree_bits is not None:
                first = start - tree_back
                for p in range(first, start + t + 1):
                    seen[p] = bool(int(tree_bits[t]) >> (p - first) & 1)
            for h in range(HQ):
                s = k[: start + t + 1, h // G] @ q[b, t, h].cpu().double() / D ** 0.5
                s = s.masked_fill(~seen, float("-inf"))
                out[b, t, h] = torch.softmax(s, 0) @ v[: start + t + 1, h // G]
    return out.view(B, T, HQ * D)

def random_cache(gen, slots, max_len, page, hkv, d, dtype, device):
    # Every slot owns whole pages, handed out in a random order (pages of a row are not
    # contiguous); page `pages` is scratch.
    per = -(-max_len // page)
    pages = slots * per
    order = torch.randperm(pages, generator=gen).int()
    table = torch.cat([order.view(slots, per), torch.full((1, per), pages, dtype=torch.int32)])
    k = torch.randn(pages + 1, page, hkv, d, generator=gen).to(dtype).to(device)
    v = torch.randn(pages + 1, page, hkv, d, generator=gen).to(dtype).to(device)
    return k, v, table.to(device)
"""

CHILD = REFERENCE + r"""
import random
from specloop.models import _kernels

gen = torch.Generator().manual_seed(0)
rng = random.Random(0)
HQ, HKV, D = 6, 2, 16
checked = 0
for page, max_len, block_n, split_min in ((4, 96, 16, 40), (16, 128, 32, 64)):
    k, v, table = random_cache(gen, 5, max_len, page, HKV, D, torch.float32, "cpu")
    for T in (1, 6):
        # Rows of very different lengths in one batch: a short one (one active split, its
        # program writes the output), one just under split_min and one exactly at it (the
        # threshold), one at a multiple of a tile (split boundaries on tile edges), a long
        # one (every split active). VERIFY's causal rows: the row block's end is start + T.
        ends = [rng.randrange(T, 12), split_min - 1, split_min, 3 * block_n,
                rng.randrange(max_len - 20, max_len)]
        starts = torch.tensor([n - T for n in ends])
        slots = torch.tensor(rng.sample(range(5), 5))
        q = torch.randn(5, T, HQ, D, generator=gen)
        ref = reference(q, k, v, table, slots, starts)
        one = _kernels.paged_attention(q, k, v, table, slots, starts, splits=1, block_n=block_n)
        assert (one.double() - ref).abs().max() < 2e-5, (page, T, 1)
        for splits, combine in ((3, "kernel"), (8, "kernel"), (3, "last"), (8, "last"),
                                (None, "last")):
            kw = dict(splits=splits, block_n=block_n, combine=combine, split_min=split_min)
            got = _kernels.paged_attention(q, k, v, table, slots, starts, **kw)
            err = (got.double() - ref).abs().max()
            assert err < 2e-5, (page, T, splits, combine, float(err))
            # Rows below split_min: one program ran the one kernel's loop, the same bits.
            assert torch.equal(got[:2], one[:2]), (page, T, splits, combine)
            if splits == 8:  # the long rows did split (else this checks nothing new)
                assert not torch.equal(got[2:], one[2:]), (page, T, combine)
            if splits == 3:  # determinism: a second call gives the same bits
                again = _kernels.paged_attention(q, k, v, table, slots, starts, **kw)
                assert torch.equal(got, again), (page, T, combine)
            checked += 1
    # A prefill chunk (T 12: 36 query rows of a KV head, 3 row blocks of 16 ending at their
    # own causal limits; the first block's rows end below split_min, the last's above).
    T = 12
    starts = torch.tensor([split_min - 20, 3])
    slots = torch.tensor([1, 4])
    q = torch.randn(2, T, HQ, D, generator=gen)
    ref = reference(q, k, v, table, slots, starts)
    one = _kernels.paged_attention(q, k, v, table, slots, starts, splits=1, block_n=block_n)
    for combine in ("kernel", "last"):
        got = _kernels.paged_attention(q, k, v, table, slots, starts, splits=4, block_n=block_n,
                                       combine=combine, split_min=split_min)
        assert (got.double() - ref).abs().max() < 2e-5, (page, combine)
        assert torch.equal(got[1], one[1])  # row 1: every block short
# combine="last" leaves its counters zero for the next call.
assert not _kernels._COUNTERS[torch.device("cpu")].any()
# pos_offset (a draft step's rows at start + offset) moves every split's range with it.
starts = torch.tensor([121, 9])
q = torch.randn(2, 1, HQ, D, generator=gen)
ref = reference(q, k, v, table, torch.tensor([2, 0]), starts, -3)
for combine in ("kernel", "last"):
    got = _kernels.paged_attention(q, k, v, table, torch.tensor([2, 0]), starts, -3, splits=4,
                                   block_n=block_n, combine=combine, split_min=split_min)
    assert (got.double() - ref).abs().max() < 2e-5
assert checked == 20
# A draft tree's visibility words, one kernel and split, with tree rows stored before the
# forward's too: the words hide rows the causal mask shows.
T = 6
starts = torch.tensor([121, 9])
q = torch.randn(2, T, HQ, D, generator=gen)
words = torch.tensor([0b1, 0b11, 0b101, 0b1001, 0b11001, 0b100011]) << 2 | 0b11
for splits in (1, 4):
    kw = dict(splits=splits, block_n=block_n, split_min=split_min, tree_back=2)
    tree = _kernels.paged_attention(q, k, v, table, torch.tensor([2, 0]), starts,
                                    tree_bits=words, **kw)
    causal = _kernels.paged_attention(q, k, v, table, torch.tensor([2, 0]), starts, **kw)
    assert not torch.equal(tree, causal)
# Against the reference, the tree's rows across a tile edge (block_n 32: 27..34 and
# 58..65), tiles before them whole context (the kernel reads the words only in tiles
# that reach the tree's rows).
starts = torch.tensor([29, 60])
ref = reference(q, k, v, table, torch.tensor([2, 0]), starts, tree_bits=words, tree_back=2)
for splits in (1, 4):
    got = _kernels.paged_attention(q, k, v, table, torch.tensor([2, 0]), starts,
                                   splits=splits, block_n=block_n, split_min=split_min,
                                   tree_bits=words, tree_back=2)
    assert (got.double() - ref).abs().max() < 2e-5, splits
print("ok")
"""


@pytest.mark.xdist_group("interpreted")   # one interpreter server (tests/interpreted.py)
@pytest.mark.slow
def test_split_kv_equals_reference_interpreted():
    pytest.importorskip("triton")
    run_interpreted(CHILD)


def test_split_count_rule():
    """From shapes only: many splits at batch 1, fewer as the programs fill the GPU, never
    more than the cache's tiles or _MAX_SPLITS, none when no row can reach split_min,
    always a power of two, and the same for a batch as for the power-of-two bucket above."""
    def splits(b, max_len=2048, split_min=512):
        return _kernels.attention_splits(b, 3, 1, max_len, 64, 132, split_min)
    assert splits(1) == _kernels._MAX_SPLITS
    assert splits(1, 256, 64) == min(4, _kernels._MAX_SPLITS)  # 256 positions: 4 tiles of 64
    assert splits(1, 511) == 1 and splits(1, 512) > 1  # a row must be able to reach split_min
    assert splits(128) == 1
    seen = [splits(b) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert seen == sorted(seen, reverse=True) and seen[-1] == 1
    for b, s in zip((1, 2, 4, 8, 16, 32, 64, 128), seen):
        assert (s & (s - 1)) == 0, (b, s)
        assert s == 1 or 3 * b * s <= _kernels._SPLIT_PROGRAMS_PER_SM * 132, (b, s)
    # A batch splits as the power-of-two bucket above it (eager == replayed bits).
    assert [splits(b) for b in (5, 6, 7)] == [splits(8)] * 3
    assert splits(3) == splits(4)


@pytest.mark.gpu
@pytest.mark.parametrize("splits,combine", [(None, "last"), (None, "kernel"), (1, "last"),
                                            (4, "last"), (4, "kernel")])
def test_split_kv_in_graph_bf16(splits, combine):
    """A captured call replays at other lengths with the eager call's bits, and within bf16
    rounding of the float64 reference (SmolLM2's heads: 9 query, 3 KV, 64 wide); rows shorter
    than split_min (512) have the one kernel's bits (one program, its loop); "last" leaves
    its counters zero."""
    ns: dict = {}
    exec(REFERENCE, ns)
    gen = torch.Generator().manual_seed(1)
    B, T, HQ, HKV, D, max_len = 2, 4, 9, 3, 64, 2048
    k, v, table = ns["random_cache"](gen, 3, max_len, 16, HKV, D, torch.bfloat16, "cuda")
    q = torch.randn(B, T, HQ, D, generator=gen).to(torch.bfloat16).cuda()
    slots = torch.tensor([2, 0], device="cuda")
    starts = torch.tensor([5, 7], device="cuda")
    kw = dict(splits=splits, combine=combine, split_min=512)
    graph, out = capture_graph(lambda: _kernels.paged_attention(q, k, v, table, slots,
                                                                 starts, **kw))
    for lengths in ([0, 1], [1000, 63], [2044, 300], [16, 2043 - T], [512 - T, 511 - T]):
        starts.copy_(torch.tensor(lengths))
        graph.replay()
        eager = _kernels.paged_attention(q, k, v, table, slots, starts, **kw)
        assert torch.equal(out, eager), lengths
        one = _kernels.paged_attention(q, k, v, table, slots, starts, splits=1)
        for b, n in enumerate(lengths):
            if n + T < 512:
                assert torch.equal(out[b], one[b]), (lengths, b)
        ref = ns["reference"](q, k, v, table, slots, starts)
        torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)
    if combine == "last":
        # splits=1 never needs the counters: none may exist (the test alone in a worker).
        counters = _kernels._COUNTERS.get(q.device)
        assert counters is None or not counters.any()
        # Many groups racing to be last (batch 32, 32 splits, long rows): every call the
        # same bits, and those of the combine kernel within rounding.
        k, v, table = ns["random_cache"](gen, 32, max_len, 16, HKV, D, torch.bfloat16, "cuda")
        q = torch.randn(32, T, HQ, D, generator=gen).to(torch.bfloat16).cuda()
        slots = torch.randperm(32, generator=gen).cuda()
        starts = torch.randint(0, max_len - T, (32,), generator=gen).cuda()
        runs = [_kernels.paged_attention(q, k, v, table, slots, starts, splits=32,
                                         combine="last", split_min=512) for _ in range(20)]
        assert all(torch.equal(runs[0], r) for r in runs[1:])
        two = _kernels.paged_attention(q, k, v, table, slots, starts, splits=32,
                                       combine="kernel", split_min=512)
        torch.testing.assert_close(runs[0].float(), two.float(), atol=1e-2, rtol=1e-2)
        # 32 splits with combine="last" used the counters: each call left them zero.
        counters = _kernels._COUNTERS.get(q.device)
        assert counters is not None and not counters.any()
