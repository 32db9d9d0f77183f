"""The variables torchrun sets for each process, read and checked in one place."""
from __future__ import annotations

import os
from collections.abc import Mapping

import attrs

_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@attrs.frozen
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> TorchrunEnv:
        env = os.environ if environ is None else environ
        missing = [k for k in _REQUIRED if not env.get(k)]
        if missing:
            raise RuntimeError(
                f"torch.distributed environment incomplete: {', '.join(missing)} not set; "
                "launch with torchrun (or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
            )
        out = cls(
            rank=_int(env, "RANK"),
            world_size=_int(env, "WORLD_SIZE"),
            local_rank=_int(env, "LOCAL_RANK", env["RANK"]),
            master_addr=env["MASTER_ADDR"],
            master_port=_int(env, "MASTER_PORT"),
        )
        if not 0 <= out.rank < out.world_size:
            raise RuntimeError(f"RANK={out.rank} is outside [0, WORLD_SIZE={out.world_size})")
        return out


def _int(env: Mapping[str, str], key: str, default: str | None = None) -> int:
    text = env.get(key) or default
    try:
        return int(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise RuntimeError(f"environment variable {key}={text!r} is not an integer") from None
