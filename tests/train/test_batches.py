"""Training batches are a function of the step (resumable); length buckets keep that and
hand out every drawn sequence once, in length-homogeneous batches."""

import random

import attrs

from specloop.train._config import OptimSection
from specloop.train._distill import Sequence
from specloop.train._trainer import batch_at


def _seqs(n=100):
    gen = random.Random(0)
    return [Sequence(tuple(range(gen.randint(5, 60))), 3, "train", "greedy") for _ in range(n)]


def test_plain_batches_are_the_legacy_draw():
    seqs, cfg = _seqs(), OptimSection(batch_size=8, seed=2)
    got = batch_at(seqs, cfg, 5, random.Random())
    rng = random.Random()
    rng.seed(2 * 1_000_003 + 5)
    assert got == rng.sample(seqs, 8)


def test_length_buckets_cover_the_draw_once_in_sorted_slices():
    seqs = _seqs()
    cfg = attrs.evolve(OptimSection(batch_size=8, seed=1), length_buckets=4)
    for group in range(3):
        batches = [batch_at(seqs, cfg, 4 * group + i, random.Random()) for i in range(4)]
        assert batches == [batch_at(seqs, cfg, 4 * group + i, random.Random(9))
                           for i in range(4)]                              # f(step) only
        ids = [id(s) for b in batches for s in b]
        assert len(ids) == 32 and len(set(ids)) == 32                      # disjoint
        spans = sorted((min(len(s.tokens) for s in b), max(len(s.tokens) for s in b))
                       for b in batches)
        assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:]))  # sorted slices
    # Unbucketed batches of the same data pad far more (the biased twin of the check).
    plain = [batch_at(seqs, attrs.evolve(cfg, length_buckets=1), i, random.Random())
             for i in range(4)]
    spread = [max(len(s.tokens) for s in b) - min(len(s.tokens) for s in b) for b in plain]
    assert sum(spread) > 2 * sum(hi - lo for lo, hi in spans)
