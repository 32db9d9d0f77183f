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
    block = torch.full((rows, width), -1, dtype=torch.int64)
    block[:, 0] = 0
    for row, (handle, out) in enumerate(outputs):
        reason = REASONS.index(out.finish_reason) if out.finish_reason is not None else -1
        block[row, :4] = torch.tensor([handle + 1, len(out.token_ids), int(out.finished),
                                       reason])
        block[row, 4:4 + len(out.token_ids)] = torch.tensor(out.token_ids, dtype=torch.int64)
    return block.reshape(-1)


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
