import pytest
import torch

from specloop.samplers import rejection_sample
from specloop.samplers._reference import reference_rejection_sample


def make(B, K, V, seed=0, sharp=2.0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * sharp, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * sharp, -1)
    d = (torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K) if K
         else torch.zeros(B, 0, dtype=torch.int64))
    seeds = torch.arange(B, dtype=torch.int64) * 31 + 7
    return d, p, q, seeds, torch.arange(B, dtype=torch.int64) + 100


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("K", [0, 1, 4])
@pytest.mark.parametrize("point_mass", [False, True])
def test_matches_per_row_reference(method, K, point_mass):
    d, p, q, seeds, pos = make(96, K, 300, seed=K)
    q = None if point_mass else q
    got = rejection_sample(d, p, q, seeds=seeds, positions=pos, method=method)
    ref = reference_rejection_sample(d, p, q, seeds=seeds, positions=pos, method=method)
    assert torch.equal(got.token_ids, ref.token_ids)
    assert torch.equal(got.num_accepted, ref.num_accepted)
    n = got.num_accepted
    steps = torch.arange(K + 1)
    assert torch.equal(got.token_ids[steps < n[:, None]], d[steps[:K] < n[:, None]])
    assert bool((got.token_ids[steps > n[:, None]] == -1).all())
    assert bool((got.token_ids.gather(1, n[:, None]) >= 0).all())


@pytest.mark.parametrize("method", ["token", "block"])
def test_rows_bit_identical_across_batches_orders_and_padding(method):
    d, p, q, seeds, pos = make(40, 3, 200)
    full = rejection_sample(d, p, q, seeds=seeds, positions=pos, method=method)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(3))
    shuffled = rejection_sample(d[perm], p[perm], q[perm], seeds=seeds[perm],
                                positions=pos[perm], method=method)
    assert torch.equal(shuffled.token_ids, full.token_ids[perm])
    for lo, hi in ((0, 7), (7, 40), (13, 14)):
        part = rejection_sample(d[lo:hi], p[lo:hi], q[lo:hi], seeds=seeds[lo:hi],
                                positions=pos[lo:hi], method=method)
        assert torch.equal(part.token_ids, full.token_ids[lo:hi])
    # padding rows: one-hot p and q at token 0, seed 0
    pad_p = torch.zeros(5, 4, 200)
    pad_p[..., 0] = 1
    padded = rejection_sample(torch.cat([d, torch.zeros(5, 3, dtype=torch.int64)]),
                              torch.cat([p, pad_p]), torch.cat([q, pad_p[:, :3]]),
                              seeds=torch.cat([seeds, torch.zeros(5, dtype=torch.int64)]),
                              positions=torch.cat([pos, torch.zeros(5, dtype=torch.int64)]),
                              method=method)
    assert torch.equal(padded.token_ids[:40], full.token_ids)
    again = rejection_sample(d, p, q, seeds=seeds, positions=pos, method=method)
    assert torch.equal(again.token_ids, full.token_ids)


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("point_mass", [False, True])
def test_greedy_one_hot_rows_are_exact_argmax(method, point_mass):
    B, K, V = 64, 3, 50
    _, p, _, seeds, pos = make(B, K, V)
    top = p.argmax(-1)  # [B, K+1]
    onehot = torch.nn.functional.one_hot(top, V).float()
    d = top[:, :K].clone()
    d[::2, 1] = (d[::2, 1] + 1) % V  # every other row: second draft is wrong
    q = None if point_mass else torch.nn.functional.one_hot(d, V).float()
    r = rejection_sample(d, onehot, q, seeds=seeds, positions=pos, method=method)
    expect_n = torch.where(torch.arange(B) % 2 == 0, 1, K)
    assert torch.equal(r.num_accepted, expect_n)
    steps = torch.arange(K + 1)
    assert torch.equal(r.token_ids, torch.where(steps <= expect_n[:, None], top, -1))


