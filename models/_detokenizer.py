"""IncrementalDetokenizer: text deltas for streaming, never splitting a multi-byte character."""

from __future__ import annotations

from collections.abc import Iterable

from ._tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Tokens decoded before the new ones, so context-dependent decoders (leading-space
# stripping, byte fallback) see the same neighbourhood as a full decode.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """``push(ids) -> str`` returns the new text; ``flush()`` returns whatever is held back.

    A delta ending in U+FFFD (an incomplete UTF-8 sequence) is held back until the next
    token completes it. The concatenated deltas equal ``tokenizer.decode(all ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # ids before this are already emitted

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def push(self, ids: Iterable[int]) -> str:
        self._ids.extend(ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(prefix) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset = max(self._prefix_offset, len(self._ids) - _CONTEXT_TOKENS)
        # The window moved: the emitted part of the new window must be re-measured.
        self._read_offset = len(self._ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """Emit held-back text (possibly ending in U+FFFD) at the end of a stream."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        self._read_offset = len(self._ids)
        return text[len(prefix) :] if len(text) > len(prefix) else ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""
