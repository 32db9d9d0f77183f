"""certify's options and its ``--params`` reader, apart from the checks (which import
torch): the CLI reads and checks a certify command line without importing torch."""

from __future__ import annotations

from typing import Any

import attrs

from specloop.samplers import SamplingParams

from ._errors import ConfigError

DEFAULT_PARAMS = ("temperature=1.0", "temperature=0.7,top_p=0.9")
CHECKS = ("distribution", "greedy", "invariance")


@attrs.frozen
class CertifyOptions:
    ranks: tuple[int, ...] = (1, 2)
    trials: int = 800                 # samples per (prompt, params) for the distribution
    positions: int = 3                # generated positions tested per sample
    params: tuple[str, ...] = DEFAULT_PARAMS
    control_ratio: float = 1.5        # the control's wrong temperature = T * ratio
    probe_tokens: int = 8             # tokens per invariance / greedy probe
    checks: tuple[str, ...] = CHECKS
    timeout_s: float = 60.0           # a collective waiting longer fails the run


DEFAULTS = CertifyOptions()


def parse_params(text: str) -> SamplingParams:
    """"temperature=0.7,top_p=0.9" -> SamplingParams (validated by its own checks)."""
    fields: dict[str, Any] = {}     # SamplingParams checks each value
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name.strip() not in ("temperature", "top_k", "top_p", "min_p"):
            raise ConfigError("--params", text, f"cannot read {item!r}",
                              "use name=value pairs of temperature, top_k, top_p, min_p")
        caster = int if name.strip() == "top_k" else float
        try:
            fields[name.strip()] = caster(value)
        except ValueError:
            raise ConfigError("--params", text, f"{name.strip()} = {value!r} is not a number"
                              ) from None
    return SamplingParams(**fields)