@pytest.mark.parametrize("method", ["token", "block"])
def test_draft_equal_target_accepts_everything(method):
    d, p, _, seeds, pos = make(500, 4, 100)
    q = p[:, :4].clone()
    d = torch.multinomial(q.reshape(-1, 100), 1).reshape(500, 4)
    r = rejection_sample(d, p, q, seeds=seeds, positions=pos, method=method)
    assert bool((r.num_accepted == 4).all())
    assert torch.equal(r.token_ids[:, :4], d)


@pytest.mark.slow  # a statistical comparison over many trials; the fast subset has the rest
def test_block_accepts_at_least_as_many_as_token():
    # The paper's example: p = (1/3, 2/3), q = (2/3, 1/3), K = 2: 10/9 vs 11/9 expected.
    N, K = 60000, 2
    p = torch.tensor([1 / 3, 2 / 3]).expand(N, K + 1, 2)
    q = torch.tensor([2 / 3, 1 / 3]).expand(N, K, 2)
    g = torch.Generator().manual_seed(0)
    d = torch.multinomial(q[0], N, replacement=True, generator=g).T
    seeds = torch.arange(N, dtype=torch.int64)
    pos = torch.zeros(N, dtype=torch.int64)
    mean = {m: rejection_sample(d, p, q, seeds=seeds, positions=pos, method=m)
            .num_accepted.double().mean().item() for m in ("token", "block")}
    assert abs(mean["token"] - 10 / 9) < 0.02 and abs(mean["block"] - 11 / 9) < 0.02
    d2, p2, q2, s2, pos2 = make(4000, 4, 30, sharp=1.0)
    n = {m: rejection_sample(d2, p2, q2, seeds=s2, positions=pos2, method=m)
         .num_accepted.double().mean().item() for m in ("token", "block")}
    assert n["block"] >= n["token"] - 0.02


# ---- bad input ------------------------------------------------------------------------

def call(d, p, q, **kw):
    B = d.shape[0]
    return rejection_sample(d, p, q, seeds=torch.arange(B), positions=torch.zeros(B,
                            dtype=torch.int64), **kw)


@pytest.mark.parametrize("mutate,match", [
    (lambda d, p, q: (d, p.double(), q), "draft_probs must be"),
    (lambda d, p, q: (d.int(), p, q), "int64"),
    (lambda d, p, q: (d, p[:, :-1], q), r"\[B, K\+1, V\]"),
    (lambda d, p, q: (d, p, q[:, :, :-1]), "draft_probs must be"),
    (lambda d, p, q: (d[:, :1], p, q), r"\[B, K\+1, V\]"),
])
def test_shape_and_dtype_errors(mutate, match):
    d, p, q, _, _ = make(4, 2, 10)
    with pytest.raises(ValueError, match=match):
        call(*mutate(d, p, q))


def test_bad_values_raise_when_validating():
    d, p, q, _, _ = make(4, 2, 10)
    for bad_val in (float("nan"), float("inf")):
        bad = p.clone()
        bad[2, 1, 3] = bad_val
        with pytest.raises(ValueError, match="row"):
            call(d, bad, q)
    with pytest.raises(ValueError, match="sums to"):
        call(d, p * 0.9, q)
    with pytest.raises(ValueError, match="outside the vocab"):
        call(torch.where(d == d, 10, d), p, q)
    q0 = q.clone()
    q0[1, 0, d[1, 0]] = 0
    with pytest.raises(ValueError, match="is 0 at the drafted"):
        call(d, p, q0 / q0.sum(-1, keepdim=True))
    with pytest.raises(ValueError, match="method"):
        call(d, p, q, method="tree")


def test_bad_values_have_defined_results_without_validation():
    d, p, q, _, _ = make(64, 2, 10)
    d_bad = d.clone()
    d_bad[:, 0] = -1  # unknown ids are never accepted
    r = call(d_bad, p, q, validate=False)
    assert bool((r.num_accepted == 0).all()) and bool((r.token_ids[:, 0] >= 0).all())
    # q(d) = 0 < p(d): the ratio is infinite, so the draft is accepted
    q0 = q.clone()
    q0[:, 0].scatter_(1, d[:, :1], 0.0)
    r = call(d, p, q0, validate=False, method="token")
    assert bool((r.num_accepted >= 1).all())
