"""What the CLI's commands share: one-line errors, config loading and checks."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from specloop.models import ModelLoadError
from specloop.samplers import SamplingParamsError

from ._errors import ConfigError, RequestError

if TYPE_CHECKING:
    from ._config import EngineConfig

# The config (cattrs, the component registry) is imported where used, so that
# ``specloop --help`` does not import it (structlog likewise, in cli.py's configure_logging).

EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_CONFIG = "smollm2-eagle3.toml"
# Drafters whose proposals carry no trained signal unless given weights.
UNTRAINED_DRAFTERS = ("mtp_eagle", "eagle3", "early_exit")


class UsageError(Exception):
    """A wrong flag or flag combination; the message names it and the fix (exit 2)."""


# What the user can fix by changing the command or the config: exit 2.
USAGE_ERRORS = (UsageError, ConfigError, RequestError, SamplingParamsError)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``--help`` still shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def leaf_error(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups, skipping cancellations."""
    while isinstance(exc, BaseExceptionGroup):
        leaves = [e for e in exc.exceptions if not _is_cancellation(e)] or list(exc.exceptions)
        exc = leaves[0]
    return exc


def _is_cancellation(exc: BaseException) -> bool:
    # Called after the event loop has ended, so anyio.get_cancelled_exc_class() is not
    # available; the engine runs anyio on asyncio, whose cancellation is CancelledError.
    import asyncio  # noqa: PLC0415
    return isinstance(exc, asyncio.CancelledError)


def report_failure(exc: BaseException, command: str, *, debug: bool) -> int:
    """Print one line (and the traceback with --log-level debug); return the exit code."""
    leaf = leaf_error(exc)
    if isinstance(leaf, KeyboardInterrupt):
        print("\nspecloop: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    usage = isinstance(leaf, USAGE_ERRORS) or isinstance(leaf, ModelLoadError) and \
        isinstance(leaf, (FileNotFoundError, ValueError))
    message = str(leaf) if usage else f"{type(leaf).__name__}: {leaf}"
    hint = "" if debug or usage else " (rerun with --log-level debug for the traceback)"
    print(f"specloop {command}: error: {message}{hint}", file=sys.stderr)
    return EXIT_USAGE if usage else EXIT_RUNTIME


# config -----------------------------------------------------------------------------------
def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config (default: the embedded SmolLM2 config)")
    p.add_argument("--method", help="override speculative.method")
    p.add_argument("--draft-model", help="override speculative.draft_model (a registry name "
                   "or a checkpoint path sharing the target's tokenizer); implies "
                   "--method draft_model unless --method is given")
    p.add_argument("--draft-weights", help="override speculative.draft_weights: a trained "
                   "head's registry name (e.g. smollm2-135m-instruct-eagle3, with --method "
                   "eagle3) or a .safetensors path")
    p.add_argument("--no-chat-template", action="store_true",
                   help="send prompts as raw text (model.chat_template = false)")
    p.add_argument("--allow-untrained-drafter", action="store_true",
                   help="testing only: run mtp_eagle without weights (a random head) or "
                   "early_exit (an untrained exit)")


def load_config(args: argparse.Namespace) -> EngineConfig:
    """The config file (or the embedded default) with the command-line overrides applied,
    checked before any model is loaded."""
    from ._config import EngineConfig  # noqa: PLC0415 - see the imports

    if args.config is None:
        # A regular package's resources are files on disk (a Path, as str).
        default = files("specloop.engine") / "defaults" / DEFAULT_CONFIG
        config = EngineConfig.from_toml(str(default))
    else:
        config = EngineConfig.from_toml(args.config)
    data = config.to_dict()
    if args.method is not None:
        data["speculative"]["method"] = args.method
    if args.draft_model is not None:
        data["speculative"]["draft_model"] = args.draft_model
        if args.method is None:
            data["speculative"]["method"] = "draft_model"
    if getattr(args, "draft_weights", None) is not None:
        data["speculative"]["draft_weights"] = args.draft_weights
    if args.no_chat_template:
        data["model"]["chat_template"] = False
    config = EngineConfig.from_dict(data)
    check_drafter_trained(config, args.allow_untrained_drafter)
    check_head_name(config.speculative.draft_weights)
    # Last: the model registry imports torch (models._registry -> _convert).
    check_model_name(config.model.name, "model.name")
    if config.speculative.method == "draft_model":
        check_model_name(config.speculative.draft_model, "speculative.draft_model")
    return config


def check_head_name(name: str | None) -> None:
    """A shipped head or an existing file; checked before the model loads (without
    importing the drafters, which would import torch)."""
    if not name:
        return
    heads = Path(__file__).resolve().parents[1] / "models" / "drafters" / "heads"
    if (heads / f"{name}.safetensors").is_file() or Path(name).expanduser().is_file():
        return
    shipped = ", ".join(sorted(p.stem for p in heads.glob("*.safetensors"))) or "none"
    raise ConfigError("speculative.draft_weights", name, "neither a shipped head nor a file",
                      f"shipped heads: {shipped}; or the path of a .safetensors head")


def check_drafter_trained(config: EngineConfig, allowed: bool) -> None:
    spec = config.speculative
    if spec.method not in UNTRAINED_DRAFTERS or allowed:
        return
    weights = spec.mtp_weights or spec.draft_weights
    if spec.method in ("mtp_eagle", "eagle3") and weights:
        return
    what = ("has no trained weights (speculative.draft_weights is unset), so its head would "
            "be random" if spec.method in ("mtp_eagle", "eagle3") else
            "exits through untrained layers and predicts the next token poorly")
    raise UsageError(f"speculative.method = {spec.method!r} {what}; use a trained drafter "
                     "(e.g. --method ngram), or pass --allow-untrained-drafter for testing")


def check_model_name(name: str | None, field: str) -> None:
    """A registry name or an existing path; catches a typo before minutes of loading."""
    from pathlib import Path  # noqa: PLC0415

    from specloop.models import KNOWN_MODELS  # noqa: PLC0415
    if name is None or name in KNOWN_MODELS or Path(name).expanduser().exists():
        return
    raise ConfigError(field, name, "neither a registry model nor an existing path",
                      f"use one of: {', '.join(KNOWN_MODELS)}; or a checkpoint directory or "
                      ".gguf file")


def under_torchrun() -> bool:
    """This process is one rank of a group torchrun started (WORLD_SIZE set, not 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) != 1


def spawns_group(config: EngineConfig) -> bool:
    """A config of several ranks run outside torchrun: the command starts the ranks itself
    (a ``ProcessEngine``, one core process per rank)."""
    return config.parallel.world_size > 1 and not under_torchrun()
