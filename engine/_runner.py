"""The target model's compute on one rank: KV cache, prefill and the verify forward.

Everything here is synchronous tensor work; the state machine runs it off the event loop.
"""

from __future__ import annotations

import torch
import structlog

from specloop.models import KVCache, LoadedModel

from ._request import Request

log = structlog.get_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "float64": torch.float64}


def resolve_device(name: str, rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and torch.cuda.is_available():
        # One GPU per rank when a rank does not name its own.
        name = f"cuda:{rank % torch.cuda.device_count()}"
    return torch.device(name)


class ModelRunner:
    """Owns the target model and its slot-indexed KV cache (one slot per batch row)."""

    def __init__(self, loaded: LoadedModel, *, num_slots: int, max_seq_len: int,
                 max_prefill_tokens: int) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.args = loaded.args
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.max_seq_len = max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.cache = KVCache(loaded.args, num_slots, max_seq_len, dtype=self.dtype,
                             device=self.device)

    @torch.inference_mode()
    def prefill(self, request: Request) -> torch.Tensor:
        """Write K/V for every token but the last (VERIFY forwards the last one), in chunks
        of max_prefill_tokens; returns their final hidden states [P, H] for the drafter."""
        end = request.seq_len - 1
        slot = torch.tensor([request.slot], device=self.device)
        hidden = [torch.empty(0, self.args.hidden_size, dtype=self.dtype, device=self.device)]
        while request.num_cached < end:
            chunk = request.token_ids[request.num_cached:
                                      min(end, request.num_cached + self.max_prefill_tokens)]
            tokens = torch.tensor([chunk], device=self.device)
            start = torch.tensor([request.num_cached], device=self.device)
            hidden.append(self.model(tokens, start, slot, self.cache)[0])
            request.num_cached += len(chunk)
        return torch.cat(hidden)
