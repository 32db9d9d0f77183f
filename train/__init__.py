"""specloop.train: drafter training (prompts, self-distilled data, heads, trainer, cards)."""

from ._config import TrainConfig
from ._distill import Sequence, distill
from ._evaluate import AcceptanceCounter, engine_acceptance, offline_acceptance
from ._mtp_head import TrainableEagle3Head, TrainableMtpHead, ttt_mask
from ._pipeline import run
from ._prompts import SOURCES, Prompt, build_prompts, read_prompts, write_prompts
from ._trainer import draft_vocab, train

__all__ = ["AcceptanceCounter", "Prompt", "SOURCES", "Sequence", "TrainConfig",
           "TrainableEagle3Head", "TrainableMtpHead", "build_prompts", "distill", "draft_vocab",
           "engine_acceptance", "offline_acceptance", "read_prompts", "run", "train",
           "ttt_mask", "write_prompts"]
