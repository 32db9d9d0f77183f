"""Shared bench helpers: quiet logging, timing, and a memory-copy bandwidth probe."""

from __future__ import annotations

import logging
import time

import structlog
import torch


def quiet_logs() -> None:
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def copy_bandwidth_gbs(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best-of-N memory copy rate, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
