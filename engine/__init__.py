"""specloop.engine: config, requests, the iteration state machine, AsyncEngine, CLI.

Public names load on first use (``specloop.samplers._lazy``), so that
``specloop --help`` and the CLI's usage errors answer without importing torch; mypy reads
the imports under ``TYPE_CHECKING``."""

from typing import TYPE_CHECKING

from specloop.samplers._lazy import lazy_exports

if TYPE_CHECKING:
    from ._components import ENTRY_POINT_GROUP, known_components
    from ._config import (ComponentsConfig, EngineConfig, GraphsConfig, ModelConfig,
                          ParallelConfig, SchedulerConfig, SpeculativeConfig)
    from ._engine import AsyncEngine
    from ._errors import (ConfigError, EngineClosedError, EngineStateError,
                          IllegalTransitionError, RequestError)
    from ._iteration import IterationMachine, IterationRecord
    from ._process import ProcessEngine
    from ._request import FinishReason, RequestOutput
    from ._states import TRANSITIONS, IterationObserver, IterationState, TransitionEvent
    from ._stats import EngineStats

__all__ = [
    "AsyncEngine", "ComponentsConfig", "ConfigError", "ENTRY_POINT_GROUP", "EngineClosedError",
    "EngineConfig", "EngineStateError", "EngineStats", "GraphsConfig", "FinishReason",
    "IllegalTransitionError",
    "IterationMachine", "IterationObserver", "IterationRecord", "IterationState",
    "ModelConfig", "ParallelConfig", "ProcessEngine", "RequestError", "RequestOutput",
    "SchedulerConfig",
    "SpeculativeConfig", "TRANSITIONS", "TransitionEvent", "known_components",
]

if not TYPE_CHECKING:      # mypy reads the imports above: an unknown name stays an error
    __getattr__, __dir__ = lazy_exports(globals(), {
        "._components": ("ENTRY_POINT_GROUP", "known_components"),
        "._config": ("ComponentsConfig", "EngineConfig", "GraphsConfig", "ModelConfig",
                     "ParallelConfig", "SchedulerConfig", "SpeculativeConfig"),
        "._engine": ("AsyncEngine",),
        "._errors": ("ConfigError", "EngineClosedError", "EngineStateError",
                     "IllegalTransitionError", "RequestError"),
        "._iteration": ("IterationMachine", "IterationRecord"),
        "._process": ("ProcessEngine",),
        "._request": ("FinishReason", "RequestOutput"),
        "._states": ("TRANSITIONS", "IterationObserver", "IterationState", "TransitionEvent"),
        "._stats": ("EngineStats",),
    })
