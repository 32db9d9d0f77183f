"""Public names that load on first use (PEP 562), for every package's ``__init__``.

A package ``__init__`` imports its public names under ``TYPE_CHECKING`` (what mypy and
readers see), lists them in ``__all__``, and at run time gets ``__getattr__`` and
``__dir__`` from :func:`lazy_exports`, naming the submodule that defines each name. So
importing ``specloop.engine._cli_common`` (the CLI) runs no package's heavy imports:
``specloop --help`` and the CLI's usage errors answer without importing torch. It lives in
samplers, the package that imports nothing of the project and that every other may import;
it imports nothing heavy itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from importlib import import_module
from typing import Any


def lazy_exports(namespace: MutableMapping[str, Any], sources: Mapping[str, tuple[str, ...]]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__, __dir__`` for the package whose ``globals()`` is ``namespace``.

    ``sources`` maps a submodule (relative, e.g. ``"._engine"``) to the public names it
    defines; together they must be exactly the package's ``__all__``. A name's first use
    imports its submodule and stores the value in ``namespace``, so later uses are plain
    attribute reads (``__getattr__`` is only called for names not found there)."""
    package, public = namespace["__name__"], namespace["__all__"]
    where = {name: module for module, names in sources.items() for name in names}
    if sorted(where) != sorted(public):
        # An import-time error, so a name added to one list alone fails every test at once.
        raise ImportError(f"{package}: __all__ and the lazy sources differ: "
                          f"{sorted(set(where) ^ set(public))}")

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *public})

    return __getattr__, __dir__
