"""The engine as the CLI's commands open it (one place for the wiring they share)."""

from __future__ import annotations

import contextlib

from ._engine import AsyncEngine


@contextlib.asynccontextmanager
async def open_engine(config, *, trace: str | None = None, observers=()):
    async with AsyncEngine(config, observers=observers) as engine:
        yield engine
