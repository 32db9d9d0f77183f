"""Top-k over a vocabulary split into column shards, one shard per rank (a draft tree's
children under a tensor-parallel LM head: models/drafters/_mtp.py)."""
from __future__ import annotations

import math

import torch

from ._argmax import _check
from ._protocol import Communicator


async def distributed_topk(comm: Communicator, shard_logits: torch.Tensor, k: int, *,
                           vocab_size: int) -> torch.Tensor:
    """The k largest of every row's logits, as global token ids int64 [N, k], most likely
    first, the same on every rank; one all_gather.

    Rank r holds ``shard_logits`` [N, S] = columns [r*S, min((r+1)*S, V)) of the full
    logits, S = ceil(V / world_size); columns at or beyond V (padding) are ignored. Among
    equal logits the lower id comes first (``torch.topk`` of the full rows leaves their
    order unspecified). Each rank sends its own shard's k best (fewer real columns: padded
    with -inf), ids as int64 and values as float64 bits, so the merge is exact."""
    n, s = _check(comm, shard_logits, vocab_size)
    if not isinstance(k, int) or not 1 <= k <= vocab_size:
        raise ValueError(f"distributed_topk: k must be an int in [1, {vocab_size}], got {k!r}")
    offset = comm.rank * s
    valid = max(0, min(s, vocab_size - offset))
    local = _local_top(shard_logits[:, :valid], offset, n, k)      # [N, k, 2] int64
    gathered = await comm.all_gather(local)                         # [g, N, k, 2]
    ids, bits = gathered.permute(1, 0, 2, 3).reshape(n, -1, 2).unbind(-1)   # [N, g*k]
    values = bits.view(torch.float64)
    # Lower id first among equal values: sort by id, then (stably) by value, descending.
    by_id = ids.argsort(dim=1, stable=True)
    ids, values = ids.gather(1, by_id), values.gather(1, by_id)
    by_value = values.argsort(dim=1, descending=True, stable=True)[:, :k]
    return ids.gather(1, by_value)


def _local_top(real: torch.Tensor, offset: int, n: int, k: int) -> torch.Tensor:
    """[N, k, 2] int64: (global id, float64 bits of the value) of each row's k best in
    this shard; past its real columns (-inf, an id past every real one)."""
    take = min(k, real.shape[1])
    ids = torch.full((n, k), offset + real.shape[1], dtype=torch.int64, device=real.device)
    values = torch.full((n, k), -math.inf, dtype=torch.float64, device=real.device)
    if take:
        # A stable sort, not topk: at the k-th place a tie must keep the lower id.
        best = real.argsort(dim=1, descending=True, stable=True)[:, :take]
        ids[:, :take] = best + offset
        values[:, :take] = real.gather(1, best).double()
    return torch.stack([ids, values.view(torch.int64)], dim=2)
