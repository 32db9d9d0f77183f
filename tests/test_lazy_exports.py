"""The packages whose public names load on first use (``specloop.samplers._lazy``): each
name of ``__all__`` resolves and is listed by ``dir()``, an unknown one is an
AttributeError, and what mypy reads (the ``TYPE_CHECKING`` imports) is what runs (the
sources given to ``lazy_exports``)."""

import ast
import importlib
from pathlib import Path

import pytest

from specloop.samplers._lazy import lazy_exports

ROOT = Path(__file__).resolve().parents[1]
LAZY = ["engine", "models", "samplers", "serve", "train"]


@pytest.mark.parametrize("package", LAZY)
def test_every_public_name_resolves_and_is_listed(package):
    module = importlib.import_module(f"specloop.{package}")
    assert module.__all__
    listed = dir(module)
    for name in module.__all__:
        value = getattr(module, name)
        assert value is not None, name
        assert name in listed, name
        # Stored on first use: the next read does not go through __getattr__.
        assert vars(module)[name] is value
    with pytest.raises(AttributeError, match=f"'specloop.{package}' has no attribute 'Nope'"):
        module.Nope  # noqa: B018


def _static_view(path: Path) -> tuple[dict[str, set[str]], dict[str, set[str]], list[str]]:
    """(submodule -> names imported under TYPE_CHECKING, submodule -> names given to
    lazy_exports, __all__) of one ``__init__.py``, read without importing it."""
    typed: dict[str, set[str]] = {}
    lazy: dict[str, set[str]] = {}
    public: list[str] = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.level == 1, ast.unparse(imp)
                typed.setdefault(f".{imp.module}", set()).update(a.name for a in imp.names)
        elif isinstance(node, ast.If) and ast.unparse(node.test) == "not TYPE_CHECKING":
            call = node.body[0].value
            assert ast.unparse(call.func) == "lazy_exports"
            lazy = {k: set(v) for k, v in ast.literal_eval(call.args[1]).items()}
        elif isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__":
            public = ast.literal_eval(node.value)
    return typed, lazy, public


@pytest.mark.parametrize("package", LAZY)
def test_type_checking_imports_are_the_lazy_sources(package):
    typed, lazy, public = _static_view(ROOT / package / "__init__.py")
    assert typed == lazy
    assert sorted(public) == sorted(n for names in lazy.values() for n in names)


def test_sources_must_match_all():
    namespace = {"__name__": "specloop.samplers", "__all__": ["SpecMetadata", "Gone"]}
    with pytest.raises(ImportError, match=r"differ: \['Gone', 'Stream'\]"):
        lazy_exports(namespace, {"._metadata": ("SpecMetadata",), "._rng": ("Stream",)})


def test_first_use_imports_and_stores():
    namespace = {"__name__": "specloop.samplers", "__all__": ["SpecMetadata"]}
    getattr_, dir_ = lazy_exports(namespace, {"._metadata": ("SpecMetadata",)})
    assert "SpecMetadata" in dir_() and "SpecMetadata" not in namespace
    from specloop.samplers._metadata import SpecMetadata

    assert getattr_("SpecMetadata") is SpecMetadata
    assert namespace["SpecMetadata"] is SpecMetadata
    with pytest.raises(AttributeError):
        getattr_("Stream")
