"""The distribution's shape: installed names, import directions, the built wheel."""

import ast
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["engine", "samplers", "comm", "graphs", "models", "models.drafters"]
# DESIGN.md: engine -> models, samplers, comm, graphs; models -> samplers, comm;
# graphs -> samplers; samplers and comm import nothing of the project.
ALLOWED = {
    "engine": {"engine", "models", "samplers", "comm", "graphs"},
    "models": {"models", "samplers", "comm"},
    "graphs": {"graphs", "samplers"},
    "samplers": {"samplers"},
    "comm": {"comm"},
}


def project_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            if name.startswith("specloop."):
                found.add(name.split(".")[1])
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_one_way(package):
    for path in (ROOT / package).rglob("*.py"):
        bad = project_imports(path) - ALLOWED[package]
        assert not bad, f"{path.relative_to(ROOT)} imports specloop.{sorted(bad)}"


def test_no_generic_top_level_names_installed():
    import specloop.engine
    assert not hasattr(sys.modules.get("engine"), "AsyncEngine")
    assert specloop.engine.__name__ == "specloop.engine"


@pytest.mark.slow
def test_built_wheel_installs_into_a_fresh_venv(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), str(ROOT)], check=True, capture_output=True)
    wheel = next(dist.glob("specloop-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True)
    # Dependencies (torch, attrs, ...) come from this environment's site-packages through
    # PYTHONPATH, which skips .pth files: the editable source tree stays out of reach.
    deps = sysconfig.get_paths()["purelib"]
    code = ("import importlib, specloop.engine as e;"
            f"[importlib.import_module('specloop.' + n) for n in {SUBPACKAGES!r}];"
            "print(e.__file__)")
    out = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True,
                         env={"PYTHONPATH": deps, "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert str(venv) in out.stdout, out.stdout
    assert (venv / "bin" / "specloop").exists()
