"""examples/plugin, as a user gets it: built and installed into a fresh venv next to
specloop (both as wheels), then named from TOML configs and run in a subprocess. Its
drafter ("successor") is greedy exact against method = "none", its observer ("acceptance")
sees every iteration, the drafter's can_graph decides whether DRAFT is captured and
replayed, and all of it holds under 2 LocalGroup ranks with ADP."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path
from typing import Any

import pytest

from specloop.models.testing import write_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "examples" / "plugin"
RUNNER = Path(__file__).with_name("run_plugin.py")

pytestmark = pytest.mark.timeout(600)
EXCERPT = re.compile(r"^```python no-run: excerpt of (?P<path>\S+)\n(?P<code>.*?)^```$",
                     re.M | re.S)


@pytest.fixture(scope="module")
def plugin_venv(tmp_path_factory, project_wheels) -> Path:
    """A fresh venv with specloop and the plugin installed from wheels; torch & co. come
    from this environment's site-packages through a .pth file (not reinstalled)."""
    tmp = tmp_path_factory.mktemp("plugin")
    wheels = [project_wheels["specloop"], project_wheels["specloop_example_plugin"]]
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], check=True, capture_output=True,
                               text=True).stdout.strip())
    # Appended after the venv's own site-packages: specloop comes from the wheel.
    (site / "_project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    *map(str, wheels)], check=True, capture_output=True)
    return venv


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("plugin-configs")
    model = write_tiny_checkpoint(tmp / "tiny", vocab_size=384, num_layers=2, hidden=64, seed=3)
    base = f'''
[model]
name = "{model}"
dtype = "float64"
device = "cpu"
max_seq_len = 128
chat_template = false

[scheduler]
max_batch_size = 4
'''
    spec = '''
[speculative]
method = "{method}"
num_draft_tokens = 3
'''
    out = {}
    for name, method, extra in [
        ("none", "none", ""),
        ("plugin", "successor", '[components]\nobservers = ["acceptance"]\n'),
        ("graphs", "successor", '[components]\nobservers = ["acceptance"]\n'
                                'graph_cache = "run_plugin:KeepStepCache"\n'),
        ("nographs", "run_plugin:NoGraphSuccessor",
         '[components]\nobservers = ["acceptance"]\ngraph_cache = "run_plugin:KeepStepCache"\n'),
        ("adp2", "successor", '[components]\nobservers = ["acceptance"]\n'
                              '[parallel]\nworld_size = 2\nattention_dp = true\n'),
    ]:
        path = out[name] = tmp / f"{name}.toml"
        path.write_text(base + spec.format(method=method) + extra)
    return out


def run(venv: Path, mode: str, *paths: Path) -> Any:
    result = subprocess.run([str(venv / "bin" / "python"), str(RUNNER), mode, *map(str, paths)],
                            capture_output=True, text=True, timeout=500, cwd=RUNNER.parent)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def check_observer(rank: dict) -> None:
    """The acceptance observer saw every iteration and every VERIFY row: its histogram
    adds up to the engine's own counters."""
    (observer,) = rank["observers"]
    stats = rank["stats"]
    assert observer["type"] == "AcceptanceObserver"
    assert observer["verify_iterations"] == stats["num_iterations"] > 0
    assert observer["iterations"] >= stats["num_iterations"]
    histogram = observer["histogram"]
    assert len(histogram) == 4
    assert sum(histogram) == stats["num_verify_rows"]
    assert sum(n * c for n, c in enumerate(histogram)) == stats["num_accepted_tokens"]


@pytest.fixture(scope="module")
def runs(plugin_venv, configs) -> dict:
    """Every CPU run in one process of the venv (each process imports torch): where
    specloop and the plugin come from, the four single-rank configs, the ADP one."""
    return run(plugin_venv, "all", *(configs[n] for n in ("none", "plugin", "graphs",
                                                          "nographs", "adp2")))


@pytest.mark.slow
def test_plugin_is_installed_and_registered(plugin_venv, runs):
    venv, found = plugin_venv, runs["registry"]
    # Imported from the venv's wheels, in the very process that ran the engine.
    assert found["engine_file"].startswith(str(venv)), found
    assert found["plugin_file"].startswith(str(venv)), found
    assert found["drafters"]["successor"] == "specloop_example_plugin:SuccessorDrafter"
    assert found["observers"] == {"acceptance": "specloop_example_plugin:AcceptanceObserver"}


def test_docs_excerpts_match_the_plugin_source():
    text = (ROOT / "docs" / "plugins.md").read_text()
    excerpts = list(EXCERPT.finditer(text))
    assert len(excerpts) >= 3
    for m in excerpts:
        assert m["path"].startswith("examples/plugin/")
        # Methods, shown dedented.
        assert textwrap.indent(m["code"], "    ") in (ROOT / m["path"]).read_text(), m["code"]


def test_plugin_uses_only_the_public_api():
    """Every ``from specloop.<pkg> import names`` of the plugin names a public package
    and names in its __all__."""
    import importlib

    for path in (PLUGIN / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("specloop") for a in node.names), path
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specloop."):
                assert not any(part.startswith("_") for part in node.module.split(".")), path
                public = importlib.import_module(node.module).__all__
                assert {a.name for a in node.names} <= set(public), (path, node.module)


@pytest.mark.slow
def test_greedy_exact_observed_and_graphs_where_the_drafter_says(runs):
    none, plugin, graphs, nographs = runs["single"]
    assert none["ranks"][0]["drafter"] is None
    for result in (plugin, graphs, nographs):
        assert result["tokens"] == none["tokens"]
        check_observer(result["ranks"][0])
    assert plugin["ranks"][0]["drafter"] == "specloop_example_plugin._drafter.SuccessorDrafter"
    assert plugin["ranks"][0]["stats"]["num_accepted_tokens"] > 0   # it drafts something
    assert plugin["ranks"][0]["graphs"] == {}                        # eager cache
    # can_graph True: DRAFT is captured next to VERIFY for every variant, and replayed.
    captured = graphs["ranks"][0]["graphs"]
    verify = {k.partition("/")[2] for k in captured if k.startswith("verify/")}
    draft = {k.partition("/")[2]: n for k, n in captured.items() if k.startswith("draft/")}
    assert verify and set(draft) == verify
    assert sum(draft.values()) > 0
    # can_graph False: VERIFY is still captured, DRAFT never.
    captured = nographs["ranks"][0]["graphs"]
    assert any(k.startswith("verify/") for k in captured)
    assert not any(k.startswith("draft/") for k in captured)


@pytest.mark.slow
def test_two_ranks_with_adp(runs):
    none, (adp2,) = runs["single"][0], runs["adp2"]
    assert adp2["tokens"] == none["tokens"]
    for rank in adp2["ranks"]:
        assert rank["drafter"] == "specloop_example_plugin._drafter.SuccessorDrafter"
        check_observer(rank)
    # Both ranks served requests (least-loaded routing spreads the 5 prompts).
    assert all(rank["stats"]["num_verify_rows"] > 0 for rank in adp2["ranks"])


@pytest.mark.slow
@pytest.mark.gpu
def test_cuda_graphs_capture_and_replay_the_drafter(plugin_venv, configs, tmp_path):
    config = tmp_path / "cuda.toml"
    text = configs["plugin"].read_text().replace('device = "cpu"', 'device = "cuda"')
    config.write_text(text.replace('dtype = "float64"', 'dtype = "float32"')
                      + 'graph_cache = "cuda"\n')
    none = tmp_path / "none-cuda.toml"
    none.write_text(configs["none"].read_text().replace('device = "cpu"', 'device = "cuda"')
                    .replace('dtype = "float64"', 'dtype = "float32"'))
    plain, graphs = run(plugin_venv, "single", none, config)
    assert graphs["tokens"] == plain["tokens"]
    check_observer(graphs["ranks"][0])
    draft = {k: n for k, n in graphs["ranks"][0]["graphs"].items() if k.startswith("draft/")}
    assert draft and sum(draft.values()) > 0
