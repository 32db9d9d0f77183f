"""Errors the engine raises to its users."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the value and the fix."""

    def __init__(self, field: str, value: object, problem: str, fix: str = "") -> None:
        self.field = field
        self.value = value
        message = f"{field} = {value!r}: {problem}"
        if fix:
            message += f"; {fix}"
        super().__init__(message)


class RequestError(ValueError):
    """One request is invalid; the engine rejects it and keeps serving the others."""


class EngineClosedError(RuntimeError):
    """The engine is not running (not entered, already closed, or it failed)."""


class EngineStateError(RuntimeError):
    """The engine's ``async with`` was used wrongly: nested, or entered a second time."""


class IllegalTransitionError(RuntimeError):
    """An iteration handler asked for a state the transition table does not allow."""
