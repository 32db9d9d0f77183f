"""The one component registry: name -> factory, per kind, and the builders that use it.

Built-in names and the names installed packages register under the entry-point group
``specloop.components`` (entry-point name ``"<kind>.<name>"``, e.g. ``drafter.eagle3``)
form one registry. Config may also name ``"package.module:attr"``. The valid values of
every ``[components]`` field and of ``speculative.method`` come from here.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from collections.abc import Mapping
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, cast

import structlog

from ._errors import ConfigError

if TYPE_CHECKING:
    from specloop.comm import Communicator
    from specloop.graphs import GraphCache
    from specloop.models.drafters import Drafter, DrafterDeps
    from specloop.samplers import Sampler

    from ._config import EngineConfig
    from ._states import IterationObserver

log = structlog.get_logger(__name__)

ENTRY_POINT_GROUP = "specloop.components"
KINDS = ("sampler", "communicator", "graph_cache", "drafter", "observer")
# speculative.method's one value that names no drafter: speculation off.
NO_DRAFTER = "none"

# Import strings, not objects: importing every component up front would cost time and
# import cycles; a name is resolved only when an engine is built with it.
_BUILTINS: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "sampler": MappingProxyType({"default": f"{__name__}:default_sampler"}),
    "communicator": MappingProxyType({
        "single": f"{__name__}:single_communicator",
        "torch_distributed": f"{__name__}:torch_distributed_communicator",
    }),
    "graph_cache": MappingProxyType({
        "eager": "specloop.graphs:EagerGraphCache",
        "cuda": "specloop.graphs:CudaGraphCache",
    }),
    "drafter": MappingProxyType({
        "ngram": "specloop.models.drafters:NgramDrafter",
        "draft_model": "specloop.models.drafters:DraftModelDrafter",
        "early_exit": "specloop.models.drafters:EarlyExitDrafter",
        "mtp_eagle": "specloop.models.drafters:MtpEagleDrafter",
        "eagle3": "specloop.models.drafters:Eagle3Drafter",
    }),
    # Iteration observers (components.observers, a list): none built in; the trace
    # recorder needs a path and is added by the CLI's --trace.
    "observer": MappingProxyType({}),
})


def component_registry() -> dict[str, dict[str, str]]:
    """kind -> {name -> "module:attr"}: built-ins, then entry points (which may not shadow
    a built-in). Read again whenever ``sys.path`` or one of its folders changed (installing
    a package adds its .dist-info folder there, so a package installed at run time is
    seen); else from a memo: reading every installed package's metadata costs ~7 ms, paid
    by every config and every engine build."""
    registry = _registry_for(_path_stamps())
    return {kind: dict(names) for kind, names in registry.items()}


def _path_stamps() -> tuple[tuple[str, int], ...]:
    stamps = []
    for folder in sys.path:
        try:
            stamps.append((folder, os.stat(folder or ".").st_mtime_ns))
        except OSError:
            stamps.append((folder, -1))
    return tuple(stamps)


@functools.lru_cache(maxsize=8)
def _registry_for(stamps: tuple[tuple[str, int], ...]) -> dict[str, dict[str, str]]:
    """The registry as installed when ``sys.path`` had ``stamps`` (a memo's key only)."""
    found: dict[str, dict[str, str]] = {kind: {} for kind in KINDS}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        kind, _, name = ep.name.partition(".")
        if kind not in found or not name:
            log.warning("component_entry_point_ignored", entry_point=ep.name,
                        reason=f"name must be '<kind>.<name>' with kind in {KINDS}")
        elif name in _BUILTINS[kind] or name == NO_DRAFTER:
            log.warning("component_entry_point_ignored", entry_point=ep.name,
                        reason="a built-in name cannot be shadowed")
        else:
            found[kind][name] = ep.value
    return {kind: {**found[kind], **_BUILTINS[kind]} for kind in KINDS}


def known_components(kind: str) -> dict[str, str]:
    """Every registered name usable for ``kind`` -> its ``"module:attr"``."""
    if kind not in KINDS:
        raise ValueError(f"unknown component kind {kind!r}; kinds are {', '.join(KINDS)}")
    return component_registry()[kind]


def is_import_path(name: str) -> bool:
    if not isinstance(name, str):
        return False
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr)


def check_component_name(kind: str, name: str, field: str, *,
                         registry: Mapping[str, Mapping[str, str]] | None = None) -> None:
    known = (registry or component_registry())[kind]
    if is_import_path(name) or name in known:
        return
    names = ", ".join(sorted(known)) or "(none registered)"
    raise ConfigError(field, name, f"unknown {kind}",
                      f"use one of: {names}; or 'package.module:attr'")


def check_method(value: str) -> None:
    """``speculative.method``: ``"none"``, or a drafter as ``components.drafter`` names one."""
    if value == NO_DRAFTER or is_import_path(value):
        return
    known = known_components("drafter")
    if value not in known:
        names = ", ".join([NO_DRAFTER, *sorted(known)])
        raise ConfigError("speculative.method", value, "unknown drafter",
                          f"use one of: {names}; or 'package.module:attr' (packages "
                          f"register drafters under the '{ENTRY_POINT_GROUP}' entry points)")


