"""Name -> factory registry for the swappable components.

A component is named in config by a registry name, or by ``"package.module:attr"``.
Third parties register through the entry-point group ``specloop.components`` with
entry-point names ``"<kind>.<name>"`` (e.g. ``sampler.fancy``).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from ._errors import ConfigError

ENTRY_POINT_GROUP = "specloop.components"
KINDS = ("sampler", "communicator", "graph_cache", "drafter")


def builtin_components() -> dict[str, dict[str, str]]:
    # Import strings, not objects: importing every component up front would cost time and
    # cycles; a name is resolved only when an engine is built with it.
    return {
        "sampler": {"default": "specloop.engine._factories:default_sampler"},
        "communicator": {
            "single": "specloop.engine._factories:single_communicator",
            "torch_distributed": "specloop.engine._factories:torch_distributed_communicator",
        },
        "graph_cache": {
            "eager": "specloop.graphs:EagerGraphCache",
            "cuda": "specloop.graphs:CudaGraphCache",
        },
        "drafter": {
            "ngram": "specloop.models.drafters:NgramDrafter",
            "draft_model": "specloop.models.drafters:DraftModelDrafter",
            "early_exit": "specloop.models.drafters:EarlyExitDrafter",
            "mtp_eagle": "specloop.models.drafters:MtpEagleDrafter",
        },
    }


def _entry_point_components(kind: str) -> dict[str, str]:
    found = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        ep_kind, _, name = ep.name.partition(".")
        if ep_kind == kind and name:
            found[name] = ep.value
    return found


def known_components(kind: str) -> dict[str, str]:
    """Every name usable for ``kind``: built-ins, then entry points (which may not shadow)."""
    return {**_entry_point_components(kind), **builtin_components()[kind]}


def is_import_path(name: str) -> bool:
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr)


def check_component_name(kind: str, name: str, field: str) -> None:
    if is_import_path(name) or name in known_components(kind):
        return
    known = ", ".join(sorted(known_components(kind)))
    raise ConfigError(field, name, f"unknown {kind}",
                      f"use one of: {known}; or 'package.module:attr'")


def resolve_component(kind: str, name: str, field: str) -> Any:
    """The factory (class or callable) that ``name`` stands for."""
    check_component_name(kind, name, field)
    target = name if is_import_path(name) else known_components(kind)[name]
    module_name, _, attr_path = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(field, name, f"cannot import {target}: {exc}",
                          "check the module path and that its package is installed") from exc
    return obj
