"""An example specloop plugin: ``SuccessorDrafter`` (drafter "successor") and
``AcceptanceObserver`` (observer "acceptance"), registered through entry points."""

from ._drafter import SuccessorDrafter
from ._observer import AcceptanceObserver

__all__ = ["AcceptanceObserver", "SuccessorDrafter"]
