"""specloop.engine: config, requests, the iteration state machine, AsyncEngine, CLI."""

from ._components import ENTRY_POINT_GROUP, known_components
from ._config import (ComponentsConfig, EngineConfig, GraphsConfig, ModelConfig,
                      ParallelConfig, SchedulerConfig, SpeculativeConfig)
from ._engine import AsyncEngine
from ._errors import (ConfigError, EngineClosedError, EngineStateError, IllegalTransitionError,
                      RequestError)
from ._iteration import IterationMachine, IterationRecord
from ._request import FinishReason, RequestOutput
from ._states import TRANSITIONS, IterationObserver, IterationState, TransitionEvent
from ._stats import EngineStats

__all__ = [
    "AsyncEngine", "ComponentsConfig", "ConfigError", "ENTRY_POINT_GROUP", "EngineClosedError",
    "EngineConfig", "EngineStateError", "EngineStats", "GraphsConfig", "FinishReason",
    "IllegalTransitionError",
    "IterationMachine", "IterationObserver", "IterationRecord", "IterationState",
    "ModelConfig", "ParallelConfig", "RequestError", "RequestOutput", "SchedulerConfig",
    "SpeculativeConfig", "TRANSITIONS", "TransitionEvent", "known_components",
]
