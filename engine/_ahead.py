"""The step queued one iteration ahead (no speculation, or adaptive K's K = 0; one GPU rank
or a group whose exchange runs on the host), and, under adaptive K on one GPU rank, what
VERIFY queues for the next iteration (``RunAhead.after_verify``: this step, or DRAFT +
VERIFY chained at the next K, engine/_chain.py).

After VERIFY n is queued and before it is read back, the next iteration's step for the same
batch is queued too (``queue``): its tokens are step n's outputs, still on the device, its
positions one further. The host then reads step n back and runs the next iteration's
SCHEDULE .. DRAFT while the GPU computes that step (issue 12: GPU busy at batch 1). The
next VERIFY uses it (``take``) when that iteration's batch is this one, or this one less
requests that have left, each one token longer; otherwise it is dropped: its K/V writes
then either hold the values the real step writes again, or land in pages freed after it
on the same stream (a finished request's), so dropping it is safe. On one rank a request
admitted while a step is queued ahead (or chained) joins the batch one iteration later
(``schedule``), in the step queued ahead for the batch and it (``queue``): under a
server's load, where a request ends and another arrives every iteration or two, the step
is then nearly always taken, at one iteration of the newcomer's first token.
When VERIFY n was the captured graph's last replay, for this very batch under the same key
(no request left or joined), the graph wrote the step's inputs itself (engine/_verify.py,
``feeds_itself``) and the step replays it with none (``in_graph``): nothing is copied
between the two graphs. docs/architecture.md, "One step ahead".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import attrs
import torch

from specloop.models._grad import inference, inference_mode
from specloop.models._host import int64_tensor, to_device

from ._request import Request
from ._verify import ahead_inputs

if TYPE_CHECKING:
    from specloop.graphs import GraphKey, Tensors

    from ._iteration import IterationRecord
    from ._runner import ReadBack
    from ._worker import Pending


@attrs.frozen
class Ahead:
    """A VERIFY step queued one iteration ahead."""

    batch: tuple[Request, ...]
    seq_lens: list[int]         # each request's length when the step is its own
    pending: Pending            # as RankWorker._queue_verify returns


class RunAhead:
    """The worker's step queued ahead. ``always``: after every VERIFY (no speculation);
    ``at_k0``: adaptive K on one GPU rank, where this also decides what the chain queues
    (``_adaptive_next``): the step ahead after a K = 0 VERIFY whose next iteration is
    committed to K = 0 too. ``take`` in VERIFY n+1, ``queue`` in VERIFY n; ``queued``:
    the step not taken yet (tests)."""

    def __init__(self, *, worker: Any, always: bool) -> None:
        self.worker = worker
        self.always = always
        self.at_k0 = False          # set at warm-up with adaptive K on one GPU rank
        self.queued: Ahead | None = None
        # Requests admitted while a step queued ahead (or chained) is on the device join
        # the batch at the next iteration, in the step the next VERIFY queues (``schedule``).
        self.joining: list[Request] = []
        self.joined_steps = 0       # for tests and benches: steps queued with joiners
        self._expected = False      # adaptive K: the last VERIFY queued this one's step
        # For tests and benches: steps taken by a VERIFY.
        self.taken_steps = 0
        # The captured K = 0 graph writes a step's inputs (``in_graph``); False: never read.
        self.in_graph = True
        self.in_graph_steps = 0     # steps queued with the inputs the graph wrote
        self.after_chain_steps = 0  # of them, after a K = 0 step the chain queued
        # Steps not queued: the batch's rows all end at the VERIFY before them
        # (``batch_likely_ends``); the chain's too (``DeviceChain.queue``).
        self.ends_skipped = 0
        self._chained_read: ReadBack | None = None     # that step's (``chained_k0``)
        # (key, batch, read-back) of the last VERIFY replayed from a captured graph.
        self._replayed: tuple[GraphKey, tuple[Request, ...], ReadBack] | None = None

    def take(self, rec: IterationRecord) -> tuple[Pending, Sequence[int]] | tuple[None, None]:
        """-> (the step queued ahead by the last VERIFY, the rows of it that are this
        batch's) when this batch is that step's less requests that left (same order,
        each one token longer); else (None, None), and the step is dropped. Sampling
        draws by (seed, position), so a row's result does not depend on the rows beside
        it."""
        ahead, self.queued = self.queued, None
        if ahead is None or rec.num_draft_tokens:
            return None, None
        rows = subset_rows(rec.batch, ahead.batch, ahead.seq_lens)
        if rows is None:
            return None, None
        self.taken_steps += 1
        return ahead.pending, rows

    def after_verify(self, rec: IterationRecord, pending: Pending, rows: Sequence[int],
                     taken: bool) -> tuple[bool, torch.Tensor | None]:
        """VERIFY n is queued, not read back (``taken``: it is a step queued ahead or
        chained by the last VERIFY): hand a K = 0 step's rows to the drafter, then queue
        what the next iteration runs when this path queues it; -> (whether the drafter
        was fed here, ``feed_k0``; VERIFY n's feature rows copied out when DRAFT + VERIFY
        were chained, ``DeviceChain.queue``)."""
        w = self.worker
        fed = self.at_k0 and rec.k == 0
        if fed:
            self.feed_k0(rec, pending[0], rows)
        if self.always:
            self.queue(rec, pending, rows)
            return fed, None
        if not self.at_k0:      # a fixed K: chained when the drafter chains
            return fed, w.chain.queue(rec, pending, rows) if w.chain is not None else None
        return fed, self._adaptive_next(rec, pending, rows, taken)

    def _adaptive_next(self, rec: IterationRecord, pending: Pending, rows: Sequence[int],
                       taken: bool) -> torch.Tensor | None:
        """Adaptive K on one GPU rank: the rule takes the next iteration's K now; when its
        step can be queued (K = 0 after K = 0: the step ahead; K > 0 after K > 0: DRAFT +
        VERIFY chained, engine/_chain.py), it is, and the next iteration is held to that
        K (``AdaptiveK.commit``). An iteration whose step was not queued ahead is followed
        by one at its own K that is (``stay``); it is not timed then, nor is one whose
        queued step was dropped (the device ran that one too): T(b, k) is what a stretch
        at k costs. -> as ``DeviceChain.queue``."""
        w, k, chain = self.worker, rec.k, self.worker.chain
        adaptive = w.adaptive
        assert adaptive is not None, "at_k0 is set with adaptive K"
        # The next iteration's rows' classes as the host knows them now (VERIFY n not
        # read back: one iteration behind its own SYNC's), which its record then counts.
        classes = w.draft_classes(rec.batch)
        # The next batch may draft the tree as this one may (a change drops the step); a
        # tree iteration's K, as the rule knows it, is the drafter's (the tree's depth).
        tree = w.tree_fits(rec.padded_batch_size, rec.spec)
        nxt = adaptive.next_k(rec.padded_batch_size, k if rec.tree is None else w.k,
                              stay=not taken, classes=classes,
                              tail_rows=w.tail_rows(rec.batch) if taken else 0, tree=tree)
        hidden, queued, ends = None, False, self.ends_skipped
        if nxt == 0 and k == 0:
            self.queue(rec, pending, rows)
            queued = self.queued is not None
        elif chain is not None and (nxt and k or chain.through_k0):
            # The tree's step where K = the drafter's stands for it (PICK_GRAPH_KEY's).
            hidden = chain.queue(rec, pending, rows,
                                 chain.tree_k if tree and nxt == w.k else nxt)
            queued = hidden is not None
        if queued:
            adaptive.commit(nxt)
            w.committed_classes = {} if classes is None else dict(zip(rec.batch, classes))
        else:
            w.runner.keep_ahead = 0
        dropped, self._expected = self._expected and not taken, queued
        # Nor is a batch's last iteration that ran unchained, queueing nothing as its rows
        # end there (a stretch's cost is that of chained iterations).
        w.clock.timed = w.clock.timed and not dropped and \
            (taken or not queued and self.ends_skipped == ends)
        return hidden

    def schedule(self, running: list[Request], admitted: list[Request]) -> list[Request]:
        """SCHEDULE's batch (a rank's): the running requests, less those just admitted
        (``admitted``, the last of them) when a step queued ahead or chained for the
        others is on the device: they join at the next iteration, in the step this
        iteration's VERIFY queues ahead (``queue``), or chains (``DeviceChain.queue``,
        where the drafter takes joiners in), so this one takes its step (a newcomer's
        first token comes one iteration later; SGLang's overlap scheduler makes the same
        trade). Never later: ``joining`` holds this SCHEDULE's newcomers only."""
        self.joining = []
        chain = self.worker.chain
        queued = self.queued is not None or (chain is not None and chain.has_step)
        if admitted and queued and len(running) > len(admitted):
            self.joining = admitted
            return running[:len(running) - len(admitted)]
        return list(running)

    def queue(self, rec: IterationRecord, pending: Pending, rows: Sequence[int]) -> None:
        """Queue the next iteration's step for this batch and the requests joining it
        there (``joining``, appended: the batch's order then), the batch's tokens rows
        ``rows`` of ``pending``'s outputs, the joiners' their prompt's last. Not when its
        position would lie past the cache."""
        w, batch = self.worker, rec.batch
        if self.blocked(batch):
            return
        joining = [r for r in self.joining if r.slot is not None]  # not cancelled since
        # (K = 0: only rows with one token left end at VERIFY n for certain)
        if not joining and self.skips_ending(batch, rec.k):
            return
        if joining:
            self._queue_joined(rec, pending, rows, joining)
            return
        # Pages for the position it writes, kept by RESCAN's trim.
        self._reserve(batch)
        seq_lens = [len(r.token_ids) + 1 for r in batch]
        if self._fed_in_graph(rec, pending):
            self.in_graph_steps += 1
            self.after_chain_steps += pending[1] is self._chained_read
            self.queued = Ahead(tuple(batch), seq_lens, w._queue_verify(rec, in_graph=True))
            return
        sampling = (w._sampling_batch(batch, rec.key.batch_size)
                    if rec.graph_captured else rec.batch_sampling)
        with inference():
            inputs = ahead_inputs(batch, pending[0]["token_ids"], rows, sampling,
                                  scratch_slot=w.runner.cache.scratch_slot,
                                  device=w.runner.device)
        self.queued = Ahead(tuple(batch), seq_lens, w._queue_verify(rec, inputs))

    def skips_ending(self, batch: Sequence[Request], most: int,
                     acceptance: Callable[[], Sequence[float]] | None = None) -> bool:
        """Whether no step is queued (or chained) behind VERIFY n because every row of
        ``batch`` likely ends there (``batch_likely_ends``, whose arguments these are):
        nothing would take it (batch 1's last iteration of each request), and its device
        work would run ahead of what comes next. Counted in ``ends_skipped``."""
        if not batch_likely_ends(batch, most, acceptance):
            return False
        self.worker.runner.keep_ahead = 0
        self.ends_skipped += 1
        return True

    def _reserve(self, batch: Sequence[Request]) -> None:
        """Pages for the position the step writes, kept by RESCAN's trim; where adaptive
        K's chain runs through K = 0 (n-gram), as far as a chained step reaches (2K + 1
        positions), so that the iteration leaving a K = 0 stretch finds the chained step's
        pages there: no page-table copy in its host work, which the switch pays (on this
        CPU ~90 µs of that iteration's reserve, half of it the copy), and a switch into
        K = 0 gives none back."""
        w, chain = self.worker, self.worker.chain
        if self.at_k0 and chain is not None and chain.through_k0:
            w.runner.reserve(batch, chain.keep_ahead - 1)
            w.runner.keep_ahead = chain.keep_ahead
        else:
            w.runner.reserve(batch, 1)
            w.runner.keep_ahead = 1

    def _queue_joined(self, rec: IterationRecord, pending: Pending, rows: Sequence[int],
                      joining: list[Request]) -> None:
        """``queue`` for the batch and ``joining`` after it: the step runs under the key
        PICK_GRAPH_KEY will take for that batch (its bucket, its sampling path)."""
        w = self.worker
        batch = [*rec.batch, *joining]
        for r in joining:   # their first step writes their prompt's last position
            w.runner.pages.resize(r.batch_slot, r.seq_len)
        self._reserve(rec.batch)
        key, captured, spec = w.next_key(rec, batch, rec.k)
        step = attrs.evolve(rec, batch=batch, spec=spec, padded_batch_size=len(batch),
                            graph_key=key, graph_captured=captured,
                            sampling=w._sampling_batch(batch, None))
        sampling = w._sampling_batch(batch, key.batch_size) if captured else \
            step.batch_sampling
        with inference():
            inputs = ahead_inputs(rec.batch, pending[0]["token_ids"], rows, sampling,
                                  scratch_slot=w.runner.cache.scratch_slot,
                                  device=w.runner.device, joining=joining)
        self.joined_steps += 1
        self.queued = Ahead(tuple(batch), [r.seq_len + 1 for r in rec.batch]
                            + [r.seq_len for r in joining], w._queue_verify(step, inputs))

    def replayed(self, rec: IterationRecord, pending: Pending) -> None:
        """``_queue_verify`` queued VERIFY (``pending``) for ``rec``."""
        self._replayed = (rec.key, tuple(rec.batch), pending[1]) if rec.graph_captured \
            else None

    def chained_k0(self, key: GraphKey, batch: tuple[Request, ...], read: ReadBack) -> None:
        """The chain queued a K = 0 VERIFY (``read``: its read-back) for ``batch`` by
        replaying the captured K = 0 graph under ``key``: as ``replayed``, so that the
        step queued ahead after it, at K = 0 again, replays with the inputs that graph
        wrote (``_fed_in_graph``) instead of building them on the host (adaptive n-gram
        switching into K = 0; its padding rows stay at the chained step's positions, in
        the scratch slot)."""
        self._replayed, self._chained_read = (key, batch, read), read

    def _fed_in_graph(self, rec: IterationRecord, pending: Pending) -> bool:
        """Whether the captured K = 0 graph already holds the step's inputs: VERIFY n
        (``pending``) was its last replay, for this batch (every row, in order: no
        request left since) under this key; its padding rows are then this batch's too,
        and it wrote each row's token and next position (``make_verify_step``)."""
        last, cache = self._replayed, self.worker.graph_cache
        feeds = getattr(cache, "feeds_itself", None)     # optional (graphs.GraphCache)
        return (self.in_graph and rec.graph_captured and not rec.k and last is not None
                and last[2] is pending[1] and last[0] == rec.key
                and last[1] == tuple(rec.batch) and feeds is not None and feeds(rec.key))

    def blocked(self, batch: list[Request]) -> bool:
        """Whether no step may be queued ahead for ``batch`` (see ``queue``): the position
        it writes, each row's length, must lie in the cache. A row that may end at this
        step (by max_tokens, a stop, the cache's length) does not block it: the next
        iteration takes the step for the rows left (``take``), and a finished row's write
        lands in pages freed after it on the stream (the module doc)."""
        limit = self.worker.config.model.max_seq_len
        if batch and max(map(len, [r.token_ids for r in batch])) >= limit:
            self.worker.runner.keep_ahead = 0
            return True
        return False

    @inference_mode
    def feed_k0(self, rec: IterationRecord, out: Tensors, rows: Sequence[int]) -> None:
        """A K = 0 iteration of adaptive K on one GPU rank: hand the drafter its rows now
        (every count is 0), before a step queued ahead reuses the graph's output buffers."""
        w = self.worker
        if w.on_verified is None:
            return
        batch, hidden = rec.batch, out["hidden"]
        if list(rows) == list(range(len(batch))):
            hidden = hidden[:len(batch)]
        else:   # requests left since the step was queued (no blocking copy: no sync)
            index = to_device(int64_tensor(rows), hidden.device)
            hidden = hidden.index_select(0, index)
        w.on_verified([r.batch_slot for r in batch], [r.seq_len - 1 for r in batch],
                      hidden, [0] * len(batch))