def resolve_component(kind: str, name: str, field: str) -> Any:
    """The factory (class or callable) that ``name`` stands for."""
    registry = component_registry()
    check_component_name(kind, name, field, registry=registry)
    target = name if is_import_path(name) else registry[kind][name]
    module_name, _, attr_path = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(field, name, f"cannot import {target}: {exc}",
                          "check the module path and that its package is installed") from exc
    return obj


# Each kind's protocol, as "module:attr" (imported only when a component is checked).
PROTOCOLS: Mapping[str, str] = MappingProxyType({
    "sampler": "specloop.samplers:Sampler",
    "communicator": "specloop.comm:Communicator",
    "graph_cache": "specloop.graphs:GraphCache",
    "drafter": "specloop.models.drafters:Drafter",
    "observer": "specloop.engine:IterationObserver",
})


def protocol_of(kind: str) -> type:
    module, _, attr = PROTOCOLS[kind].partition(":")
    # getattr, not vars(): a package's public names load on first use (samplers._lazy).
    return cast(type, getattr(importlib.import_module(module), attr))


def protocol_members(protocol: type) -> frozenset[str]:
    """The public members a protocol declares (methods, properties and annotated
    attributes), its protocol bases' included."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls.__dict__.get("_is_protocol") and cls.__module__ != "typing":
            names.update(cls.__dict__, cls.__dict__.get("__annotations__", {}))
    return frozenset(n for n in names if not n.startswith("_"))


def missing_members(obj: object, protocol: type) -> list[str]:
    """The protocol's members ``obj`` lacks. Static lookup: no property is evaluated."""
    absent = object()
    return sorted(n for n in protocol_members(protocol)
                  if inspect.getattr_static(obj, n, absent) is absent)


def check_component(kind: str, obj: Any, field: str, name: str) -> Any:
    """``obj`` when it has every member of its kind's protocol; else a ConfigError that
    names the missing ones (the engine calls them all, without probing)."""
    missing = missing_members(obj, protocol_of(kind))
    if missing:
        public = PROTOCOLS[kind].replace(":", ".")
        raise ConfigError(field, name, f"the {kind} built by it lacks {', '.join(missing)}",
                          f"implement them, or subclass {public} to inherit the defaults")
    return obj


def _build(kind: str, name: str, field: str, *args: Any) -> Any:
    return check_component(kind, resolve_component(kind, name, field)(*args), field, name)


# Builders: one per kind, each the only place that kind is built from config. -----------

def build_sampler(config: EngineConfig) -> Sampler:
    sampler: Sampler = _build("sampler", config.components.sampler, "components.sampler",
                              config)
    return sampler


def build_graph_cache(config: EngineConfig) -> GraphCache:
    cache: GraphCache = _build("graph_cache", config.components.graph_cache,
                               "components.graph_cache", config)
    return cache


def build_communicator(config: EngineConfig) -> Communicator:
    comm: Communicator = _build("communicator", config.components.communicator,
                                "components.communicator", config)
    return comm


def build_observers(config: EngineConfig) -> list[IterationObserver]:
    """One observer per name in ``components.observers``, in order."""
    built: list[IterationObserver] = [
        _build("observer", name, "components.observers", config)
        for name in config.components.observers]
    return built


def build_drafter(config: EngineConfig, deps: DrafterDeps) -> Drafter | None:
    from specloop.models.drafters import DrafterConfigError  # noqa: PLC0415

    if not config.speculative.enabled:
        return None
    name = config.components.drafter or config.speculative.method
    try:
        drafter: Drafter = _build("drafter", name, "components.drafter", config, deps)
        return drafter
    except DrafterConfigError as exc:
        raise ConfigError(exc.field, exc.value, exc.problem, exc.fix) from exc


# Built-in factories whose component needs more than the config passed through. ---------

def default_sampler(config: EngineConfig) -> Sampler:
    from specloop.samplers import DefaultSampler  # noqa: PLC0415
    # Input validation syncs with the host, which graph capture forbids.
    return DefaultSampler(method=config.speculative.verification,
                          validate=config.components.graph_cache != "cuda")


def single_communicator(config: EngineConfig) -> Communicator:
    from specloop.comm import SingleRankCommunicator  # noqa: PLC0415
    return SingleRankCommunicator()


def torch_distributed_communicator(config: EngineConfig) -> Communicator:
    from specloop.comm import TorchDistributedCommunicator  # noqa: PLC0415
    device = "cuda" if config.model.device.startswith("cuda") or (
        config.model.device == "auto" and _cuda()) else "cpu"
    return TorchDistributedCommunicator.from_env(
        device=device, checked=config.parallel.checked_collectives,
        timeout=config.parallel.collective_timeout_s)


def _cuda() -> bool:
    import torch  # noqa: PLC0415
    return bool(torch.cuda.is_available())
