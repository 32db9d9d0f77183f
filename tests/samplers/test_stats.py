"""The shared chi-square (samplers/_stats.py): passes exact samples, fails a biased twin,
rules out impossible tokens, and never keeps a bin with expected count < 5."""

import math

import torch

from specloop.samplers._stats import MIN_EXPECTED, chi2_counts, chi2_samples


def draws(p, n, seed=0):
    return torch.multinomial(p, n, replacement=True, generator=torch.Generator().manual_seed(seed))


def test_exact_samples_pass_and_a_biased_twin_fails():
    p = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(1)) * 2, -1)
    twin = torch.softmax(torch.log(p) / 1.3, -1)          # the same logits at T = 1.3
    samples = draws(p, 5000)
    assert chi2_samples(samples, p.double()).passed
    assert not chi2_samples(draws(twin, 5000), p.double()).passed


def test_a_token_with_probability_zero_fails_outright():
    p = torch.tensor([0.5, 0.5, 0.0])
    result = chi2_samples(torch.tensor([0, 1] * 50 + [2]), p)
    assert math.isinf(result.statistic) and not result.passed


def test_small_bins_merge_until_every_expected_count_is_at_least_five():
    expected = torch.tensor([40.0, 30.0, 20.0, 3.0, 1.0, 0.5, 0.5])   # tail 5.0 stays a bin
    assert chi2_counts(torch.tensor([40, 30, 20, 3, 1, 1, 0]), expected).df == 3
    expected = torch.tensor([60.0, 36.0, 2.0, 1.0, 1.0])   # tail 4 < 5 folds into 36
    result = chi2_counts(torch.tensor([60, 36, 2, 1, 1]), expected)
    assert result.df == 1 and result.statistic == 0.0
    assert MIN_EXPECTED == 5.0


def test_conditional_expected_counts_sum_of_distributions():
    # Samples from different distributions, tested against the sum of their own: passes.
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(20, generator=gen) * 2 + torch.randn(2000, 20, generator=gen)
    ps = torch.softmax(logits, -1)
    tokens = torch.multinomial(ps, 1, generator=gen).squeeze(1)
    observed = torch.bincount(tokens, minlength=20)
    assert chi2_counts(observed, ps.double().sum(0)).passed
    flatter = torch.softmax(logits / 1.5, -1).double().sum(0)
    assert not chi2_counts(observed, flatter).passed
