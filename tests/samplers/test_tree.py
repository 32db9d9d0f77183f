"""Static draft trees (samplers/_tree.py): their shape, the best tree for measured rank
paths, and greedy verification against a plain-Python walk of the tree."""

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specloop.samplers._tree import DraftTree, TreeTables, accept_tree, best_tree


def test_a_chain_is_a_tree_of_one_path():
    tree = DraftTree.chain(3)
    assert tree.size == tree.depth == 3
    assert tree.parents == (0, 0, 1, 2)
    assert tree.depths == (0, 1, 2, 3)
    assert tree.ancestors == ((0, 0, 0, 0), (0, 1, 1, 1), (0, 1, 2, 2), (0, 1, 2, 3))
    assert torch.equal(tree.visible(), torch.ones(4, 4, dtype=torch.bool).tril())


def test_nodes_are_ordered_by_depth_and_know_their_ancestors():
    tree = DraftTree([(0, 0), (1,), (0,), (0, 1), (1, 0), (0, 0, 0)])
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert tree.parents == (0, 0, 0, 1, 1, 2, 3)
    assert tree.depths == (0, 1, 1, 2, 2, 2, 3)
    assert tree.ancestors[5] == (0, 2, 5, 5)        # (1, 0): root, (1,), itself
    assert tree.ancestors[6] == (0, 1, 3, 6)        # (0, 0, 0)
    assert tree.children() == {0: [1, 2], 1: [3, 4], 2: [5], 3: [6]}
    visible = tree.visible()
    assert visible[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert not visible[3, 4] and not visible[4, 3]  # siblings never see each other


@pytest.mark.parametrize("paths, words", [
    ([], "at least one node"),
    ([(0,), (0,)], "repeated"),
    ([(0, 0)], "no parent"),
    ([(0,), (-1,)], "ranks >= 0"),
    ([()], "non-empty"),
])
def test_a_malformed_tree_is_refused_naming_the_node(paths, words):
    with pytest.raises(ValueError, match=words):
        DraftTree(paths)


def _mean_accepted(tree: DraftTree, rank_paths) -> float:
    nodes = set(tree.paths)
    total = 0
    for ranks in rank_paths:
        n = 0
        while n < len(ranks) and tuple(ranks[:n + 1]) in nodes:
            n += 1
        total += n
    return total / len(rank_paths)


def _all_trees(size: int, depth: int, max_rank: int):
    """Every tree of ``size`` nodes, ranks < max_rank, at most ``depth`` deep."""
    candidates = [p for d in range(1, depth + 1)
                  for p in itertools.product(range(max_rank), repeat=d)]
    for chosen in itertools.combinations(candidates, size):
        try:
            yield DraftTree(chosen)
        except ValueError:
            pass


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=3, max_size=3), min_size=1,
                max_size=40), st.integers(1, 4))
def test_the_best_tree_accepts_at_least_as_much_as_any_tree_of_its_size(rank_paths, size):
    """Brute force over every tree of ``size`` nodes with ranks < 3 and depth <= 3:
    none accepts more on the starts the best tree was chosen for."""
    best = best_tree(rank_paths, size, 3)
    assert best.size <= size and best.depth <= 3
    got = _mean_accepted(best, rank_paths)
    assert all(_mean_accepted(tree, rank_paths) <= got + 1e-12
               for tree in _all_trees(size, 3, 3))


def test_the_best_tree_of_k_nodes_for_top1_drafts_is_the_chain():
    rank_paths = [[0, 0, 0, 1]] * 10 + [[0, 0, 1, 0]] * 3 + [[1, 0, 0, 0]] * 2
    assert best_tree(rank_paths, 3, 4) == DraftTree.chain(3)
    # The deeper second choice (10 starts) before the sibling (3) and the root's (2).
    assert best_tree(rank_paths, 5, 4).paths == ((0,), (0, 0), (0, 0, 0), (0, 0, 1),
                                                 (0, 0, 0, 1))
    assert best_tree(rank_paths, 5, 3).paths == ((0,), (1,), (0, 0), (0, 0, 0), (0, 0, 1))
    # A second choice without the first where only it was ever right.
    assert best_tree([[0, 1, 0]] * 3, 3, 3).paths == ((0,), (0, 1), (0, 1, 0))


def _walk(tree: DraftTree, tokens: list[int], target: list[int]) -> tuple[list[int], int]:
    """Greedy verification in plain Python: a row is accepted when every row on its
    path from the root holds the target's token after its parent; the deepest accepted
    row (the first in the tree's order among equals: siblings repeating a token) ends
    the path. -> (tokens emitted: the path's, then the target's after it; accepted)."""
    def accepted(row: int) -> bool:
        while row:
            parent = tree.parents[row]
            if tokens[row] != target[parent]:
                return False
            row = parent
        return True

    end = max((r for r in range(tree.size + 1) if accepted(r)),
              key=lambda r: (tree.depths[r], -r))
    path = [r for r in tree.ancestors[end][:tree.depths[end] + 1]]
    return [tokens[r] for r in path[1:]] + [target[end]], tree.depths[end]


@st.composite
def trees(draw):
    paths: list[tuple[int, ...]] = [(0,)]
    for _ in range(draw(st.integers(0, 10))):
        parent = draw(st.sampled_from([()] + paths))
        rank = sum(1 for p in paths if p[:-1] == parent and len(p) == len(parent) + 1)
        paths.append(parent + (rank,))
    return DraftTree(paths)


@settings(max_examples=200, deadline=None)
@given(trees(), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_greedy_verification_emits_what_the_walk_down_the_tree_emits(tree, batch, seed):
    """Tokens from a vocabulary of 3, so matches, sibling repeats (a first one wins) and
    full acceptance all occur."""
    rng = random.Random(seed)
    rows = tree.size + 1
    tokens = [[rng.randrange(3) for _ in range(rows)] for _ in range(batch)]
    target = [[rng.randrange(3) for _ in range(rows)] for _ in range(batch)]
    got = accept_tree(TreeTables.of(tree, "cpu"), torch.tensor(tokens),
                        torch.tensor(target))
    for b in range(batch):
        emitted, n = _walk(tree, tokens[b], target[b])
        assert int(got.num_accepted[b]) == n
        assert got.token_ids[b, :n + 1].tolist() == emitted
        assert (got.token_ids[b, n + 1:] == -1).all()
        path = got.path[b].tolist()
        assert path[0] == 0 and [tokens[b][r] for r in path[1:n + 1]] == emitted[:n]
        assert tree.depths[path[n]] == n


def test_a_chain_tree_verifies_as_the_chain():
    from specloop.samplers._sampler import strict_from_targets

    gen = torch.Generator().manual_seed(0)
    drafts = torch.randint(0, 3, (64, 4), generator=gen)
    target = torch.randint(0, 3, (64, 5), generator=gen)
    tokens = torch.cat([torch.zeros(64, 1, dtype=torch.int64), drafts], dim=1)
    tree = accept_tree(TreeTables.of(DraftTree.chain(4), "cpu"), tokens, target)
    chain = strict_from_targets(drafts, target)
    assert torch.equal(tree.num_accepted, chain.num_accepted)
    assert torch.equal(tree.token_ids, chain.token_ids)
