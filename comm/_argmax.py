"""Argmax over a vocabulary split into column shards, one shard per rank."""
from __future__ import annotations

import math

import torch

from ._protocol import Communicator


async def distributed_argmax(comm: Communicator, shard_logits: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
    """Global argmax of every row, int64 [N], the same on every rank; one all_gather.

    Rank r holds `shard_logits` [N, S] = columns [r*S, min((r+1)*S, V)) of the full
    logits, S = ceil(V / world_size); columns at or beyond V (padding) are ignored.
    Matches torch.argmax of the full rows: ties go to the lowest token id, and NaN
    counts as larger than any number (the first NaN wins), as torch.argmax does.
    Ids travel as int64, never through float, so ids above 2^24 stay exact.
    """
    n, s = _check(comm, shard_logits, vocab_size)
    offset = comm.rank * s
    valid = max(0, min(s, vocab_size - offset))  # real columns here; the rest is padding
    local = _local_best(shard_logits[:, :valid], offset, n)  # [N, 2] int64
    gathered = await comm.all_gather(local)  # [g, N, 2]
    ids, bits = gathered.unbind(-1)  # [g, N] each
    values = bits.view(torch.float64)
    # Shards are in token order and each sent its first max, so torch.argmax over the
    # shard maxima (first max wins, NaN largest) yields the global first max.
    winner = torch.argmax(values, dim=0, keepdim=True)  # [1, N]
    return ids.gather(0, winner).squeeze(0)


def _local_best(real: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    """[N, 2] int64: (global id, float64 bits of the value) of each row's first max."""
    if real.shape[1] == 0:
        # No real column on this rank: -inf never beats a real shard, which comes first.
        ids = torch.full((n,), offset, dtype=torch.int64, device=real.device)
        values = torch.full((n,), -math.inf, dtype=torch.float64, device=real.device)
    else:
        local_ids = torch.argmax(real, dim=1)  # [N], first max, NaN wins
        values = real.gather(1, local_ids[:, None]).squeeze(1).double()  # exact widening
        ids = local_ids + offset
    return torch.stack([ids, values.view(torch.int64)], dim=1)


def _check(comm: Communicator, shard_logits: torch.Tensor, vocab_size: int) -> tuple[int, int]:
    if not isinstance(shard_logits, torch.Tensor) or shard_logits.dim() != 2:
        got = getattr(shard_logits, "shape", shard_logits)
        raise ValueError(f"shard_logits must be a 2-D tensor [N, S], got {got!r}")
    if not shard_logits.is_floating_point():
        raise TypeError(f"shard_logits must be floating point, got {shard_logits.dtype}")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    n, s = shard_logits.shape
    expected = -(-vocab_size // comm.world_size)
    if s != expected:
        raise ValueError(
            f"shard_logits has {s} columns; with vocab_size={vocab_size} over {comm.world_size} ranks "
            f"each shard must have ceil(V/g) = {expected} (pad the last shard)"
        )
    return n, s
