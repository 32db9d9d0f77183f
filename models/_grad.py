"""torch's grad-mode decorators, with the decorated function's type kept.

The type checker does not follow torch (it is Any there), so ``@torch.inference_mode()``
would turn a typed function into an untyped one. These apply the same torch decorator at
run time and tell the checker the signature is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, TypeVar, cast

import torch

P = ParamSpec("P")
R = TypeVar("R")


def inference_mode(fn: Callable[P, R]) -> Callable[P, R]:
    """``@torch.inference_mode()``."""
    return cast("Callable[P, R]", torch.inference_mode()(fn))


def no_grad(fn: Callable[P, R]) -> Callable[P, R]:
    """``@torch.no_grad()``."""
    return cast("Callable[P, R]", torch.no_grad()(fn))
