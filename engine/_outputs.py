"""RESCAN's bookkeeping: commit accepted tokens, apply the stop rules, emit outputs,
and free a finished request's slot (in the runner and the drafter)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

from ._request import FinishReason, Request, RequestOutput
from ._wire import OutputRow, make_row, usual_row

if TYPE_CHECKING:
    from specloop.models.drafters import Drafter

    from ._config import EngineConfig
    from ._runner import ModelRunner
    from ._scheduler import Scheduler
    from ._stats import EngineStats

# An output as RESCAN builds it: a RequestOutput, or an OutputRow for a front door that
# takes rows (``Outputs.deliver_rows``).
Out = TypeVar("Out")


class Outputs:
    def __init__(self, *, config: EngineConfig, scheduler: Scheduler, runner: ModelRunner,
                 drafter: Drafter | None, stats: EngineStats,
                 deliver: Callable[[int, RequestOutput], None],
                 deliver_many: Callable[[list[int], list[RequestOutput]], None] | None = None,
                 deliver_rows: Callable[[list[OutputRow]], None] | None = None) -> None:
        """``deliver``: one (handle, output) towards the front door; ``deliver_many``:
        (handles, outputs), row for row, in order (default: ``deliver`` each).
        ``deliver_rows``: every output goes there instead, built as an ``OutputRow``
        (a ``ProcessEngine`` core, one rank: its front door sends rows down a pipe, and a
        row costs a fraction of a RequestOutput and its conversion)."""
        # The most draft rows a VERIFY writes past a request's length (a tree's nodes).
        self.k = config.speculative.verify_drafts
        self.max_seq_len = config.model.max_seq_len
        self.scheduler = scheduler
        self.runner = runner
        self.drafter = drafter
        self.stats = stats
        self.deliver = deliver
        self.deliver_many = deliver_many or self._deliver_each
        self.deliver_rows = deliver_rows
        self.eos_token_ids = frozenset(runner.loaded.tokenizer.eos_token_ids)

    def rules(self, request: Request) -> tuple[int, frozenset[int]]:
        """The request's stop rules as RESCAN checks them per row (``stop_reason``'s,
        derived once): a commit leaving the request ``stop_length`` tokens long or longer
        may end it by length; any of ``stop_tokens`` may end it by a stop."""
        tokens = request.stop_tokens
        if tokens is None:
            params = request.params
            # The next VERIFY writes positions up to L - 1 + K: it must stay in the cache.
            request.stop_length = min(len(request.prompt_ids) + params.max_tokens,
                                      self.max_seq_len - self.k)
            tokens = request.stop_tokens = frozenset(params.stop_token_ids).union(
                () if params.ignore_eos else self.eos_token_ids)
        return request.stop_length, tokens

    def append(self, request: Request, new_tokens: Sequence[int]) -> None:
        """One request's new tokens (``commit`` of a batch of one)."""
        self.commit((request,), (new_tokens,), (len(new_tokens) - 1,))

    def commit(self, batch: Sequence[Request], rows: Sequence[Sequence[int]],
               accepted: Sequence[int]) -> list[Request]:
        """RESCAN's commit of a whole batch: request i's new tokens are
        ``rows[i][:accepted[i] + 1]``. Per row only what the row needs: most rows, most
        iterations, no stop can match (no stop token among the new ones, no limit
        reached), and all are committed at once (the per-token rules cost ~2 us a row at
        batch 64). The outputs reach ``deliver`` in batch order once every row is
        committed (no consumer runs before RESCAN ends either way). -> the requests
        that finished."""
        if self.deliver_rows is not None:
            return self._commit(batch, rows, accepted, usual_row, self._row, self._hand_rows)
        return self._commit(batch, rows, accepted, RequestOutput, self._output,
                            self.deliver_many)

    def _commit(self, batch: Sequence[Request], rows: Sequence[Sequence[int]],
                accepted: Sequence[int], usual: Callable[[str, tuple[int, ...], str], Out],
                final: Callable[[Request, Sequence[int], bool], Out],
                deliver: Callable[[list[int], list[Out]], None]) -> list[Request]:
        """``commit`` with its outputs built by ``usual`` (a row that goes on: called as
        ``RequestOutput(request_id, token_ids, "")``) and ``final`` (``_output``'s
        arguments), handed to ``deliver`` (handles, outputs)."""
        handles: list[int] = []
        outputs: list[Out] = []
        finished: list[Request] = []
        generated = 0
        # Rows to trim, in batch order; trimmed in one call before a finished row's slot
        # is released, so trims and releases keep the order of a row at a time.
        trims: list[Request] = []
        # Bound once: the usual row's work below runs per row per iteration.
        output, handle, emit, trim = usual, handles.append, outputs.append, trims.append
        try:
            for request, row, n in zip(batch, rows, accepted):
                n += 1      # the row's new tokens
                # A whole row is used as it is (no speculation: always; nothing keeps or
                # changes it), else its accepted part.
                new = row if n == len(row) else row[:n]
                token_ids = request.token_ids
                stops = request.stop_tokens
                if stops is None:
                    stops = self.rules(request)[1]
                length = len(token_ids) + n
                if length < request.stop_length and (not stops or stops.isdisjoint(new)):
                    # The usual row: no stop can match. Inline, one output built directly.
                    token_ids += new
                    request.num_cached = length - 1
                    generated += n
                    trim(request)
                    handle(request.handle)
                    emit(output(request.request_id, tuple(new), ""))
                    continue
                emitted, reason = self._commit_each(request, new)
                request.num_cached = len(token_ids) - 1
                generated += len(emitted)
                trim(request)
                if reason is not None:
                    finished.append(request)
                    self.runner.trim_many(trims)
                    trims = []
                    trim = trims.append
                    self._end(request, reason)
                if emitted or reason is not None:
                    handle(request.handle)
                    emit(final(request, emitted, reason is not None))
        finally:
            if trims:
                self.runner.trim_many(trims)
            self.stats.num_generated_tokens += generated
            if outputs:
                deliver(handles, outputs)
        return finished

    def _commit_each(self, request: Request, new_tokens: Sequence[int]
                     ) -> tuple[list[int], FinishReason | None]:
        emitted: list[int] = []
        for token in new_tokens:
            request.token_ids.append(token)
            emitted.append(token)
            reason = self.stop_reason(request, token)
            if reason is not None:
                return emitted, reason
        return emitted, None

    def stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.params
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if request.num_generated >= params.max_tokens:
            return FinishReason.LENGTH
        # The next VERIFY writes positions up to L - 1 + K: it must stay in the cache.
        if request.seq_len + self.k >= self.max_seq_len:
            return FinishReason.LENGTH
        return None

    def finish(self, request: Request, reason: FinishReason, emitted: Sequence[int]) -> None:
        self._end(request, reason)
        self.emit(request, emitted, finished=True)

    def _end(self, request: Request, reason: FinishReason) -> None:
        """Out of the batch: its slot freed in the scheduler, the runner and the drafter."""
        slot = request.slot
        self.scheduler.finish(request, reason)
        if slot is not None:
            self.runner.release(slot)
        if slot is not None and self.drafter is not None:
            self.drafter.release(slot)

    def emit(self, request: Request, tokens: Sequence[int], finished: bool = False) -> None:
        if not tokens and not finished:
            return
        if self.deliver_rows is not None:
            self.deliver_rows([self._row(request, tokens, finished)])
        else:
            self.deliver(request.handle, self._output(request, tokens, finished))

    @staticmethod
    def _output(request: Request, tokens: Sequence[int], finished: bool) -> RequestOutput:
        # Token ids only: text is decoded by the consumer (generate), off this hot path.
        return RequestOutput(request.request_id, tuple(tokens), "", finished,
                             request.finish_reason if finished else None)

    @staticmethod
    def _row(request: Request, tokens: Sequence[int], finished: bool) -> OutputRow:
        """``_output`` as an OutputRow."""
        return make_row(request.request_id, tuple(tokens), finished,
                        request.finish_reason if finished else None)

    def _hand_rows(self, handles: list[int], rows: list[OutputRow]) -> None:
        """``deliver_many``'s place for rows: the front door takes them without handles."""
        assert self.deliver_rows is not None, "rows only where the front door takes them"
        self.deliver_rows(rows)

    def _deliver_each(self, handles: list[int], outputs: list[RequestOutput]) -> None:
        for handle, output in zip(handles, outputs):
            self.deliver(handle, output)

    def cancel_all(self) -> None:
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            self.finish(request, FinishReason.CANCELLED, ())
