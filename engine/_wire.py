"""Outputs of serving ranks as one fixed-size int64 block per rank, so the SCHEDULE
exchange is a plain tensor all-gather (NCCL on GPUs) rather than pickled objects.

Row layout, ``width = K + 5``: handle + 1 (0 = empty row), token count, finished,
finish reason index, then up to K + 1 token ids (-1 padded).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ._request import FinishReason, RequestOutput

REASONS = tuple(FinishReason)


def block_width(k: int) -> int:
    return k + 5


def encode_outputs(outputs: Sequence[tuple[int, RequestOutput]], rows: int, k: int
                   ) -> torch.Tensor | None:
    """[rows * width] int64, or None when the outputs do not fit (send them as objects)."""
    width = block_width(k)
    if len(outputs) > rows or any(len(o.token_ids) > k + 1 for _, o in outputs):
        return None
    # Built as lists, one tensor at the end: per-row tensor writes cost ~0.5 ms at 64 rows.
    block = [[handle + 1, len(out.token_ids), int(out.finished),
              -1 if out.finish_reason is None else REASONS.index(out.finish_reason),
              *out.token_ids] + [-1] * (k + 1 - len(out.token_ids))
             for handle, out in outputs]
    block += [[0] + [-1] * (width - 1)] * (rows - len(outputs))
    return torch.tensor(block, dtype=torch.int64).reshape(-1)


def decode_outputs(flat: torch.Tensor, k: int, request_id: Callable[[int], str | None]
                   ) -> list[RequestOutput]:
    outputs = []
    for row in flat.reshape(-1, block_width(k)).tolist():
        if row[0] == 0:
            continue
        rid = request_id(row[0] - 1)
        if rid is None:
            continue        # its consumer already left
        reason = REASONS[row[3]] if row[3] >= 0 else None
        outputs.append(RequestOutput(rid, tuple(row[4:4 + row[1]]), "", bool(row[2]), reason))
    return outputs