# A step is not queued behind VERIFY n when the batch's rows all end there by length with
# at least this probability (``batch_likely_ends``).
ENDS_LIKELY = 0.5


def batch_likely_ends(batch: Sequence[Request], most: int,
                      acceptance: Callable[[], Sequence[float]] | None = None) -> bool:
    """Whether VERIFY n (queued, not read back) likely ends every row of ``batch`` by
    length (max_tokens, or the cache's: ``Request.stop_length``), so that a step queued
    behind it for the same rows would be device work thrown away, ahead of whatever the
    host queues next (at batch 1: the next request's prefill). VERIFY n commits 1 +
    accepted tokens a row, at most ``most`` accepted (its K, a tree's depth): a row with
    one token left ends for certain; with ``left`` more, with the probability that
    ``left - 1`` drafts or more are accepted, ``acceptance()[left - 2]`` (the rank's
    acceptance per position, at-least counts: ``EngineStats``), asked only then; the
    rows independently, ENDS_LIKELY or more for all. A stop token may end rows sooner:
    not counted (a step queued then is dropped, as before). Early out at the first row
    that keeps the product below the bar (usually the first row: no per-row work)."""
    p, rates = 1.0, None
    for r in batch:
        limit = r.stop_length
        if not limit:       # no length to end by
            return False
        left = limit - len(r.token_ids)
        if left <= 1:
            continue
        if left - 1 > most or acceptance is None:
            return False
        if rates is None:
            rates = acceptance()
        p *= rates[left - 2] if left - 2 < len(rates) else 0.0
        if p < ENDS_LIKELY:
            return False
    return bool(batch)


def subset_rows(batch: Sequence[Request], queued: Sequence[Request], seq_lens: Sequence[int]
                ) -> list[int] | None:
    """The rows of a step queued for ``queued`` (each request then ``seq_lens`` long) that
    are ``batch``'s, when ``batch`` is ``queued`` less requests that left, in the same
    order, each exactly that long; else None (the step is not this batch's)."""
    if len(batch) > len(queued):
        return None
    if len(batch) == len(queued):   # the usual case: the same batch (else not its step)
        same = tuple(batch) == tuple(queued) and \
            [len(r.token_ids) for r in batch] == list(seq_lens)
        return list(range(len(batch))) if same else None
    rows: list[int] = []
    i = 0
    for request in batch:
        while i < len(queued) and queued[i] is not request:
            i += 1
        if i == len(queued) or request.seq_len != seq_lens[i]:
            return None
        rows.append(i)
        i += 1
    return rows
