"""Type-check specloop with mypy, configured in pyproject.toml ([tool.mypy]).

The sources live in <pkg>/ but import as specloop.<pkg> (setuptools' package-dir), and
mypy cannot follow the editable install's import hook: lay the packages out as symlinks
under .cache/typecheck/specloop/ first. Arguments are passed to mypy (files given there
replace the configured targets). Exit status: mypy's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / ".cache" / "typecheck" / "specloop"


def lay_out() -> None:
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    TREE.mkdir(parents=True, exist_ok=True)
    for package, folder in mapping.items():
        parts = package.split(".")
        if len(parts) != 2 or "/" in folder:
            continue        # nested packages come with their parent's folder
        link, target = TREE / parts[1], ROOT / folder
        if not (link.is_symlink() and link.resolve() == target):
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(os.path.relpath(target, TREE), target_is_directory=True)


def main(argv: list[str]) -> int:
    lay_out()
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *argv]
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
                          ).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
