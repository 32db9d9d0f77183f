"""bench/ngram_match_study.py replays greedy n-gram speculation on the host: its drafts
must be the engine's (``NgramDrafter.propose_row``), and its iterations must commit the
continuation exactly, or its shares and ALs say nothing about the engine."""

import importlib
import random
import types
from pathlib import Path

import pytest

from specloop.models.drafters import NgramDrafter

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def study(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("ngram_match_study")


def engine_drafts(tokens, k, n_min, n_max):
    spec = types.SimpleNamespace(num_draft_tokens=k, ngram_min=n_min, ngram_max=n_max,
                                 adaptive=False)
    drafter = NgramDrafter(types.SimpleNamespace(speculative=spec),
                           types.SimpleNamespace(target_cache=None))
    for cut in range(1, len(tokens), 4):      # its table filled a prefix at a time
        drafter.propose_row(0, tokens[:cut], k)
    return drafter.propose_row(0, tokens, k)


@pytest.mark.parametrize("seed", range(40))
def test_the_study_drafts_what_the_engine_drafts(study, seed):
    rng = random.Random(seed)
    vocab, k = rng.choice([2, 3, 6, 40]), rng.randint(1, 5)
    n_min = rng.randint(1, 3)
    n_max = rng.randint(n_min, 4)
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(2, 40))]
    _, drafts = study.propose(tokens, k, n_max, n_min)
    assert drafts == engine_drafts(tokens, k, n_min, n_max)


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
