"""Static draft trees, and their strict verification (docs/architecture.md, "Draft
trees").

A chain of K drafts verifies K + 1 rows per request, and a request accepts the drafts up
to its first miss. A tree verifies 1 + N rows: the root (the last committed token) and N
draft nodes, each a token proposed after its parent's. Verification is strict: every row
gets the target's token after it (``Sampler.strict_targets``: the argmax for a greedy row,
else a draw from the row's p at the position it predicts), and the longest root-to-node
path whose every token is its parent row's target token is accepted, so a miss at one
child can be made up by a sibling. That is exact for any drafts: along the path, each
emitted token is the target's draw at its position given the tokens before it, and the
draws at different positions are independent (siblings share a position's draw; one of
them at most is on the path). Greedy rows emit what greedy decoding would, and a seeded
sampled row what it would emit without speculation. At batch 1 on the H200 VERIFY's GEMMs
should cost about the same for 4 rows as for 16 (the one-tile ``tl.dot`` pads rows to 16;
on the CPU each row costs its GEMMs' arithmetic, ~3 ms of one core for SmolLM2), and
``bench/tree_acceptance.py`` puts the shipped eagle3 head's acceptance length at 2.46-2.59
with 15 nodes of depth 3 against 1.95-2.00 for the chain of 3 (offline, greedy, held-out
chat prompts on SmolLM2; 2.55 against 2.06 through the engine).

A node is named by its PATH, the tuple of sibling ranks from the root: (0,) is the
drafter's first choice after the root, (1,) its second, (0, 0) the first choice after
(0,). The chain of K is (0,), (0, 0), ..., (0,) * K. A tree's nodes are ordered by depth,
then path (``DraftTree.paths``): node i of the VERIFY row is ``paths[i - 1]``; a node's
index is always larger than its parent's and at least its depth.
"""

from __future__ import annotations

import functools
from typing import Iterable, Sequence

import attrs
import torch

Path = tuple[int, ...]


def _check_paths(paths: Sequence[Path]) -> None:
    """Every path non-empty, of ranks >= 0, unique, and its parent (all but its last
    rank) a node too or the root. A node may leave out an elder sibling: the drafter
    ranks a row's candidates and drafts the ranks its tree names."""
    seen = set(paths)
    if len(seen) != len(paths):
        raise ValueError(f"draft tree: repeated paths in {list(paths)}")
    for path in paths:
        if not path or any(not isinstance(r, int) or r < 0 for r in path):
            raise ValueError(f"draft tree: a path is a non-empty tuple of ranks >= 0, "
                             f"got {path!r}")
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"draft tree: node {path} has no parent {path[:-1]}")


def _in_order(paths: Iterable[Sequence[int]]) -> tuple[Path, ...]:
    """The paths as tuples, by depth, then path (the tree's row order)."""
    return tuple(sorted((tuple(p) for p in paths), key=lambda p: (len(p), p)))


