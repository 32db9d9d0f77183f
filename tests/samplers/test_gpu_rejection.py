"""The Triton token-wise rejection kernel on CUDA: dispatch, exactness by the per-position
chi-square test of test_distribution, token equality with the torch path on the same
GPU, and CUDA-graph replay equal to eager."""

from __future__ import annotations

import pytest
import torch

from specloop.samplers import rejection_sample
from specloop.samplers import _rejection, _triton_rejection

from .test_distribution import GRID, assert_fits, point_drafts, problem, q_drafts, run_trials

pytestmark = pytest.mark.gpu


@pytest.fixture
def torch_path(monkeypatch):
    """A context in which rejection_sample takes the torch path even on CUDA."""
    def disable():
        monkeypatch.setattr(_rejection._triton_rejection, "usable", lambda *a: False)
    return disable


def _cuda(*ts):
    return [None if t is None else t.cuda() for t in ts]


def test_cuda_token_method_dispatches_to_the_kernel(monkeypatch):
    calls = []
    kernel = _triton_rejection.token_rejection_sample
    monkeypatch.setattr(_triton_rejection, "token_rejection_sample",
                        lambda *a: calls.append(1) or kernel(*a))
    _, _, p, q, _ = problem(1, 1.0)
    seeds = torch.arange(8)
    d, pe, qe, s, pos = _cuda(q_drafts(q, seeds, 0), p.expand(8, -1, -1),
                              q.expand(8, -1, -1), seeds, torch.zeros(8, dtype=torch.int64))
    out = rejection_sample(d, pe, qe, seeds=s, positions=pos)
    assert calls and out.token_ids.is_cuda and out.token_ids.shape == (8, 2)
    rejection_sample(d, pe, qe, seeds=s, positions=pos, method="block")
    assert len(calls) == 1  # block verification stays on the torch path


def _gpu_step(p, drafts, q):
    def step(seeds, positions):
        n = seeds.shape[0]
        d, s, pos, pe = _cuda(drafts(seeds), seeds, positions, p)
        qe = None if q is None else q.cuda().expand(n, -1, -1)
        return rejection_sample(d, pe.expand(n, -1, -1), qe, seeds=s, positions=pos,
                                validate=False).token_ids.cpu()
    return step


@pytest.mark.parametrize("K,T", GRID)
def test_kernel_chi_square_full_q(K, T):
    _, _, p, q, _ = problem(K, T)
    assert_fits(run_trials(_gpu_step(p, lambda s: q_drafts(q, s, 0), q)), p)


@pytest.mark.parametrize("K,T", GRID)
def test_kernel_chi_square_point_mass(K, T):
    _, _, p, q, _ = problem(K, T, seed=1)
    assert_fits(run_trials(_gpu_step(p, lambda s: point_drafts(p, q, s), None)), p)


def _batch(B, K, V, seed, sharp=2.0):
    """Target/draft rows [B, K+1, V], [B, K, V] with correlated logits, drafts from q
    (half replaced by argmax p so that long accepted runs and bonuses occur)."""
    g = torch.Generator().manual_seed(seed)
    t_logits = torch.randn(B, K + 1, V, generator=g) * sharp
    p = torch.softmax(t_logits, -1)
    q = torch.softmax(t_logits[:, :K] + torch.randn(B, K, V, generator=g), -1)
    d = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K)
    d = torch.where(torch.rand(B, K, generator=g) < 0.5, p[:, :K].argmax(-1), d)
    seeds = torch.randint(0, 2**62, (B,), generator=g)
    positions = torch.randint(0, 2**40, (B,), generator=g)
    return _cuda(d, p, q, seeds, positions)


@pytest.mark.parametrize("V", [49152, 3001])
@pytest.mark.parametrize("point_mass", [False, True])
def test_kernel_equals_torch_path(V, point_mass, torch_path):
    B, K = 1024, 4
    d, p, q, seeds, pos = _batch(B, K, V, seed=V)
    q = None if point_mass else q
    fast = rejection_sample(d, p, q, seeds=seeds, positions=pos, validate=True)
    torch_path()
    slow = rejection_sample(d, p, q, seeds=seeds, positions=pos, validate=False)
    # tau depends only on exact gathers and the same uniforms: equal everywhere.
    assert torch.equal(fast.num_accepted, slow.num_accepted)
    assert 0 < int(fast.num_accepted.sum()) < B * K
    same = (fast.token_ids == slow.token_ids).all(dim=1)
    # Rows differ only where u lands within f32 rounding of a chunk boundary.
    assert int(same.sum()) >= B - 2, f"{B - int(same.sum())} of {B} rows differ"


def test_kernel_handles_out_of_vocab_and_empty_residuals(torch_path):
    B, K, V = 4, 2, 600
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1)
    q = p[:, :K].clone()
    d = torch.tensor([[5, 7], [-3, 2], [V + 4, 1], [9, 9]])
    p[torch.arange(B), 0, d[:, 0].clamp(0, V - 1)] = 0  # rejected, residual (p - q)+ = 0
    args = _cuda(d, p, q, torch.arange(B) + 1, torch.arange(B))
    fast = [rejection_sample(*args[:2], qq, seeds=args[3], positions=args[4],
                             validate=False) for qq in (args[2], None)]
    torch_path()
    for f, qq in zip(fast, (args[2], None)):
        s = rejection_sample(*args[:2], qq, seeds=args[3], positions=args[4], validate=False)
        assert torch.equal(f.token_ids, s.token_ids)
        assert torch.equal(f.num_accepted, s.num_accepted)


@pytest.mark.parametrize("point_mass", [False, True])
def test_graph_replay_equals_eager(point_mass):
    B, K, V = 64, 3, 32000
    d, p, q, seeds, pos = _batch(B, K, V, seed=5)
    q = None if point_mass else q
    static = [d.clone(), p.clone(), None if q is None else q.clone(), seeds.clone(),
              pos.clone()]

    def call():
        return rejection_sample(static[0], static[1], static[2], seeds=static[3],
                                positions=static[4], validate=False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # compile and warm up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for step in range(3):
        d2, p2, q2, s2, pos2 = _batch(B, K, V, seed=100 + step)
        for dst, src in zip(static, (d2, p2, q2, s2, pos2)):
            if dst is not None:
                dst.copy_(src)
        graph.replay()
        eager = call()
        assert torch.equal(out.token_ids, eager.token_ids)
        assert torch.equal(out.num_accepted, eager.num_accepted)
