"""bench/ngram_match_study.py replays greedy n-gram speculation on the host with the
engine's drafter (``NgramDrafter.match_row``): the match length it reports must be the
longest suffix that occurred earlier, and the replay must commit the continuation, or its
shares and ALs say nothing about the engine."""

import importlib
import random
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def study(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("ngram_match_study")


def longest_match(tokens, n_min, n_max):
    """The longest n in n_min..n_max whose suffix occurred earlier, ending before the last
    token (0: none), by brute force."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        if any(tokens[s:s + n] == tokens[-n:] for s in range(len(tokens) - n)):
            return n
    return 0


@pytest.mark.parametrize("seed", range(40))
def test_the_match_length_is_the_longest_earlier_suffix(study, seed):
    rng = random.Random(seed)
    vocab, k = rng.choice([2, 3, 6, 40]), rng.randint(1, 5)
    n_min = rng.randint(1, 3)
    n_max = rng.randint(n_min, 4)
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(2, 40))]
    drafter = study.ngram_drafter(k, n_max, n_min)
    for cut in range(1, len(tokens), 4):      # its table filled a prefix at a time
        drafter.match_row(0, tokens[:cut], k)
    n, drafts = drafter.match_row(0, tokens, k)
    assert n == longest_match(tokens, n_min, n_max)
    assert drafts == drafter.propose_row(0, tokens, k) and len(drafts) == k


def test_a_replay_commits_the_continuation(study):
    """Accepted drafts + one token an iteration add up to the continuation, for the plain
    replay, the gated one (no draft below the minimum match) and the one-late gate."""
    rng = random.Random(0)
    prompt = [rng.randrange(5) for _ in range(30)]
    continuation = [rng.randrange(5) for _ in range(60)]
    for gate in ({}, {"min_match": 2}, {"min_match": 2, "late": True}):
        its = study.replay(prompt, continuation, 4, 3, 1, **gate)
        # The prefill gives the first token; the last iteration's bonus may fall past the
        # end (the engine stops there).
        assert 1 + sum(a + 1 for _, _, a in its[:-1]) < len(continuation) \
            <= 1 + sum(a + 1 for _, _, a in its)
        # Nothing is accepted where nothing was drafted; the gate drafts as it says.
        assert all(d or a == 0 for _, d, a in its)
        if gate and not gate.get("late"):
            assert all(d == (n >= 2) for n, d, _ in its)
    assert any(a for _, _, a in study.replay(prompt, continuation, 4, 3, 1))
