"""All-greedy strict verification's Triton kernels (samplers/_triton_greedy.py) equal the
torch path (argmax, then strict_from_targets) token for token: under Triton's interpreter
on the CPU at small V (chunks of 64 or 128 logits, so that ties, NaN and -inf cross
program boundaries), and on CUDA at SmolLM2's V, eager and replayed in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from specloop.graphs._cuda import capture_graph
from specloop.samplers import SamplingBatch, SamplingParams, strict_verify
from specloop.samplers._rejection import RejectionResult
from specloop.samplers._sampler import packed_result, strict_from_targets
from specloop.samplers import _triton_greedy

from ..interpreted import run_interpreted

# Builds cases on any device; `reference` is the torch path as [B, K+2].
CASES = r"""
import torch
from specloop.samplers._sampler import strict_from_targets

def reference(d, x):
    r = strict_from_targets(d, x.argmax(-1))
    return torch.cat([r.token_ids, r.num_accepted[:, None]], 1)

def drafts_for(x, gen):
    # Row 0 all drafts match, row 1 none, row 2 a mismatch in the middle (the drafts
    # after it match), row 3 a draft outside the vocabulary (-1), row 4 one past it; the
    # rest one mismatch at random (or none).
    B, T, V = x.shape
    d = x.argmax(-1)[:, :-1].clone()
    if T == 1:
        return d
    cut = torch.randint(0, T, (B,), generator=gen)
    cut[:5] = torch.tensor([T - 1, 0, (T - 1) // 2, 0, 0])[:B]
    steps = torch.arange(T - 1)
    d = torch.where(steps == cut[:, None], (d + 1) % V, d)
    d[1:2] = (d[1:2] + 1) % V
    d[3:4, 0], d[4:5, 0] = -1, V
    return d

def tricky(B, T, V, gen, chunk):
    # Random logits with ties at chunk boundaries, ties within a lane (indices one block
    # apart), +inf ties, all -inf rows, NaN (the first NaN is torch's argmax).
    x = torch.randn(B, T, V, generator=gen)
    x[0, 0, [chunk - 1, chunk]] = 9.0          # across a chunk boundary: chunk - 1
    x[0, -1, [V - 1, 2 * chunk]] = 9.0
    x[1, 0, [3, 3 + chunk // 2, V - 1]] = 9.0  # same lane, later step: 3
    x[1, -1, :] = float("-inf")                # all -inf: 0
    x[2, 0, [7, chunk + 1]] = float("inf")
    x[2, -1, [V - 2, chunk + 5]] = float("nan")
    x[3, 0, [chunk + 2, chunk + 2 + chunk // 2]] = float("nan")  # one lane: the first
    x[3, 0, 0] = float("inf")                  # NaN beats +inf
    x[4, 0, : chunk * (V // chunk)] = float("-inf")  # only the short last chunk is finite
    return x
"""

CHILD = CASES + r"""
import sys
import torch
from specloop.samplers import SamplingBatch, SamplingParams
from specloop.samplers import _sampler, _triton_greedy
from specloop.samplers._triton_greedy import greedy_argmax, greedy_verify

gen = torch.Generator().manual_seed(0)
# Small V not a multiple of the block or the chunk; K + 1 = 1 (plain decoding), 3, 6.
for (B, T, V, chunk, block) in [(5, 4, 200, 64, 32), (5, 1, 260, 128, 64),
                                (5, 6, 130, 64, 64)]:
    x = tricky(B, T, V, gen, chunk)
    d = drafts_for(x, gen)
    want = reference(d, x)
    got = greedy_verify(d, x, chunk=chunk, block=block)
    assert torch.equal(got, want), (B, T, V, got, want)
    # The one-kernel mode: a program a row.
    got = greedy_verify(d, x, mode="row", block=block)
    assert torch.equal(got, want), ("row", B, T, V, got, want)
    if T > 1:
        assert want[0, -1] == T - 1 and want[1, -1] == 0, want   # the cases are there
# bf16 logits (compared as f32), strided rows of logits and drafts (the step's tokens
# [:, 1:] view); then the default chunk at SmolLM2's V (24 programs a row).
x = tricky(5, 2, 150, gen, 64)
d = drafts_for(x, gen)
wide = torch.randn(5, 2, 200, generator=gen)
wide[..., :150] = x
wide = wide.to(torch.bfloat16)
tokens = torch.cat([torch.zeros(5, 1, dtype=torch.int64), d], 1)
assert torch.equal(greedy_verify(tokens[:, 1:], wide[..., :150], chunk=64, block=32),
                   reference(d, x.to(torch.bfloat16)))
x = torch.randn(2, 1, 49152, generator=gen)
x[0, 0, [40000, 2047, 2048]] = 9.0
assert torch.equal(greedy_verify(torch.zeros(2, 0, dtype=torch.int64), x),
                   reference(torch.zeros(2, 0, dtype=torch.int64), x))
# strict_verify's dispatch (CUDA only, forced here): an all-greedy batch gets the kernels'
# tensor, its token_ids and num_accepted views of it; a sampled batch keeps the torch path.
_sampler.usable = lambda d, x: True
x = tricky(5, 2, 150, gen, 64)
d = drafts_for(x, gen)
greedy = SamplingBatch.from_params([SamplingParams(temperature=0)] * 5, list(range(5)))
r = _sampler.strict_verify(d, x, greedy, torch.zeros(5, dtype=torch.int64))
packed = _sampler.packed_result(r)
assert torch.equal(packed, reference(d, x))
assert packed.data_ptr() == r.token_ids.data_ptr()
calls = []
_sampler.greedy_verify = lambda *a: calls.append(1)
mixed = SamplingBatch.from_params([SamplingParams(temperature=0), SamplingParams()] * 2 +
                                  [SamplingParams()], list(range(5)))
_sampler.strict_verify(d, x, mixed, torch.zeros(5, dtype=torch.int64))
assert not calls
# A draft step's argmax [B, V] -> [B] (K = 0's kernels, the token alone), and
# DefaultSampler.draft's dispatch to it when not advanced (forced here).
x = tricky(5, 2, 150, gen, 64).flatten(0, 1)
got = greedy_argmax(x, chunk=64, block=32)
assert got.shape == (10,) and torch.equal(got, x.argmax(-1)), (got, x.argmax(-1))
assert torch.equal(greedy_argmax(x, mode="row", block=32), x.argmax(-1))
_sampler.usable_argmax = lambda x: True
sample = _sampler.DefaultSampler().draft(x, mixed, torch.zeros(10, dtype=torch.int64),
                                         advanced=False)
assert torch.equal(sample.token_ids, x.argmax(-1)) and sample.probs is None
print("ok")
"""


@pytest.mark.xdist_group("interpreted")   # one interpreter server (tests/interpreted.py)
@pytest.mark.skipif(not _triton_greedy._triton_importable(), reason="needs Triton")
def test_kernels_equal_torch_path_interpreted():
    run_interpreted(CHILD)


def test_packed_result_is_a_view_only_of_one_tensor():
    packed = torch.arange(12).view(3, 4)
    r = RejectionResult(token_ids=packed[:, :3], num_accepted=packed[:, 3])
    got = packed_result(r)
    assert torch.equal(got, packed) and got.data_ptr() == packed.data_ptr()
    assert got._base is not None    # a view: no copy
    # Two tensors (the torch path): a new [B, K+2] tensor.
    t, n = torch.arange(9).view(3, 3), torch.tensor([0, 1, 2])
    got = packed_result(RejectionResult(token_ids=t, num_accepted=n))
    assert torch.equal(got, torch.cat([t, n[:, None]], 1))
    # Views of one tensor, but not its rows' last column: copied.
    wide = torch.arange(15).view(3, 5)
    got = packed_result(RejectionResult(token_ids=wide[:, :3], num_accepted=wide[:, 4]))
    assert torch.equal(got, torch.cat([wide[:, :3], wide[:, 4:]], 1))


def test_chunk_rule():
    # Batch 1 at SmolLM2's V: 24 programs of 2048 logits; the chunk doubles only past
    # _MAX_PROGRAMS programs and stops at _MAX_CHUNK.
    assert _triton_greedy.chunk_size(1, 49152) == 2048
    assert _triton_greedy.chunk_size(64 * 6, 49152) == 16384
    for rows in (1, 4, 8, 32, 64, 256, 4096):
        c = _triton_greedy.chunk_size(rows, 49152)
        assert c == 16384 or rows * -(-49152 // c) <= _triton_greedy._MAX_PROGRAMS


def test_tree_warps_rule(monkeypatch):
    """The tree walk's warps: one per 128 of its [T_P2, S_P2] partials, 1 to 4 (the 31-node
    tree's one warp ran ~1,900 instructions: samplers/_triton_greedy.tree_warps), unless
    $SPECLOOP_TREE_WARPS (read at import) sets them."""
    rule = _triton_greedy.tree_warps
    assert [rule(t, 32) for t in (2, 4, 8, 16, 32, 64)] == [1, 1, 2, 4, 4, 4]
    assert rule(32, 1) == 1 and rule(32, 8) == 2
    monkeypatch.setattr(_triton_greedy, "_TREE_WARPS", 1)
    assert rule(32, 32) == 1


def test_cpu_keeps_the_torch_path():
    x = torch.randn(2, 3, 50)
    d = x.argmax(-1)[:, :-1]
    assert not _triton_greedy.usable(d, x) and not _triton_greedy.usable_argmax(x[:, 0])
    batch = SamplingBatch.from_params([SamplingParams(temperature=0)] * 2, [0, 1])
    r = strict_verify(d, x, batch, torch.zeros(2, dtype=torch.int64))
    ref = strict_from_targets(d, x.argmax(-1))
    assert torch.equal(r.token_ids, ref.token_ids) and r.num_accepted.tolist() == [2, 2]


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 6])
@pytest.mark.parametrize("B", [1, 8, 64])
def test_cuda_equals_torch_path_eager_and_in_graph(B, T):
    ns: dict = {}
    exec(CASES, ns)
    gen = torch.Generator().manual_seed(B * 10 + T)
    V = 49152
    x = ns["tricky"](max(B, 5), T, V, gen, _triton_greedy.chunk_size(B * T, V))[:B]
    d = ns["drafts_for"](x, gen)
    batch = SamplingBatch.from_params([SamplingParams(temperature=0)] * B, list(range(B)))
    pos, pos_c = torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64).cuda()
    for dt in (torch.float32, torch.bfloat16):
        xc, dc = x.to(dt).cuda(), d.cuda()
        assert _triton_greedy.usable(dc, xc)
        want = ns["reference"](d, x.to(dt))         # the torch path on the CPU
        assert torch.equal(ns["reference"](dc, xc).cpu(), want)  # and on CUDA
        got = packed_result(strict_verify(dc, xc, batch, pos_c))
        assert torch.equal(got.cpu(), want), dt
        for mode in ("split", "row"):
            got = _triton_greedy.greedy_verify(dc, xc, mode=mode)
            assert torch.equal(got.cpu(), want), (dt, mode)
    # Captured (the step's allocation pattern), replayed on new logits and drafts: equal
    # to eager.
    xc, dc = x.cuda(), d.cuda()
    graph, (out, row) = capture_graph(
        lambda: (packed_result(strict_verify(dc, xc, batch, pos_c)),
                 _triton_greedy.greedy_verify(dc, xc, mode="row")))
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        x2 = torch.randn(B, T, V, generator=g)
        x2[:, :, 1000] = x2[:, :, 30000] = 50.0 if seed == 1 else 0.0
        d2 = ns["drafts_for"](x2, g)
        xc.copy_(x2)
        dc.copy_(d2)
        graph.replay()
        eager = packed_result(strict_verify(dc, xc, batch, pos_c))
        assert torch.equal(out, eager) and torch.equal(out.cpu(), ns["reference"](d2, x2))
        assert torch.equal(row, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8, 64])
def test_cuda_draft_argmax_equals_torch_eager_and_in_graph(B):
    from specloop.samplers import DefaultSampler
    gen = torch.Generator().manual_seed(B)
    x = torch.randn(B, 49152, generator=gen)
    x[0, [2047, 2048, 40000]] = 9.0
    batch = SamplingBatch.from_params([SamplingParams()] * B, list(range(B)))
    pos = torch.zeros(B, dtype=torch.int64, device="cuda")
    xc = x.cuda()
    assert _triton_greedy.usable_argmax(xc)
    draft = lambda: DefaultSampler().draft(xc, batch, pos, advanced=False).token_ids  # noqa
    assert torch.equal(draft().cpu(), x.argmax(-1)) and int(draft()[0]) == 2047
    graph, out = capture_graph(draft)
    for seed in range(3):
        x2 = torch.randn(B, 49152, generator=torch.Generator().manual_seed(seed))
        xc.copy_(x2)
        graph.replay()
        assert torch.equal(out.cpu(), x2.argmax(-1))
