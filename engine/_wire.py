"""Outputs on the wire, in two forms.

- Serving ranks' outputs as one fixed-size int64 block per rank, so the SCHEDULE exchange
  is one ``all_gather_bytes`` of fixed-size rows rather than pickled objects. Row layout,
  ``width = K + 5``: handle + 1 (0 = empty row), token count, finished, finish reason
  index, then up to K + 1 token ids (-1 padded).
- A ``ProcessEngine`` core's outputs as ``OutputRow`` tuples, one pickled list an
  iteration on its pipe (engine/_core_process.py); RESCAN builds them directly there
  (``Outputs.deliver_rows``), no ``RequestOutput`` in between.
"""

from __future__ import annotations

from array import array
from typing import Callable, Sequence

from ._request import FinishReason, RequestOutput

REASONS = tuple(FinishReason)
REASON_INDEX = {reason: i for i, reason in enumerate(REASONS)}

# One output on a core's pipe: (request id, token ids, finished, finish reason index or -1,
# error). Tuples pickle in C; the frozen attrs class would pickle through its __reduce__.
OutputRow = tuple[str, tuple[int, ...], bool, int, "str | None"]


def make_row(request_id: str, token_ids: tuple[int, ...], finished: bool,
             reason: FinishReason | None, error: str | None = None) -> OutputRow:
    """An ``OutputRow`` (the reason as its index in ``REASONS``, -1 for None)."""
    return (request_id, token_ids, finished, -1 if reason is None else REASON_INDEX[reason],
            error)


def usual_row(request_id: str, token_ids: tuple[int, ...], text: str) -> OutputRow:
    """RESCAN's usual output (more tokens, not finished) as a row: called as
    ``RequestOutput(request_id, token_ids, text)`` is (``Outputs._commit``'s ``usual``)."""
    return (request_id, token_ids, False, -1, None)


def output_row(output: RequestOutput) -> OutputRow:
    return make_row(output.request_id, output.token_ids, output.finished,
                    output.finish_reason, output.error)


def row_output(row: OutputRow) -> RequestOutput:
    request_id, tokens, finished, reason, error = row
    return RequestOutput(request_id, tokens, "", finished,
                         None if reason < 0 else REASONS[reason], error)


def block_width(k: int) -> int:
    return k + 5


def encode_rows(outputs: Sequence[tuple[int, RequestOutput]], rows: int, k: int
                ) -> array[int] | None:
    """The outputs as a block of ``rows`` rows, an int64 ``array`` (the exchange appends it
    to its header, no tensor op), or None when they do not fit (sent as objects)."""
    width = block_width(k)
    if len(outputs) > rows:
        return None
    # One flat int64 array, one tensor over it at the end: per-row tensor writes cost
    # ~0.5 ms at 64 rows, a nested list through torch.tensor ~0.1 ms (issue 12).
    flat = array("q")
    add = flat.extend
    for handle, out in outputs:
        tokens, reason = out.token_ids, out.finish_reason
        if len(tokens) > k + 1:
            return None
        add((handle + 1, len(tokens), int(out.finished),
             -1 if reason is None else REASONS.index(reason)))
        add(tokens)
        add((-1,) * (k + 1 - len(tokens)))
    add(((0,) + (-1,) * (width - 1)) * (rows - len(outputs)))
    return flat


def decode_outputs(flat: Sequence[int], k: int, request_id: Callable[[int], str | None]
                   ) -> list[RequestOutput]:
    """A block's outputs (``flat``: its ints, ``encode_rows``' layout) whose consumers are
    still there (``request_id`` of a handle: None once it left)."""
    outputs = []
    width = block_width(k)
    for at in range(0, len(flat), width):
        if flat[at] == 0:       # an empty row
            continue
        row = flat[at:at + width]
        rid = request_id(row[0] - 1)
        if rid is None:
            continue        # its consumer already left
        reason = REASONS[row[3]] if row[3] >= 0 else None
        outputs.append(RequestOutput(rid, tuple(row[4:4 + row[1]]), "", bool(row[2]), reason))
    return outputs
