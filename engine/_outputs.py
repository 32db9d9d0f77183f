"""RESCAN's bookkeeping: commit accepted tokens, apply the stop rules, emit outputs,
and free a finished request's slot (in the runner and the drafter)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from ._request import FinishReason, Request, RequestOutput

if TYPE_CHECKING:
    from specloop.models.drafters import Drafter

    from ._config import EngineConfig
    from ._runner import ModelRunner
    from ._scheduler import Scheduler
    from ._stats import EngineStats


class Outputs:
    def __init__(self, *, config: EngineConfig, scheduler: Scheduler, runner: ModelRunner,
                 drafter: Drafter | None, stats: EngineStats,
                 deliver: Callable[[int, RequestOutput], None]) -> None:
        self.k = config.speculative.k
        self.max_seq_len = config.model.max_seq_len
        self.scheduler = scheduler
        self.runner = runner
        self.drafter = drafter
        self.stats = stats
        self.deliver = deliver
        self.eos_token_ids = frozenset(runner.loaded.tokenizer.eos_token_ids)

    def append(self, request: Request, new_tokens: list[int], num_accepted: int,
               k: int | None = None) -> None:
        """``k``: the drafts this iteration proposed (adaptive K); None: the configured K."""
        request.num_iterations += 1
        request.num_drafted += self.k if k is None else k
        request.num_accepted += num_accepted
        if self._no_stop_in(request, new_tokens):
            # Most rows, most iterations: no stop token and no limit reached, so all are
            # committed at once (the per-token rules cost ~2 us a row at batch 64).
            request.token_ids.extend(new_tokens)
            emitted, reason = new_tokens, None
        else:
            emitted, reason = self._commit_each(request, new_tokens)
        request.num_cached = request.seq_len - 1
        self.stats.num_generated_tokens += len(emitted)
        self.runner.trim(request)
        if reason is not None:
            self.finish(request, reason, emitted)
        else:
            self.emit(request, emitted)

    def _commit_each(self, request: Request, new_tokens: list[int]
                     ) -> tuple[list[int], FinishReason | None]:
        emitted: list[int] = []
        for token in new_tokens:
            request.token_ids.append(token)
            emitted.append(token)
            reason = self.stop_reason(request, token)
            if reason is not None:
                return emitted, reason
        return emitted, None

    def _no_stop_in(self, request: Request, new_tokens: list[int]) -> bool:
        """Whether ``stop_reason`` is None after each of ``new_tokens`` (same rules)."""
        params = request.params
        limit = min(len(request.prompt_ids) + params.max_tokens, self.max_seq_len - self.k)
        if len(request.token_ids) + len(new_tokens) >= limit:
            return False
        if not params.ignore_eos and not self.eos_token_ids.isdisjoint(new_tokens):
            return False
        stops = params.stop_token_ids
        return not stops or not any(token in stops for token in new_tokens)

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
        slot = request.slot
        self.scheduler.finish(request, reason)
        if slot is not None:
            self.runner.release(slot)
        if slot is not None and self.drafter is not None:
            self.drafter.release(slot)
        self.emit(request, emitted, finished=True)

    def emit(self, request: Request, tokens: Sequence[int], finished: bool = False) -> None:
        if not tokens and not finished:
            return
        # Token ids only: text is decoded by the consumer (generate), off this hot path.
        output = RequestOutput(request.request_id, tuple(tokens), "", finished,
                               request.finish_reason if finished else None)
        self.deliver(request.handle, output)

    def cancel_all(self) -> None:
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            self.finish(request, FinishReason.CANCELLED, ())
