"""IncrementalDetokenizer: text deltas for streaming, never splitting a multi-byte character."""

from __future__ import annotations

from collections.abc import Iterable

from ._tokenizer import Tokenizer

try:  # tokenizers >= 0.21: the same prefix/read-offset algorithm, in Rust (~1 us a token)
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: the window algorithm below
    DecodeStream = None  # type: ignore[assignment,misc]  # the class is absent there

_REPLACEMENT = "\ufffd"
# Tokens decoded before the new ones, so context-dependent decoders (leading-space
# stripping, byte fallback) see the same neighbourhood as a full decode.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """``push(ids) -> str`` returns the new text; ``flush()`` returns whatever is held back.

    A delta ending in U+FFFD (an incomplete UTF-8 sequence) is held back until the next
    token completes it. The concatenated deltas equal ``tokenizer.decode(all ids)``.

    Tokens go through the backend's ``DecodeStream`` while it is available: two Python
    decodes of a window per push cost ~20 us, the stream ~1 us a token, and streaming
    outputs to every request each iteration makes this a per-request, per-iteration
    cost (issue 12). The window algorithm takes over where the stream cannot continue
    (a prefix it refuses, after ``flush``), from the first token it had not emitted.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # ids before this are already emitted
        self._backend = tokenizer.backend
        self._stream = (DecodeStream(skip_special_tokens=skip_special_tokens)
                        if DecodeStream is not None else None)

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def push(self, ids: Iterable[int]) -> str:
        ids = ids if isinstance(ids, (list, tuple)) else list(ids)
        stream = self._stream
        if stream is None:
            self._ids.extend(ids)
            return self._push_window()
        if len(ids) == 1:
            return self.push_one(ids[0])
        # Several tokens (a speculative step's accepted ones), every request's on the
        # front door's rank: the pieces joined by ``+=`` (fewer than a list and a join
        # for a few pieces), one try for the loop.
        text, own, backend = "", self._ids, self._backend
        start = len(own)
        read = self._read_offset
        try:
            for token in ids:
                own.append(token)
                piece = stream.step(backend, token)
                if piece is not None:
                    text += piece
                    read = len(own)
        except Exception:  # noqa: BLE001 - the stream refused its prefix: window from here
            self._read_offset = read
            self._leave_stream()
            own.extend(ids[len(own) - start:])
            return text + self._push_window()
        self._read_offset = read
        return text

    def push_one(self, token: int) -> str:
        """``push((token,))``: the common case (a decoding step per request per
        iteration, every request's on the front door's rank), without the general
        path's checks and copies."""
        stream = self._stream
        if stream is None:
            return self.push((token,))
        self._ids.append(token)
        try:
            piece = stream.step(self._backend, token)
        except Exception:  # noqa: BLE001 - the stream refused its prefix: window from here
            self._leave_stream()
            return self._push_window()
        if piece is None:
            return ""
        self._read_offset = len(self._ids)
        return piece

    def flush(self) -> str:
        """Emit held-back text (possibly ending in U+FFFD) at the end of a stream."""
        self._leave_stream()
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        self._read_offset = len(self._ids)
        return text[len(prefix) :] if len(text) > len(prefix) else ""

    def _leave_stream(self) -> None:
        """Continue with the window algorithm from the first id not yet emitted."""
        if self._stream is not None:
            self._stream = None
            self._prefix_offset = max(0, self._read_offset - _CONTEXT_TOKENS)

    def _push_window(self) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(prefix) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset = max(self._prefix_offset, len(self._ids) - _CONTEXT_TOKENS)
        # The window moved: the emitted part of the new window must be re-measured.
        self._read_offset = len(self._ids)
        return text[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""
