"""Strict verification of a draft tree keeps the target's distribution (samplers/_tree.py
``accept_tree`` of ``Sampler.strict_targets``), by the project's per-position chi-square
(specloop.samplers._stats: bins of expected count < 5 merged, pass if
chi2 < df + 10 sqrt(2 df)).

Each tree row has its own target distribution p_r (the target after that row's path: in a
real tree every node conditions on another prefix), V = 32 at T = 0.8 with top-p 0.95, and
the drafts are a good drafter's (a row's children the top tokens of its p, rank by rank).
Among the 8,000 trials whose accepted path reached row r, the token emitted after it
(the accepted child's, or the bonus) must follow p_r: decoding without speculation draws
it from p_r. Two biased twins must fail the same test: the path's rows drawn with one
uniform (the root's position's) instead of one per position, and each row drawn from its
parent's distribution (a gather off by one level). The walk itself is checked against a
plain-Python walk in test_tree.py.
"""

from __future__ import annotations

import pytest
import torch

from specloop.samplers import DefaultSampler, SamplingBatch, SamplingParams, compute_probs
from specloop.samplers._tree import DraftTree, TreeTables, accept_tree

from ..chi2 import chi2_statistic

V, TRIALS, L = 32, 8_000, 500
TREE = DraftTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
PARAMS = SamplingParams(temperature=0.8, top_p=0.95)


def problem(seed: int = 0):
    """Per row: target logits [1 + N, V], their p, and the rows' tokens [1 + N] (the
    root's arbitrary; a node the rank-th token of its parent's p)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(TREE.size + 1, V, generator=g) * 2.5
    one = SamplingBatch.from_params([PARAMS], [0])
    p = compute_probs(logits.unsqueeze(0), one)[0]
    order = p.argsort(dim=-1, descending=True, stable=True)
    tokens = [7] + [int(order[TREE.parents[row], TREE.paths[row - 1][-1]])
                    for row in range(1, TREE.size + 1)]
    return logits, p, torch.tensor(tokens)


def run(tables: TreeTables, *, one_position: bool = False, parents_rows: bool = False):
    """(token_ids [T, D + 1], path [T, D + 1], num_accepted [T]) over TRIALS seeds."""
    logits, _, tokens = problem()
    if parents_rows:
        logits = logits[list(TREE.parents)]
    seeds = torch.arange(TRIALS, dtype=torch.int64) * 7919 + 3
    batch = SamplingBatch.from_params([PARAMS] * TRIALS, seeds.tolist())
    depths = torch.zeros_like(tables.depths) if one_position else tables.depths
    positions = (L + depths).expand(TRIALS, -1)
    target = DefaultSampler().strict_targets(logits.expand(TRIALS, -1, -1), batch, positions)
    out = accept_tree(tables, tokens.expand(TRIALS, -1), target)
    return out.token_ids, out.path, out.num_accepted


def per_row_chi2(tables: TreeTables, **kw) -> list[tuple[int, float, float, int]]:
    """(row, chi2, threshold, trials) for each row the walk reached often enough."""
    _, p, _ = problem()
    token_ids, path, n = run(tables, **kw)
    results = []
    for row in range(TREE.size + 1):
        d = TREE.depths[row]
        reached = (n >= d) & (path[:, d] == row)
        emitted = token_ids[reached, d]
        if emitted.numel() < 200:
            continue
        chi2, limit = chi2_statistic(emitted, p[row])
        results.append((row, chi2, limit, emitted.numel()))
    return results


@pytest.fixture(scope="module")
def tables():
    return TreeTables.of(TREE, "cpu")


def test_every_rows_emitted_token_follows_its_target_distribution(tables):
    results = per_row_chi2(tables)
    # The walk reached rows at every depth (the test covers the tree, not just the root).
    assert {TREE.depths[row] for row, *_ in results} == {0, 1, 2, 3}, results
    for row, chi2, limit, trials in results:
        assert chi2 < limit, f"row {row} ({trials} trials): chi2 {chi2:.1f} >= {limit:.1f}"


def test_one_uniform_for_the_whole_path_fails(tables):
    worst = max(chi2 - limit for _, chi2, limit, _ in per_row_chi2(tables, one_position=True))
    assert worst > 0, "drawing every depth with one uniform passed the chi-square test"


def test_drawing_each_row_from_its_parents_distribution_fails(tables):
    worst = max(chi2 - limit for _, chi2, limit, _ in per_row_chi2(tables, parents_rows=True))
    assert worst > 0, "drawing each row from its parent's distribution passed"
