"""Drafters: propose K tokens per request for the target to verify."""

from ._draft_model import DraftModelDrafter
from ._early_exit import EarlyExitDrafter
from ._ngram import NgramDrafter
from ._protocol import Drafter, DraftContext, DrafterDeps, DraftProposal

__all__ = ["DraftContext", "DraftModelDrafter", "DraftProposal", "Drafter", "DrafterDeps",
           "EarlyExitDrafter", "NgramDrafter"]
