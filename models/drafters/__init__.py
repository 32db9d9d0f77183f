"""Drafters: propose K tokens per request for the target to verify."""

from ._draft_model import DraftModelDrafter
from ._eagle3 import Eagle3Drafter, Eagle3Head
from ._early_exit import EarlyExitDrafter
from ._errors import DrafterConfigError
from ._lm_head import DraftHead
from ._mtp import MtpEagleDrafter
from ._mtp_head import MtpEagleHead
from ._ngram import NgramDrafter
from ._protocol import Drafter, DraftContext, DrafterDeps, DraftProposal, VerifyObserver

__all__ = ["DraftContext", "Eagle3Drafter", "Eagle3Head", "DraftHead", "DraftModelDrafter", "DraftProposal", "Drafter",
           "DrafterConfigError", "DrafterDeps", "EarlyExitDrafter", "MtpEagleDrafter", "MtpEagleHead", "NgramDrafter",
           "VerifyObserver"]
