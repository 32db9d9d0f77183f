"""Training configuration: frozen attrs sections composed into TrainConfig, from TOML."""

from __future__ import annotations

import tomllib
from pathlib import Path
from collections.abc import Callable
from typing import Any

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError

from specloop.engine import ConfigError

METHODS = ("mtp_eagle", "eagle3")


def _positive(section: str) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{section}.{attribute.name}", value, "must be a number > 0")
    return check


def _fraction(section: str) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ConfigError(f"{section}.{attribute.name}", value, "must be in [0, 1]")
    return check


@attrs.frozen
class TargetSection:
    model: str = "smollm2-135m-instruct"    # registry name or checkpoint directory
    dtype: str = "bfloat16"
    device: str = "auto"


@attrs.frozen
class DataSection:
    num_train_prompts: int = attrs.field(default=6000, validator=_positive("data"))
    num_eval_prompts: int = attrs.field(default=256, validator=_positive("data"))
    seed: int = 0
    # A prebuilt prompts JSONL (see specloop.train.build_prompts); "" = build it.
    prompts_file: str = ""


@attrs.frozen
class GenerateSection:
    """Self-distillation: the target answers the prompts through specloop's engine."""

    batch_size: int = attrs.field(default=256, validator=_positive("generate"))
    max_new_tokens: int = attrs.field(default=256, validator=_positive("generate"))
    max_seq_len: int = attrs.field(default=640, validator=_positive("generate"))
    sampled_fraction: float = attrs.field(default=0.5, validator=_fraction("generate"))
    temperature: float = attrs.field(default=0.8, validator=_positive("generate"))
    # Stop generating after this long; the answers so far (>= 8 tokens) are kept.
    time_budget_s: float = attrs.field(default=110.0, validator=_positive("generate"))
    # "engine": through AsyncEngine (continuous batching); "batched": whole waves of
    # prompts decoded together (CUDA graph on GPU), ~10x the tokens/s (train/_batched.py).
    backend: str = attrs.field(default="engine")
    # Answers per training prompt: the first as sampled_fraction says, the rest sampled
    # at ``temperature`` with other seeds (more data from the same prompts).
    answers_per_prompt: int = attrs.field(default=1, validator=_positive("generate"))

    @backend.validator
    def _check_backend(self, attribute: attrs.Attribute[str], value: str) -> None:
        if value not in ("engine", "batched"):
            raise ConfigError("generate.backend", value, "unknown distillation backend",
                              "use 'engine' or 'batched'")


@attrs.frozen
class HeadSection:
    method: str = attrs.field(default="mtp_eagle")
    draft_vocab_size: int = attrs.field(default=8192, validator=_positive("head"))
    ttt_steps: int = attrs.field(default=5, validator=_positive("head"))
    step_decay: float = attrs.field(default=0.8, validator=_fraction("head"))
    # eagle3: the target layers (0-based) whose residual streams the head fuses; [] = the
    # default low / middle / high choice (1, L/2 - 1, L - 4).
    feature_layers: list[int] = attrs.Factory(list)

    @method.validator
    def _check_method(self, attribute: attrs.Attribute[str], value: str) -> None:
        if value not in METHODS:
            raise ConfigError("head.method", value, "not a trainable head",
                              f"use one of: {', '.join(METHODS)}")


@attrs.frozen
class OptimSection:
    lr: float = attrs.field(default=6e-4, validator=_positive("optim"))
    max_steps: int = attrs.field(default=4000, validator=_positive("optim"))
    batch_size: int = attrs.field(default=32, validator=_positive("optim"))   # sequences
    warmup_steps: int = 100
    weight_decay: float = 0.0
    grad_clip: float = attrs.field(default=1.0, validator=_positive("optim"))
    # Training ends at max_steps or after this long; the LR schedule follows whichever
    # is further along, so a time-cut run still decays to zero.
    time_budget_s: float = attrs.field(default=240.0, validator=_positive("optim"))
    checkpoint_every: int = attrs.field(default=200, validator=_positive("optim"))
    seed: int = 0
    # Cap on passes over the training answers (0 = none): with few answers a head
    # memorises them (the shipped head saw ~50 passes); max_steps shrinks to fit.
    max_epochs: float = 0.0
    # The head's forward and loss under bf16 autocast (master weights stay fp32): ~2x
    # the steps per second on a GPU.
    bf16_autocast: bool = False
    # Length-homogeneous batches: every n steps, n batches' worth of random sequences are
    # sorted by length and split (1 = plain random batches); less padding, more steps/s.
    length_buckets: int = attrs.field(default=1, validator=_positive("optim"))


@attrs.frozen
class EvalSection:
    k: int = attrs.field(default=5, validator=_positive("eval"))
    # Held-out prompts also run through the engine (greedy and T=0.7): 0 = offline only.
    engine_prompts: int = 64
    engine_max_tokens: int = 128
    # Also run n-gram on the same prompts (K = 3 and eval.k, greedy and T = 0.7).
    ngram: bool = True


@attrs.frozen
class OutputSection:
    dir: str = "runs/draft-head"
    name: str = "draft-head"


@attrs.frozen
class TrainConfig:
    target: TargetSection = attrs.Factory(TargetSection)
    data: DataSection = attrs.Factory(DataSection)
    generate: GenerateSection = attrs.Factory(GenerateSection)
    head: HeadSection = attrs.Factory(HeadSection)
    optim: OptimSection = attrs.Factory(OptimSection)
    eval: EvalSection = attrs.Factory(EvalSection)
    output: OutputSection = attrs.Factory(OutputSection)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        try:
            return cattrs.Converter(forbid_extra_keys=True).structure(data, cls)
        except (ClassValidationError, ForbiddenExtraKeysError) as exc:
            leaf = _leaf(exc)
            if isinstance(leaf, ConfigError):
                raise leaf from None
            raise ConfigError("train config", None, str(leaf)) from None

    @classmethod
    def from_toml(cls, path: str | Path) -> TrainConfig:
        try:
            return cls.from_dict(tomllib.loads(Path(path).read_text()))
        except FileNotFoundError as exc:
            raise ConfigError("config file", str(path), "not found") from exc

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
