"""Errors raised while resolving, converting or loading a model."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model could not be resolved, converted or loaded; the message names the fix."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """A checkpoint path, a required file or a registry name does not exist."""


class UnsupportedModelError(ModelLoadError, ValueError):
    """The checkpoint's architecture or one of its options is not implemented here."""
