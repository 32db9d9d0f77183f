"""The distribution's shape: installed names, import directions, the built wheel."""

import ast
import json
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["engine", "samplers", "comm", "graphs", "models", "models.drafters", "serve", "train"]
# DESIGN.md: engine -> models, samplers, comm, graphs; models -> samplers, comm;
# graphs -> samplers; samplers and comm import nothing of the project;
# train -> engine, models, samplers.
ALLOWED = {
    "serve": {"serve", "engine", "samplers"},
    "train": {"train", "engine", "models", "samplers"},
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


@pytest.mark.slow  # a fresh interpreter (imports torch, ~3 s CPU)
def test_no_generic_top_level_names_installed(tmp_path):
    # Outside the source tree (whose folders are importable from the repo root), only
    # specloop.* may resolve: an installed top-level "engine" or "comm" would shadow users'
    # own modules. Each subpackage must come from its folder here.
    generic = sorted({name.split(".")[0] for name in SUBPACKAGES} | {"serve", "train"})
    code = ("import importlib.util as u, json;"
            f"print(json.dumps({{n: u.find_spec(n) is not None for n in {generic!r}}}));"
            f"print(json.dumps([u.find_spec('specloop.' + n).origin for n in {SUBPACKAGES!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=tmp_path).stdout.splitlines()
    found = json.loads(out[0])
    assert not any(found.values()), f"generic top-level names importable: {found}"
    origins = json.loads(out[1])
    for name, origin in zip(SUBPACKAGES, origins, strict=True):
        assert Path(origin) == ROOT / name.replace(".", "/") / "__init__.py", (name, origin)


# Only serve/ may use HTTP and metrics libraries (an optional extra).
SERVER_LIBS = {"starlette", "uvicorn", "prometheus_client", "fastapi", "httpx", "aiohttp"}


def third_party_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", sorted(set(ALLOWED) - {"serve"}))
def test_engine_packages_import_no_server_libraries(package):
    for path in (ROOT / package).rglob("*.py"):
        bad = third_party_imports(path) & SERVER_LIBS
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.slow
def test_built_wheel_installs_into_a_fresh_venv(tmp_path, project_wheels):
    wheel = project_wheels["specloop"]     # tests/conftest.py: built once, from a copy
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"specloop", "specloop-0.1.0.dist-info"}, tops
    venv = tmp_path / "venv"
    # Without its own pip (ensurepip costs ~5 s of CPU): this environment's pip installs
    # into it (--python), as a user's pip would.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True)
    # Dependencies (torch, attrs, ...) come from this environment's site-packages through
    # PYTHONPATH, which skips .pth files: the editable source tree stays out of reach.
    deps = sysconfig.get_paths()["purelib"]
    # Every public name, resolved (most load on first use): each module is in the wheel.
    code = ("import importlib, specloop.engine as e;"
            f"[getattr(m, a) for m in map(importlib.import_module, "
            f"('specloop.' + n for n in {SUBPACKAGES!r})) for a in m.__all__];"
            "print(e.__file__)")
    out = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True,
                         env={"PYTHONPATH": deps, "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert str(venv) in out.stdout, out.stdout
    assert (venv / "bin" / "specloop").exists()
    # The shipped heads travel as package data, with their cards.
    names = zipfile.ZipFile(wheel).namelist()
    for head in ("smollm2-135m-instruct-eagle3", "smollm2-135m-instruct-eagle"):
        assert f"specloop/models/drafters/heads/{head}.safetensors" in names
        assert f"specloop/models/drafters/heads/{head}.json" in names
