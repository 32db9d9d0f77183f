"""Stop strings on the detokenized text, and the text deltas a request's consumer sees.

Stop strings are matched on text, not tokens: one string can span several tokens and a
token can hold a stop string's start. Text that may still become a stop string is held
back until it cannot, so a consumer never sees a stop string's prefix it must take back.
"""

from __future__ import annotations

from typing import Sequence

import attrs

from specloop.models import IncrementalDetokenizer, Tokenizer

from ._request import FinishReason, RequestOutput, _set_text


class StopMatcher:
    """``push(text) -> (safe text, stopped)``; ``flush()`` releases what is held back."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        text = self._held + text
        # The first stop string to complete wins (earliest end, then earliest start):
        # the answer a character-by-character stream gives, whatever the chunking.
        hits = [(i + len(s), i) for s in self._stops if (i := text.find(s)) >= 0]
        if hits:
            self._held = ""
            return text[:min(hits)[1]], True
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        text, self._held = self._held, ""
        return text

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest


class TextStream:
    """Turns a request's token outputs into text deltas, ending it at a stop string.

    With stop strings, tokens are detokenized one at a time so that the output ends with
    the token that completed the match (usage then counts the tokens that were produced).
    """

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._push_one = self._detokenizer.push_one     # fill's per-output call, bound once
        self._matcher = StopMatcher(stops) if stops else None
        self.stopped = False

    def fill(self, output: RequestOutput) -> RequestOutput:
        """``step`` for an output nobody else holds yet (fresh from the engine, on its way
        through the front door): without stop strings its text is set in place — a
        frozen class, but not yet seen by anyone — instead of building the output a second
        time (~1.2 us each, for every request every iteration; issue 12)."""
        if self._matcher is not None:
            return self.step(output)
        ids = output.token_ids
        if len(ids) == 1:       # one token: every request, every iteration, without drafts
            text = self._push_one(ids[0])
        else:
            text = self._detokenizer.push(ids) if ids else ""
        if output.finished:
            text += self._detokenizer.flush()
        _set_text(output, text)
        return output

    def step(self, output: RequestOutput) -> RequestOutput:
        if self._matcher is None:
            text = self._detokenizer.push(output.token_ids) if output.token_ids else ""
            if output.finished:
                text += self._detokenizer.flush()
            # Built directly: attrs.evolve costs several times as much, once per output.
            return RequestOutput(output.request_id, output.token_ids, text, output.finished,
                                 output.finish_reason, output.error)
        text = ""
        for i, token in enumerate(output.token_ids):
            safe, self.stopped = self._matcher.push(self._detokenizer.push((token,)))
            text += safe
            if self.stopped:
                return attrs.evolve(output, token_ids=output.token_ids[:i + 1], text=text,
                                    finished=True, finish_reason=FinishReason.STOP)
        if output.finished:
            safe, self.stopped = self._matcher.push(self._detokenizer.flush())
            text += safe + ("" if self.stopped else self._matcher.flush())
            if self.stopped and output.finish_reason is FinishReason.LENGTH:
                output = attrs.evolve(output, finish_reason=FinishReason.STOP)
        return attrs.evolve(output, text=text)
