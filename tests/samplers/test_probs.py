import pytest
import torch

from specloop.samplers import (SamplingBatch, SamplingParams, Stream, compute_probs,
                               sample_tokens)

V = 64


def logits(B, *mid, seed=0):
    return torch.randn(B, *mid, V, generator=torch.Generator().manual_seed(seed)) * 2


def batch(*params, pad_to=None):
    return SamplingBatch.from_params(list(params), list(range(len(params))), pad_to=pad_to)


def test_plain_rows_are_softmax_over_temperature():
    x = logits(2)
    p = compute_probs(x, batch(SamplingParams(temperature=0.5), SamplingParams()))
    torch.testing.assert_close(p, torch.stack([torch.softmax(x[0] / 0.5, -1),
                                               torch.softmax(x[1], -1)]))


def test_greedy_rows_one_hot_at_first_argmax_in_mixed_batch():
    x = logits(4, 3)
    x[1, 0, 5] = x[1, 0, 9] = x[1, 0].max() + 1  # a tie: the lower id wins, like argmax
    b = batch(SamplingParams(top_p=0.5), SamplingParams(temperature=0),
              SamplingParams(top_k=1, temperature=3.0), pad_to=4)
    p = compute_probs(x, b)
    for row in (1, 2, 3):
        assert torch.equal(p[row], torch.nn.functional.one_hot(x[row].argmax(-1), V).float())
    assert p[1, 0, 5] == 1
    toks = sample_tokens(p, b.seeds, torch.zeros(4, 3, dtype=torch.int64), Stream.BONUS)
    assert torch.equal(toks[1:], x[1:].argmax(-1))


def allowed(x, params):
    """Reference allowed set for one row of logits [V]."""
    z = x / params.temperature
    keep = torch.ones(V, dtype=torch.bool)
    order = torch.argsort(z, descending=True, stable=True)
    if params.top_k:
        keep[order[params.top_k:]] = False
    pr = torch.softmax(z.masked_fill(~keep, -torch.inf), -1)
    mass = 0.0
    for i in order.tolist():
        if not keep[i]:
            continue
        if mass >= params.top_p:
            keep[i] = False
        mass += float(pr[i])
    pr = torch.softmax(z.masked_fill(~keep, -torch.inf), -1)
    return keep & (pr >= params.min_p * pr.max())


@pytest.mark.parametrize("params", [
    SamplingParams(top_k=5), SamplingParams(top_p=0.3), SamplingParams(min_p=0.2),
    SamplingParams(temperature=0.7, top_k=10, top_p=0.8, min_p=0.05),
])
def test_filters_emit_only_allowed_tokens(params):
    x = logits(1, seed=3)[0]
    B = 4000
    b = SamplingBatch.from_params([params] * B, list(range(B)))
    p = compute_probs(x.expand(B, V), b)
    ok = allowed(x, params)
    assert torch.equal(p[0] > 0, ok)
    toks = sample_tokens(p, b.seeds, torch.zeros(B, dtype=torch.int64), Stream.BONUS)
    assert bool(ok[toks].all())
    assert set(toks.tolist()) == set(ok.nonzero().flatten().tolist())  # all of them show up


def test_rows_do_not_depend_on_the_rest_of_the_batch():
    x = logits(3, 2, seed=5)
    mixed = batch(SamplingParams(top_k=3), SamplingParams(temperature=0.8),
                  SamplingParams(temperature=0), pad_to=5)
    alone = batch(SamplingParams(temperature=0.8))  # no sorting path for this batch
    xp = torch.cat([x, logits(2, 2, seed=6)])
    assert torch.equal(compute_probs(xp, mixed)[1], compute_probs(x[1:2], alone)[0])


def test_sample_tokens_distribution_and_zero_mass():
    p = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(1)), -1)
    p[::4] = 0
    p /= p.sum()
    N = 40000
    seeds = torch.arange(N, dtype=torch.int64)
    toks = sample_tokens(p.expand(N, V), seeds, torch.zeros(N, dtype=torch.int64), Stream.DRAFT)
    counts = torch.bincount(toks, minlength=V)
    assert int(counts[::4].sum()) == 0
    nz = p > 0
    exp = (p[nz] * N).double().numpy()
    from scipy import stats  # noqa: PLC0415 (2-3 s to import: only where used)

    assert stats.chisquare(counts[nz].double().numpy(), exp * counts.sum().item() / exp.sum()).pvalue > 1e-4


def test_sample_tokens_validation():
    p = torch.full((2, V), 1.0 / V)
    seeds, pos = torch.tensor([1, 2]), torch.tensor([0, 0])
    bad = p.clone()
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match="row"):
        sample_tokens(bad, seeds, pos, Stream.BONUS)
    with pytest.raises(ValueError, match="positions"):
        sample_tokens(p, seeds, torch.tensor([0]), Stream.BONUS)
