"""Every Python and TOML example in docs/ and the README runs, so the docs cannot drift.

Fenced blocks are collected by their info string:
- ```python: executed, in order, in one namespace per file (later blocks may use earlier
  ones' names; ``tmp_path`` is predefined), with the repository root as the working
  directory; top-level ``await`` runs in an event loop, and ``test_*`` functions an
  example defines are called;
- ```toml: parsed, then validated as an EngineConfig;
- either followed by ``no-run`` (e.g. ```python no-run: needs SmolLM2): only
  compiled / parsed. The marker is visible in the docs' source, never implied.
Blocks with another or no language (shell, signatures, diagrams) are not examples.
The shipped example configs are validated too.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
import tomllib
from pathlib import Path

import attrs
import pytest
import structlog

from specloop.engine import ConfigError, EngineConfig

# An example that unexpectedly loads a real model would stall here: fail it early instead.
pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^`\n]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.M | re.S)
CONFIG_SECTIONS = {a.name for a in attrs.fields(EngineConfig)}


@attrs.frozen
class Block:
    path: Path
    line: int
    lang: str
    run: bool
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        words = m["info"].replace(":", " ").split()
        if not words or words[0] not in ("python", "toml"):
            continue
        indent = len(m["indent"])
        code = "".join(line[indent:] for line in m["body"].splitlines(keepends=True))
        line = text.count("\n", 0, m.start()) + 1
        found.append(Block(path, line, words[0], "no-run" not in words[1:], code))
    return found


@pytest.fixture
def restore_structlog():
    # The logging examples call structlog.configure(); the session's setup comes back after.
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_the_collector_sees_examples_and_markers():
    # Guard against a regex that silently matches nothing: the docs hold dozens.
    every = [b for p in DOCS for b in blocks(p)]
    assert sum(b.lang == "python" and b.run for b in every) >= 10
    assert sum(b.lang == "toml" and b.run for b in every) >= 2
    assert any(not b.run for b in every)


def run_block(block: Block, namespace: dict) -> None:
    """Execute one example; top-level ``await`` runs in a fresh event loop, and any
    ``test_*`` function the example defines is called too (an example test must pass)."""
    code = compile(block.code, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    before = set(namespace)
    result = eval(code, namespace)  # noqa: S307 - the docs' own examples
    if inspect.iscoroutine(result):
        asyncio.run(result)
    for name in sorted(set(namespace) - before):
        if name.startswith("test_") and callable(namespace[name]):
            out = namespace[name]()
            if inspect.iscoroutine(out):
                asyncio.run(out)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_examples_run(path, monkeypatch, tmp_path, restore_structlog):
    monkeypatch.chdir(ROOT)
    # What the examples may assume: a scratch folder, as in a test.
    namespace: dict = {"__name__": f"docs_example_{path.stem}", "tmp_path": tmp_path}
    for block in blocks(path):
        if block.lang != "python":
            continue
        if not block.run:
            compile(block.code, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            continue
        try:
            run_block(block, namespace)
        except Exception as exc:
            raise AssertionError(f"example at {block.where} fails: {exc!r}") from exc


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_toml_examples_are_valid_configs(path):
    for block in blocks(path):
        if block.lang != "toml":
            continue
        data = tomllib.loads(block.code)
        if block.run:
            assert set(data) <= CONFIG_SECTIONS, f"{block.where}: not an engine config"
            EngineConfig.from_dict(data)


@pytest.mark.parametrize("path", sorted([*ROOT.glob("examples/*.toml"),
                                         *ROOT.glob("engine/defaults/*.toml")]),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_configs_are_valid(path):
    if path.name.startswith("train-"):      # `specloop train-draft` configs
        from specloop.train import TrainConfig  # noqa: PLC0415
        TrainConfig.from_toml(path)
        return
    EngineConfig.from_toml(path)



# configuration.md quotes these errors verbatim (gates table, loading rules, field rows).
QUOTED_ERRORS = [
    {"speculative": {"num_draft_tokens": 0}},
    {"model": {"foo": "foo"}},
    {"scheduler": {"max_batch_size": "4"}},
    {"speculative": {"use_rejection_sampling": "false"}},
    {"parallel": {"lm_head_tp_in_adp": True}},
    {"speculative": {"use_rejection_sampling": True}, "parallel": {"context_parallel_size": 2}},
    {"parallel": {"context_parallel_size": 2}},
    {"parallel": {"world_size": 2}},
    {"speculative": {"method": "draft_model"}},
    {"parallel": {"collective_timeout_s": 0.01}},
    {"speculative": {"ngram_min": 4}},
    {"speculative": {"early_exit_layers": 0}},
    {"speculative": {"method": "none"}, "components": {"drafter": "ngram"}},
    {"components": {"drafter": "eagle9"}},
]


@pytest.mark.parametrize("data", QUOTED_ERRORS, ids=str)
def test_configuration_md_quotes_the_errors_the_code_gives(data):
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict(data)
    text = " ".join((ROOT / "docs" / "configuration.md").read_text().split())
    assert str(info.value) in text, f"configuration.md does not quote: {info.value}"


def test_docs_name_what_the_component_protocols_declare():
    """configuration.md's factory table names every member of each protocol it lists member
    by member; every doc that writes pick's signature gives the pair it returns; the
    drafter list of internal-api.md names every built-in drafter and its registered name."""
    from specloop.engine._components import _BUILTINS, protocol_members, protocol_of  # noqa: PLC0415

    table = (ROOT / "docs" / "configuration.md").read_text().splitlines()
    for kind in ("sampler", "graph_cache", "drafter", "observer"):
        row = next(line for line in table
                   if line.startswith(f"| `{kind}` | `factory("))
        missing = [m for m in sorted(protocol_members(protocol_of(kind))) if f"`{m}" not in row]
        assert not missing, f"configuration.md's {kind} row omits {missing}"
    picks = [(path.name, m[1]) for path in DOCS
             for m in re.finditer(r"pick\(batch_size[^)]*\)\s*->\s*(\S+ \S+|\S+)",
                                  path.read_text())]
    assert len(picks) >= 3 and all(result.startswith("(GraphKey, captured)")
                                   for _, result in picks), picks
    api = " ".join((ROOT / "docs" / "internal-api.md").read_text().split())
    drafters = api[api.index("- drafters (`models/drafters`)"):].split(" - ")[0]
    for name, target in _BUILTINS["drafter"].items():
        assert f"`{name}`" in drafters and f"`{target.split(':')[1]}`" in drafters, name


def test_configuration_md_lists_every_environment_variable():
    """Every ``SPECLOOP_*`` name the installed packages read appears in configuration.md's
    "Environment variables" table, and the table names none the code does not read."""
    pkgs = ("engine", "samplers", "comm", "graphs", "models", "serve", "train")
    used = {name for pkg in pkgs for path in (ROOT / pkg).rglob("*.py")
            for name in re.findall(r'"(SPECLOOP_[A-Z0-9_]+)"', path.read_text())}
    text = (ROOT / "docs" / "configuration.md").read_text()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(SPECLOOP_[A-Z0-9_]+)` \|", section, re.M))
    assert used, "no SPECLOOP_* variable found: the scan is broken"
    assert used - listed == set(), f"read by the code, missing from the table: {used - listed}"
    assert listed - used == set(), f"in the table, read by no code: {listed - used}"