@attrs.frozen
class DraftTree:
    """A static tree of ``size`` draft nodes under the root (see the module doc)."""

    paths: tuple[Path, ...] = attrs.field(converter=_in_order)

    def __attrs_post_init__(self) -> None:
        if not self.paths:
            raise ValueError("draft tree: at least one node")
        _check_paths(self.paths)

    @classmethod
    def chain(cls, k: int) -> DraftTree:
        """The chain of ``k`` drafts as a tree."""
        return cls([(0,) * j for j in range(1, k + 1)])

    @property
    def size(self) -> int:
        """Draft nodes (VERIFY's rows per request less the root)."""
        return len(self.paths)

    @property
    def depth(self) -> int:
        """The longest path: drafts a request can accept, and the drafter's steps."""
        return len(self.paths[-1])

    @functools.cached_property
    def parents(self) -> tuple[int, ...]:
        """Per row (0 the root, i the node ``paths[i - 1]``): its parent's row (the root's
        is 0)."""
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        return (0,) + tuple(index.get(p[:-1], 0) for p in self.paths)

    @functools.cached_property
    def depths(self) -> tuple[int, ...]:
        """Per row: its depth (the root 0); the row's position is the root's + its depth."""
        return (0,) + tuple(len(p) for p in self.paths)

    @functools.cached_property
    def ancestors(self) -> tuple[tuple[int, ...], ...]:
        """Per row: the rows on its path at depths 0 .. ``depth``, the row itself repeated
        past its own depth (a gather along the accepted path reads these)."""
        out = []
        for row in range(self.size + 1):
            path = [row]
            while path[-1]:
                path.append(self.parents[path[-1]])
            path.reverse()
            out.append(tuple(path + [row] * (self.depth + 1 - len(path))))
        return tuple(out)

    def visible(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """bool [1 + N, 1 + N]: row q attends row k (k is q or one of its ancestors)."""
        rows = self.size + 1
        mask = torch.zeros(rows, rows, dtype=torch.bool)
        for q, path in enumerate(self.ancestors):
            mask[q, list(path)] = True
        return mask.to(device)

    def children(self) -> dict[int, list[int]]:
        """Per row with children: its children's rows, by rank."""
        out: dict[int, list[int]] = {}
        for row in range(1, self.size + 1):
            out.setdefault(self.parents[row], []).append(row)
        return out


def best_tree(rank_paths: Iterable[Sequence[int]], size: int, max_depth: int) -> DraftTree:
    """The static tree of ``size`` nodes (at most ``max_depth`` deep) that accepts most
    on the given starts: ``rank_paths`` holds, per start, the rank of the target's token
    among the drafter's choices at each depth along the true path (the first rank the
    drafter would not offer ends it; ``bench/tree_acceptance.py`` measures them). A tree
    accepts at a start the longest prefix of its rank path that is a node, so its mean
    accepted drafts are the sum over its nodes of the share of starts whose rank path
    begins with that node: the ``size`` most common prefixes (a prefix is at least as
    common as any extension of it, so with ties going to the shorter they form a tree:
    the heaviest ``size`` nodes of any tree, so none of that size accepts more)."""
    counts: dict[Path, int] = {}
    for ranks in rank_paths:
        for j in range(1, min(len(ranks), max_depth) + 1):
            counts[tuple(ranks[:j])] = counts.get(tuple(ranks[:j]), 0) + 1
    chosen = sorted(counts, key=lambda p: (-counts[p], len(p), p))[:size]
    if not chosen:
        raise ValueError("best_tree: no start had a rank the drafter offers")
    return DraftTree(chosen)


@attrs.frozen(eq=False)
class TreeTables:
    """A tree's index tables on a device, for ``accept_tree`` (built once per tree)."""

    parents: torch.Tensor      # [1 + N] i64
    depths: torch.Tensor       # [1 + N] i64
    ancestors: torch.Tensor    # [1 + N, D + 1] i64
    order: torch.Tensor        # [1 + N] i64: depth * (N + 1) + (N - row), the walk's score

    @classmethod
    def of(cls, tree: DraftTree, device: torch.device | str) -> TreeTables:
        n = tree.size
        depths = torch.tensor(tree.depths, dtype=torch.int64)
        rows = torch.arange(n + 1)
        return cls(torch.tensor(tree.parents, dtype=torch.int64, device=device),
                   depths.to(device),
                   torch.tensor(tree.ancestors, dtype=torch.int64, device=device),
                   (depths * (n + 1) + (n - rows)).to(device))


@attrs.frozen(eq=False)
class TreeAcceptance:
    """``accept_tree``'s result, in the chain's form where the engine reads it."""

    token_ids: torch.Tensor     # [B, D + 1] i64: the accepted drafts, the target's token
                                # after them at n, -1 past it (as a chain's verify)
    num_accepted: torch.Tensor  # [B] i64
    path: torch.Tensor          # [B, D + 1] i64: the rows of the accepted path (the
                                # deepest accepted row repeated past its depth)


def accept_tree(tables: TreeTables, tokens: torch.Tensor, target: torch.Tensor
                ) -> TreeAcceptance:
    """Strict verification of a tree (see the module doc): ``tokens`` [B, 1 + N] the root
    and the draft nodes (VERIFY's rows), ``target`` [B, 1 + N] the target's token after
    each row (``Sampler.strict_targets``). A node is accepted where its parent is and its
    token is the target's token at its parent; the accepted path ends at the deepest
    accepted node (siblings hold different tokens in a drafter's tree, so one path at most
    is accepted; where siblings repeat a token, the first in the tree's order among the
    deepest). Its tokens, then the target's token at its end, are what decoding without
    speculation would emit (greedy; or sampled with the same draws)."""
    parents, depth = tables.parents, tables.ancestors.shape[1] - 1
    # match[:, i]: node i's token is the target's after its parent (the root: True).
    match = tokens == target.index_select(1, parents)
    match[:, 0] = True
    # Accepted = every row on the path matches: all of the row's ancestors' matches.
    on_path = match[:, tables.ancestors.flatten()].view(*match.shape, depth + 1)
    accepted = on_path.all(dim=2)
    score = torch.where(accepted, tables.order, -1)
    best = score.argmax(dim=1)                                   # [B]
    path = tables.ancestors.index_select(0, best)                 # [B, D + 1]
    n = tables.depths.index_select(0, best)                       # [B]
    steps = torch.arange(depth + 1, device=tokens.device)
    drafts = tokens.gather(1, path)
    bonus = target.gather(1, best[:, None])
    token_ids = torch.where(steps < n[:, None], drafts.roll(-1, dims=1), bonus)
    token_ids = torch.where(steps <= n[:, None], token_ids, -1)
    return TreeAcceptance(token_ids, n, path)
