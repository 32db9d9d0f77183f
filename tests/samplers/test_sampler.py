import itertools

import pytest
import torch

from specloop.samplers import (DefaultSampler, SamplingBatch, SamplingParams, SpecMetadata,
                               Stream, compute_probs, rejection_sample, sample_tokens,
                               strict_verify)

V = 40


def setup(params, K=3, seed=0):
    B = len(params)
    g = torch.Generator().manual_seed(seed)
    batch = SamplingBatch.from_params(params, [100 + i for i in range(B)])
    return (batch, torch.randn(B, K + 1, V, generator=g) * 2,
            torch.randn(B, K, V, generator=g) * 2, torch.arange(B, dtype=torch.int64) * 3 + 10)


MIXED = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_k=5),
         SamplingParams(top_k=1), SamplingParams(temperature=0.6, top_p=0.9)]


def draft_all(sampler, d_logits, batch, pos, advanced):
    out = [sampler.draft(d_logits[:, i], batch, pos + i, advanced=advanced)
           for i in range(d_logits.shape[1])]
    d = torch.stack([o.token_ids for o in out], 1)
    return d, (torch.stack([o.probs for o in out], 1) if advanced else None)


@pytest.mark.parametrize("method", ["token", "block"])
def test_advanced_pipeline_equals_the_primitives(method):
    batch, t_logits, d_logits, pos = setup(MIXED)
    s = DefaultSampler(method=method)
    d, q = draft_all(s, d_logits, batch, pos, True)
    q_ref = compute_probs(d_logits, batch)
    assert torch.equal(q, q_ref)
    assert torch.equal(d, sample_tokens(q_ref, batch.seeds, pos[:, None] + torch.arange(3),
                                        Stream.DRAFT))
    r = s.verify(d, t_logits, q, batch, pos, advanced=True)
    ref = rejection_sample(d, compute_probs(t_logits, batch), q, seeds=batch.seeds,
                           positions=pos, method=method)
    assert torch.equal(r.token_ids, ref.token_ids)
    greedy = batch.is_greedy
    # greedy rows: argmax drafts, all accepted iff they match the target's argmax chain
    assert torch.equal(d[greedy], d_logits[greedy].argmax(-1))


def test_greedy_rows_exact_in_any_batch():
    batch, t_logits, d_logits, pos = setup(MIXED, seed=4)
    s = DefaultSampler()
    for advanced in (False, True):
        d, q = draft_all(s, d_logits, batch, pos, advanced)
        r = s.verify(d, t_logits, q, batch, pos, advanced=advanced)
        top = t_logits.argmax(-1)
        for row in (1, 3):
            n = int(r.num_accepted[row])
            assert torch.equal(r.token_ids[row, :n + 1], top[row, :n + 1])
            assert n == int((d[row] == top[row, :3]).long().cumprod(0).sum())


def test_strict_verify_rules_and_k0():
    batch, t_logits, _, pos = setup(MIXED, K=2, seed=2)
    t_probs = compute_probs(t_logits, batch)
    t = sample_tokens(t_probs, batch.seeds, pos[:, None] + torch.arange(3), Stream.BONUS)
    d = t[:, :2].clone()
    d[0, 1] = (d[0, 1] + 1) % V  # row 0 mismatches at the second draft
    d[2, 0] = (d[2, 0] + 1) % V  # row 2 at the first
    r = strict_verify(d, t_logits, batch, pos)
    assert r.num_accepted.tolist() == [1, 2, 0, 2, 2]
    assert r.token_ids[0].tolist() == [t[0, 0], t[0, 1], -1]
    assert r.token_ids[2].tolist() == [t[2, 0], -1, -1]
    assert torch.equal(r.token_ids[1], t[1])
    s = DefaultSampler()
    for advanced in (False, True):  # K = 0: one token sampled from p
        k0 = s.verify(torch.zeros(5, 0, dtype=torch.int64), t_logits[:, :1], None, batch,
                      pos, advanced=advanced)
        assert k0.token_ids.shape == (5, 1) and k0.num_accepted.tolist() == [0] * 5
        assert torch.equal(k0.token_ids[:, 0], t[:, 0])


def test_all_greedy_strict_path_is_argmax():
    params = [SamplingParams(temperature=0)] * 3
    batch, t_logits, d_logits, pos = setup(params)
    d = d_logits.argmax(-1)
    r = DefaultSampler().verify(d, t_logits, None, batch, pos, advanced=False)
    top = t_logits.argmax(-1)
    n = (d == top[:, :3]).long().cumprod(1).sum(1)
    assert torch.equal(r.num_accepted, n)


def test_default_sampler_validates_method():
    with pytest.raises(ValueError):
        DefaultSampler(method="tree")


@pytest.mark.parametrize("use_rs,local,group", list(itertools.product(
    (False, True), (False, True), (None, False, True))))
def test_predicate_truth_table(use_rs, local, group):
    m = SpecMetadata(use_rejection_sampling=use_rs, is_all_greedy_sample=local,
                     group_all_greedy_sample=group)
    effective = local if group is None else group
    assert m.all_greedy is effective
    assert m.wants_advanced_draft_sampling is (use_rs and not effective)


def test_metadata_evolve_and_validation():
    m = SpecMetadata(use_rejection_sampling=True, is_all_greedy_sample=False)
    assert m.wants_advanced_draft_sampling
    synced = m.evolve(group_all_greedy_sample=True)  # a greedy group pulls this rank back
    assert not synced.wants_advanced_draft_sampling and m.wants_advanced_draft_sampling
    with pytest.raises(TypeError):
        SpecMetadata(use_rejection_sampling=1)
    with pytest.raises(TypeError):
        m.evolve(group_all_greedy_sample="yes")
