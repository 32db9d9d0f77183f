"""The type check runs in `make test`: mypy, strict on the public packages, the component
protocols and the built-in components (configured in pyproject.toml, run by
scripts/typecheck.py), passes;
and it is not vacuous: a built-in that loses or changes a member fails it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "typecheck.py"

# One worker at a time uses the mypy cache (.cache/mypy).
pytestmark = [pytest.mark.timeout(180), pytest.mark.xdist_group("typecheck")]


def typecheck(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=170)


def test_mypy_passes_on_the_protocols_and_builtins():
    result = typecheck()
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("Success"), result.stdout


def test_every_package_is_checked_whole():
    """Strict on all of specloop: each top-level package of the layout is a target as a
    folder (a new module is checked without being listed)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.split(".")[1] for p in config["tool"]["setuptools"]["package-dir"]}
    files = config["tool"]["mypy"]["files"]
    assert {"engine", "models", "serve"} <= packages
    assert [f for f in files if "/specloop/" in f] == sorted(
        f".cache/typecheck/specloop/{p}" for p in packages)


def _without_method(source: str, cls: str, name: str) -> str:
    """``source`` with the method ``cls.name`` removed."""
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    kept = [n for n in node.body if getattr(n, "name", None) != name]
    assert len(kept) == len(node.body) - 1
    node.body = kept
    return ast.unparse(tree) + "\n"


def test_a_builtin_that_loses_or_changes_a_member_fails(tmp_path):
    ngram = (ROOT / "models/drafters/_ngram.py").read_text()
    ngram = ngram.replace("from ._protocol", "from specloop.models.drafters._protocol")
    assert "async def propose" in ngram
    lost = _without_method(ngram, "NgramDrafter", "propose")
    (tmp_path / "lost_propose.py").write_text(lost + '''

def conform(config: Any, deps: DrafterDeps) -> Drafter:
    return NgramDrafter(config, deps)
''')
    (tmp_path / "changed_members.py").write_text('''
from typing import Any, Callable, Sequence

import torch

from specloop.samplers import Sampler, SamplingBatch

from specloop.comm import SingleRankCommunicator
from specloop.graphs import EagerGraphCache, GraphCache
from specloop.models.drafters import Drafter, DraftContext, DraftProposal


class SealTakesAnArgument(EagerGraphCache):
    def seal(self, force: bool) -> None:
        pass


class CloseIsAsync(SingleRankCommunicator):
    async def close(self) -> None:
        pass


class Structural:
    """Every Drafter member but needs_empty_calls, without subclassing the protocol."""

    num_draft_tokens = 2
    point_mass = True
    feature_layers: tuple[int, ...] = ()
    variable_k: bool = False
    drafts_trees: bool = False

    def prefill(self, slot: int, token_ids: Sequence[int], hidden: torch.Tensor | None
                ) -> None:
        pass

    async def propose(self, ctx: DraftContext) -> DraftProposal:
        raise NotImplementedError

    def release(self, slot: int) -> None:
        pass

    def on_verified(self, slots: Sequence[int], start_pos: Sequence[int],
                    hidden: torch.Tensor, num_accepted: Sequence[int]) -> None:
        pass

    def can_graph(self, advanced: bool) -> bool:
        return False

    def graph_step(self, sampler: Sampler, template: SamplingBatch, *, advanced: bool
                   ) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        raise NotImplementedError

    def graph_inputs(self, ctx: DraftContext) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def tree_graph_step(self, sampler: Sampler, template: SamplingBatch, tree: Any
                        ) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        raise NotImplementedError

    can_chain: bool = False

    def prefill_many(self, slots: Sequence[int], token_ids: Sequence[Sequence[int]],
                     hidden: Sequence[torch.Tensor | None]) -> None:
        pass

    def chained_inputs(self, verified: dict[str, torch.Tensor], start: Sequence[int],
                       slots: Sequence[int], sampling: SamplingBatch,
                       into: dict[str, torch.Tensor] | None = None,
                       tokens: Sequence[Sequence[int]] | None = None,
                       continued: bool = False
                       ) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    chains_through_k0: bool = False
    chains_joiners: bool = False

    def joining_rows(self, slots: Sequence[int]) -> torch.Tensor | None:
        return None

    num_draft_classes: int = 0

    def draft_classes(self, slots: Sequence[int], token_ids: Sequence[Sequence[int]]
                      ) -> list[int]:
        raise NotImplementedError

    def chained_consumed(self, slots: Sequence[int]) -> None:
        pass

    def prefill_graphs(self, shapes: Sequence[tuple[int, int]], replay: Any) -> list[Any]:
        return []

    def warm_up_eager(self, max_batch_size: int, sampler: Sampler) -> None:
        pass


def conform() -> None:
    cache: GraphCache = SealTakesAnArgument()
    drafter: Drafter = Structural()
''')
    result = typecheck(str(tmp_path / "lost_propose.py"), str(tmp_path / "changed_members.py"))
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert re.search(r'lost_propose.py:\d+: error: Cannot instantiate abstract class '
                     r'"NgramDrafter" with abstract attribute "propose"', out), out
    assert re.search(r'changed_members.py:\d+: error: Signature of "seal" incompatible', out), out
    assert re.search(r'changed_members.py:\d+: error: .*"close"', out), out
    assert re.search(r'changed_members.py:\d+: error: Incompatible types in assignment '
                     r'\(expression has type "Structural", variable has type "Drafter"\)', out), out
    assert re.search(r'note: "Structural" is missing following "Drafter" protocol member:\n'
                     r'.*note: +needs_empty_calls\n', out), out
