"""What one rank asked a collective to do: the record that ranks compare."""
from __future__ import annotations

import hashlib

import attrs
import torch

# Op codes for the fixed-size signature exchanged in checked mode; append only.
OPS = ("all_gather", "all_gather_object", "all_reduce", "broadcast_object", "barrier",
       "all_gather_bytes")


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


@attrs.frozen
class CollectiveCall:
    """One collective as entered by one rank; equal calls on all ranks = symmetric."""

    op: str
    group: str
    seq: int
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    detail: str | None = None  # "op=sum" or "src=0": arguments that must also agree

    @classmethod
    def for_tensor(
        cls, op: str, group: str, seq: int, tensor: torch.Tensor, detail: str | None = None
    ) -> CollectiveCall:
        return cls(op, group, seq, tuple(tensor.shape), _dtype_name(tensor.dtype), detail)

    def describe(self) -> str:
        """`all_gather(shape=(3,), dtype=int64) #7 on group 'adp'`."""
        args = [a for a in (self.detail,) if a]
        if self.shape is not None:
            args.append(f"shape={self.shape}")
        if self.dtype is not None:
            args.append(f"dtype={self.dtype}")
        return f"{self.op}({', '.join(args)}) #{self.seq} on group {self.group!r}"

    def fingerprint(self) -> int:
        """Stable across processes (unlike hash(), which is salted per process); int64."""
        text = repr((self.op, self.shape, self.dtype, self.group, self.detail))
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True)

    def signature(self) -> list[int]:
        """[seq, op code, fingerprint]: the fixed-size int64 row checked mode exchanges."""
        return [self.seq, OPS.index(self.op), self.fingerprint()]
