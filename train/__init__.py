"""specloop.train: drafter training (prompts, self-distilled data, heads, trainer, cards).

Public names load on first use (``specloop.samplers._lazy``), so that
``specloop train-draft --help`` answers without importing torch; mypy reads the imports
under ``TYPE_CHECKING``."""

from typing import TYPE_CHECKING

from specloop.samplers._lazy import lazy_exports

if TYPE_CHECKING:
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

if not TYPE_CHECKING:      # mypy reads the imports above: an unknown name stays an error
    __getattr__, __dir__ = lazy_exports(globals(), {
        "._config": ("TrainConfig",),
        "._distill": ("Sequence", "distill"),
        "._evaluate": ("AcceptanceCounter", "engine_acceptance", "offline_acceptance"),
        "._mtp_head": ("TrainableEagle3Head", "TrainableMtpHead", "ttt_mask"),
        "._pipeline": ("run",),
        "._prompts": ("SOURCES", "Prompt", "build_prompts", "read_prompts", "write_prompts"),
        "._trainer": ("draft_vocab", "train"),
    })
