"""Speculation with the next iteration chained on the device (a GPU rank, CUDA graphs; in
a group only where the step holds no collective and K is fixed: ``RankWorker.chain``).

After VERIFY n is queued and before it is read back, the next iteration's DRAFT and VERIFY
are queued too, their inputs built on the GPU from VERIFY n's outputs: the head's
catch-up is VERIFY n's K + 1 feature rows and tokens (``Drafter.chained_inputs``; the
``mtp_eagle``/``eagle3`` draft graph computes the rest itself), its K drafts and VERIFY
n's bonus token are VERIFY n+1's tokens, one position past the accepted ones. The host
then reads VERIFY n back and runs RESCAN, SCHEDULE .. DRAFT of n+1 while the GPU computes
n+1, as the no-speculation step queued ahead does (``RunAhead``, engine/_ahead.py);
nothing waits for the host between the stages.

Iteration n+1 uses the chained step when its batch is the same requests in the same order,
or those less requests that left, each exactly as long as VERIFY n made it, under the
same graph key (requests admitted meanwhile join one iteration later, ``RunAhead.schedule``,
in the step chained for the batch and them: each joins as if a VERIFY had left it one
position before its prompt's last, nothing accepted, ``Drafter.chains_joiners``); DRAFT
then skips the drafter and VERIFY takes the queued step. Otherwise it is dropped: its K/V writes (target
and head) lie at positions the real steps of n+1 write again before any query reads them,
or in pages freed after it on the same stream (a finished request's), so dropping it is
safe, and the drafter still has VERIFY n's rows (``on_verified`` runs either way).
Exactness: the chained draft reads the same rows, tokens and positions the drafter's own
replay would (the rows past the accepted ones differ, and no real row reads them), and
the same captured graphs run, so outputs are those of the unchained path bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import attrs
import torch

from specloop.graphs import GraphKey
from specloop.models._grad import inference
from specloop.models._host import int64_tensor, to_device

from ._ahead import subset_rows
from ._request import Request

if TYPE_CHECKING:
    from ._iteration import IterationRecord
    from ._worker import Pending


# ``DeviceChain.queue``'s rows when no drafter observes VERIFY (``on_verified`` None):
# queued, nothing kept, and nothing reads them.
NOT_KEPT = torch.empty(0)


@attrs.frozen
class _Queued:
    """A DRAFT + VERIFY queued one iteration ahead, before VERIFY n is read back."""

    batch: tuple[Request, ...]
    slots: list[int]            # the batch's slots
    start: list[int]            # each request's length - 1 at VERIFY n
    key: GraphKey
    pending: Pending            # (VERIFY's outputs, ReadBack), as _queue_verify returns


@attrs.frozen
class _Chained:
    """A queued DRAFT + VERIFY once VERIFY n is read back."""

    queued: _Queued
    seq_lens: list[int]         # each request's length when the step is its own


class DeviceChain:
    """The worker's chained DRAFT + VERIFY (see the module doc). ``queue`` right after
    VERIFY n is queued, ``collected`` once it is read back; at n+1 ``matches`` in DRAFT,
    ``take`` in VERIFY."""

    def __init__(self, *, worker: Any) -> None:
        self.worker = worker
        self.drafter = worker.drafter
        self.k = self.drafter.num_draft_tokens
        # One rank of a group: its keys' buckets are agreed in SYNC (``_own_key``).
        self.group = worker.comm.world_size > 1
        # Adaptive K: a drafter whose chained draft reads tokens only chains into and out
        # of K = 0 too (``Drafter.chains_through_k0``: n-gram), else K > 0 to K > 0 only.
        self.through_k0 = self.drafter.chains_through_k0
        # A draft tree (``speculative.tree``): a tree iteration's chained step drafts and
        # verifies the tree again (its keys: K = the tree's node count), another the chain.
        tree = worker.tree
        self.tree_k = 0 if tree is None else tree.size
        # Pages RESCAN keeps past the committed K/V while chaining: the K + 1 positions of
        # the tokens VERIFY n may accept, then the rows the chained step writes past them
        # (its VERIFY's K + 1, a tree's node count + 1; the catch-up's K + 1).
        self.keep_ahead = self.k + 1 + max(self.k, self.tree_k) + 1
        self._queued: _Queued | None = None     # until VERIFY n is read back
        self._chained: _Chained | None = None
        self._matched: tuple[Pending, Sequence[int]] | None = None
        # (VERIFY's key, K) -> (the chained VERIFY's key, its draft graph's key)
        self._keys: dict[tuple[GraphKey, int], tuple[GraphKey, GraphKey]] = {}
        # (a larger bucket's key, the batch's rows, the next K) -> the rows' own bucket's
        self._own: dict[tuple[GraphKey, int, int], GraphKey] = {}
        self._slots: tuple[tuple[Request, ...], list[int]] = ((), [])  # the last batch's
        # The chained step taken (its outputs): its requests hold the next step's pages.
        self._kept: Pending | None = None
        # Whether it was taken for its whole batch (no request left): the next step then
        # continues it for the same rows (``chained_inputs``' ``continued``).
        self._kept_whole = False
        self._matched_whole = False
        # For tests and benches: steps queued, taken, taken for fewer requests, queued
        # into or out of K = 0 (``through_k0``), queued at a smaller bucket than their
        # iteration's (``_own_key``).
        self.queued_steps = self.taken_steps = self.subset_steps = self.k0_steps = 0
        self.shrunk_steps = 0
        self.joined_steps = 0       # queued with requests joining the batch

    # iteration n ------------------------------------------------------------------------
    def queue(self, rec: IterationRecord, pending: Pending, rows: Sequence[int],
              k: int | None = None) -> torch.Tensor | None:
        """Queue DRAFT + VERIFY of iteration n+1, drafting ``k`` (adaptive K's next
        choice; by default the drafter's K), behind VERIFY n (``pending``, whose rows
        ``rows`` are the batch's: fewer than its own when requests left); -> VERIFY n's
        feature rows of the batch [B, K_n+1, F*H] copied out (the chained VERIFY
        overwrites its static outputs before the host hands them to ``on_verified``), or
        None when nothing was queued."""
        w = self.worker
        self._queued = self._chained = self._matched = None
        kept, self._kept = self._kept is pending, None
        if k is None:   # a tree iteration's next step drafts the tree again
            k = self.tree_k if rec.tree is not None else self.k
        batch = tuple(rec.batch)
        # Requests admitted now join at the next iteration: in this step, after the batch.
        joining = self._joining()
        if not joining and w.ahead.skips_ending(
                rec.batch, rec.k if rec.tree is None else rec.tree.depth,
                lambda: w.stats.acceptance_per_position):
            return None
        full = batch if not joining else (*batch, *joining)
        lengths = [len(r.token_ids) for r in full]      # seq_len
        own = self._own_key(rec, k) if not joining else self._joined_key(rec, full, k)
        if own is None or not self._can_queue(rec, own, k, lengths, joining):
            w.runner.keep_ahead = 0
            return None
        key, draft_key = self._keys_for(own, k)
        # The draft graph goes on from its own last replay only under the same key.
        continued = kept and self._kept_whole and own == rec.key and not joining
        real, padded = len(full), key.batch_size
        # Pages for every position n+1 may write: up to K + 1 accepted now, then the
        # catch-up's K + 1 rows (K the drafter's: its graph's width). RESCAN's trim keeps
        # as many past the committed K/V (n+1 writes K + 1 of them), so that a page is
        # not given back at each RESCAN and taken again here (churn; a page table sync).
        # After a taken chained step every request of the batch holds them already (it
        # was in that step's batch, and RESCAN trimmed it to them): the table's sync only.
        # A joining request's step writes from its prompt's last position on.
        if kept and not joining:
            w.runner.pages.sync()
        else:
            w.runner.reserve(joining if kept else full, self.keep_ahead - 1)
        w.runner.keep_ahead = self.keep_ahead
        with inference():
            # The glue is written straight into the graphs' static inputs where the cache
            # shows them: no device-to-device copy per input at the replays.
            statics = getattr(w.graph_cache, "static_inputs", None)
            into = verify_in = None
            if statics is not None:
                verify_in = statics(key)
                into = statics(draft_key)
            # VERIFY n's feature rows: read by a head's chained draft, kept for
            # ``on_verified``; a drafter chaining through K = 0 reads tokens only.
            keeps = w.on_verified is not None
            wants = keeps or not self.through_k0
            if joining:
                out = self._joined_rows(pending[0], rows, joining, padded, wants, into)
            else:
                out = self._rows(pending[0], rows, padded, self.k + 1, hidden=wants,
                                 into=into)
            sampling = w._sampling_batch(list(full), padded)
            # A joining row: as if a VERIFY had left it at its prompt's last position
            # less one (P - 2), nothing accepted, the prompt's last token its bonus.
            start = [n - 1 for n in lengths[:len(batch)]] + \
                [n - 2 for n in lengths[len(batch):]]
            slots = self._slots_of(full)
            draft_in = self.drafter.chained_inputs(out, start, slots, sampling, into=into,
                                                   tokens=[r.token_ids for r in full],
                                                   continued=continued)
            drafted = w.graph_cache.replay(draft_key, draft_in)
            hidden = self._hidden_kept(out["hidden"], into, len(batch), rec.k + 1) \
                if keeps else NOT_KEPT
            # The draft graph computed VERIFY n+1's tokens and positions (and a drafter's
            # may give its slots): VERIFY's own static inputs where the graph wrote them
            # there (graphs/_capture.into_verify_inputs: the replay copies nothing); else
            # fresh views, as a replay copies only an input it has not seen (these change
            # at every replay).
            inputs = {name: _own_or_view(drafted[name], verify_in, name)
                      for name in ("tokens", "start_pos", "slots") if name in drafted}
            if "slots" not in inputs:
                inputs["slots"] = draft_in["slots"]
            inputs.update(sampling.columns())
            if "probs" in drafted:      # a fresh view: replay copies inputs it has not seen
                inputs["draft_probs"] = drafted["probs"][:]
            next_out = w.graph_cache.replay(key, inputs)
            read = w.runner.start_read_back(next_out["packed"][:real])
        if not k:   # the K = 0 graph: a step queued ahead after it takes the inputs it wrote
            w.ahead.chained_k0(key, full, read)
        self._queued = _Queued(full, slots, start, key, (next_out, read))
        self.queued_steps += 1
        self.k0_steps += not (rec.k and k)
        self.shrunk_steps += own != rec.key and not joining
        self.joined_steps += bool(joining)
        return hidden

    def _joining(self) -> list[Request]:
        """The requests this iteration admitted, which join the batch at the next one
        (``RunAhead.joining``, less those cancelled since): the chained step takes them
        in where the drafter can (``Drafter.chains_joiners``) and each prompt has two
        tokens or more (a one-token prompt leaves its head no target row); else none
        (``_can_queue`` then queues no step: they join one iteration later, unchained)."""
        joining = [r for r in self.worker.ahead.joining if r.slot is not None]
        if joining and self.drafter.chains_joiners and \
                all(len(r.token_ids) >= 2 for r in joining):
            return joining
        return []

    def _joined_key(self, rec: IterationRecord, full: tuple[Request, ...], k: int
                    ) -> GraphKey | None:
        """The key PICK_GRAPH_KEY takes at the next iteration for the batch and the
        requests joining it (``full``), when captured; else None (no step queued)."""
        key, captured, _ = self.worker.next_key(rec, list(full), k)
        return key if captured else None

    def _joined_rows(self, verified: dict[str, torch.Tensor], rows: Sequence[int],
                     joining: Sequence[Request], padded: int, hidden: bool,
                     into: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """VERIFY n's rows of the batch (``rows`` of ``verified``), each padded to the draft
        graph's catch-up width, followed by a row for each joining request, as
        ``Drafter.chains_joiners`` has it (its prompt's last token, then -1, count 0;
        feature row 0 the drafter's ``joining_rows``, the rest zero), then padding rows
        (zero) up to ``padded``. Written into the draft graph's static inputs where
        ``into`` shows a head's (``_joined_into``: under a server's load most iterations
        of a large batch take a joiner, and an adaptive K narrower than the graph would
        otherwise pad its rows in new tensors, concatenate them again and have the
        replay copy both); else new tensors."""
        width = self.k + 1
        first = self.drafter.joining_rows([r.batch_slot for r in joining])
        real = len(rows)
        if into is not None and hidden and first is not None:
            written = self._joined_into(self._rows(verified, rows, real, width, pad=False),
                                        joining, first, into, padded)
            if written is not None:
                return written
        out = self._rows(verified, rows, real, width, hidden=hidden)
        packed, features = out["packed"], out["hidden"]
        columns = packed.shape[1]
        extra = padded - real
        added = to_device(int64_tensor(self._joiner_rows(joining, extra, columns)),
                          packed.device).view(extra, columns)
        packed = torch.cat([packed, added.to(packed.dtype)])
        if first is not None:
            joiners = features.new_zeros(extra, features.shape[1], features.shape[2])
            joiners[:len(joining), 0] = first
            features = torch.cat([features[:real], joiners])
        return {"packed": packed, "hidden": features, "token_ids": packed[:, :-1],
                "num_accepted": packed[:, -1]}

    @staticmethod
    def _joiner_rows(joining: Sequence[Request], extra: int, columns: int) -> list[int]:
        """The joining rows and the padding rows after them, ``columns`` each (VERIFY's
        layout: the tokens, then the count), flat: a joiner's prompt's last token, -1 in
        the other token columns, count 0; padding rows zero."""
        host = [0] * (extra * columns)
        for i, r in enumerate(joining):
            host[i * columns:(i + 1) * columns] = \
                [r.token_ids[-1], *[-1] * (columns - 2), 0]
        return host

    def _joined_into(self, out: dict[str, torch.Tensor], joining: Sequence[Request],
                     first: torch.Tensor, into: dict[str, torch.Tensor], padded: int
                     ) -> dict[str, torch.Tensor] | None:
        """``_joined_rows`` written into a head's draft graph's static inputs
        (``verified`` [padded, width + 1], the count last, and ``cu_hidden`` [padded,
        width, F]): the batch's rows (``out``, VERIFY n's K_n + 1 token columns, maybe
        fewer than ``width``: the columns past them keep what the last replay left, past
        every row's accepted count, as ``_into_statics``), then the joiners' and padding
        rows whole. None where ``into`` lacks the inputs or they are not those shapes."""
        verified, static = into.get("verified"), into.get("cu_hidden")
        width = self.k + 1
        if verified is None or static is None or verified.shape != (padded, width + 1) or \
                static.shape != (padded, width, out["hidden"].shape[2]):
            return None
        real = out["packed"].shape[0]
        # The batch's rows: as a narrower VERIFY's go in (its first ``real`` rows).
        self._into_statics(out["packed"], out["hidden"],
                           {"verified": verified[:real], "cu_hidden": static[:real]}, width,
                           True)
        extra = padded - real
        added = to_device(int64_tensor(self._joiner_rows(joining, extra, width + 1)),
                          verified.device)
        verified[real:].copy_(added.view(extra, width + 1), non_blocking=True)
        static[real:].zero_()
        static[real:real + len(joining), 0] = first
        return {"packed": verified, "hidden": static, "token_ids": verified[:, :-1],
                "num_accepted": verified[:, -1]}

    @staticmethod
    def _hidden_kept(verified: torch.Tensor, into: dict[str, torch.Tensor] | None,
                     real: int, width: int) -> torch.Tensor:
        """VERIFY n's feature rows of the batch [real, width, F*H], kept past the chained
        VERIFY (which overwrites ``verified``): the draft graph's static ``cu_hidden``
        holds them once replayed (only its next replay overwrites it, and that comes
        after DRAFT n+1 read or dropped the rows ``on_verified`` recorded:
        models/drafters/_pending_rows.py), else a copy."""
        static = None if into is None else into.get("cu_hidden")
        if static is not None and static.shape == verified.shape:
            return static[:real, :width]
        return verified[:real, :width].clone()

    @staticmethod
    def _rows(out: dict[str, torch.Tensor], rows: Sequence[int], padded: int, width: int,
              hidden: bool = True, into: dict[str, torch.Tensor] | None = None,
              pad: bool = True) -> dict[str, torch.Tensor]:
        """VERIFY's outputs the chain reads, ``padded`` rows, with the batch's rows first
        when requests left since that VERIFY was queued (its padding rows after them: any
        row; a K = 0 step queued ahead, or a chained step, for more requests may have
        more rows: a larger bucket than the batch's own, ``_own_key``), its
        columns padded to the draft graph's catch-up ``width`` (adaptive K: VERIFY n
        drafted fewer; the padding columns lie past the accepted row, as the graph's own
        padding: token 0, zero features). ``hidden`` False (a drafter chaining through
        K = 0, which reads tokens only): the feature rows are not read, and left as VERIFY
        wrote them. A narrower VERIFY's rows, in order, are copied into the draft graph's
        static inputs where ``into`` shows them (``_into_statics``: no padded tensors,
        and the replay copies none of them); their padding columns are then whatever the
        last replay left there, which no real row reads. ``pad`` False: a narrower
        VERIFY's rows are returned narrower (``_joined_into`` writes them)."""
        short = width - out["token_ids"].shape[1] if pad else 0
        packed, features = out["packed"], out["hidden"]
        ordered = in_order(rows)
        if ordered and short <= 0 and packed.shape[0] == padded:
            return out      # the usual case: VERIFY's outputs as they are
        if ordered and short > 0 and packed.shape[0] >= padded:
            written = DeviceChain._into_statics(packed[:padded], features[:padded], into,
                                                width, hidden)
            if written is not None:
                return written
        if ordered and packed.shape[0] >= padded:
            # A step queued ahead for more requests than are left (the larger bucket).
            packed, features = packed[:padded], features[:padded]
        else:
            at = int64_tensor([*rows, *[0] * (padded - len(rows))])
            at = to_device(at, packed.device)
            packed = packed.index_select(0, at)
            if hidden:
                features = features.index_select(0, at)
            if short > 0:   # requests left: their rows gathered, then into the statics
                written = DeviceChain._into_statics(packed, features, into, width, hidden)
                if written is not None:
                    return written
        if short > 0:
            packed = torch.cat([packed[:, :-1], packed.new_zeros(packed.shape[0], short),
                                packed[:, -1:]], dim=1)
            if hidden:
                features = torch.cat([features, features.new_zeros(
                    features.shape[0], short, features.shape[2])], dim=1)
        # VERIFY's layout (the tokens, then the count), its parts as views.
        return {"packed": packed, "hidden": features, "token_ids": packed[:, :-1],
                "num_accepted": packed[:, -1]}

    @staticmethod
    def _into_statics(packed: torch.Tensor, features: torch.Tensor,
                      into: dict[str, torch.Tensor] | None, width: int, hidden: bool
                      ) -> dict[str, torch.Tensor] | None:
        """VERIFY n's tokens and counts (``packed`` [padded, K_n + 2], fewer token columns
        than the draft graph's ``width``, or as many: ``_joined_into``'s rows at the
        largest K) and, with ``hidden``, its feature rows
        (``features`` [padded, K_n + 1, F]) copied into the draft graph's static inputs,
        which are returned in ``_rows``' form (the replay then copies none of them):

        - a head's graph (``verified`` [padded, width + 1] in VERIFY's layout, the count
          last, and ``cu_hidden`` [padded, width, F]): under adaptive K each iteration
          drafting fewer than the largest K would otherwise pad both in new tensors (two
          allocations, fills and concatenations) that the replay copies again (on this
          repository's CPU ~50 µs of host work an iteration at batch 64,
          ``bench_chain_host.py --cycle 3,3,3,3,3,2,2,2,2,2 --cycle-batch 64``);
        - a drafter chaining through K = 0 (``verified`` [padded, width] and
          ``accepted``): an n-gram step out of K = 0 (or out of a smaller K) pays two
          copies instead (on the H200, with ``_copy_meta``'s packing, ~0.1 ms of the
          ~0.8 ms of host work of the iteration leaving a K = 0 stretch:
          docs/performance-history.md, "Leaving a K = 0 stretch (tenth session)");
          ``hidden`` is then False and ``features`` returned as they are.

        The columns past VERIFY n's keep what the last replay left: they lie past every
        row's accepted count, where no real row's draft reads (a head's catch-up computes
        them, causally after the real ones, and its K/V there is written again before
        any query reads it). None where ``into`` lacks the inputs, or they are not those
        shapes."""
        if into is None:
            return None
        verified = into.get("verified")
        rows, n = packed.shape[0], packed.shape[1] - 1      # n: VERIFY n's token columns
        if verified is None:
            return None
        if hidden:      # a head's: VERIFY's layout, and its feature rows
            static = into.get("cu_hidden")
            if verified.shape != (rows, width + 1) or static is None or \
                    static.shape != (rows, width, features.shape[2]):
                return None
            static[:, :n].copy_(features, non_blocking=True)
            if n == width:      # VERIFY's own layout (``_joined_into``'s rows at K_max)
                verified.copy_(packed, non_blocking=True)
            else:
                verified[:, :n].copy_(packed[:, :-1], non_blocking=True)
                verified[:, width].copy_(packed[:, -1], non_blocking=True)
            return {"packed": verified, "hidden": static, "token_ids": verified[:, :-1],
                    "num_accepted": verified[:, -1]}
        accepted = into.get("accepted")
        if accepted is None or verified.shape != (rows, width) or accepted.shape != (rows,):
            return None
        verified[:, :n].copy_(packed[:, :-1], non_blocking=True)
        accepted.copy_(packed[:, -1], non_blocking=True)
        return {"token_ids": verified, "num_accepted": accepted, "hidden": features}

    def _slots_of(self, batch: tuple[Request, ...]) -> list[int]:
        """The batch's slots (one list per batch: most iterations run the last one's)."""
        if self._slots[0] != batch:
            self._slots = (batch, [r.batch_slot for r in batch])
        return self._slots[1]

    def _own_key(self, rec: IterationRecord, k: int) -> GraphKey:
        """The key of the batch's own bucket: ``rec.key``, unless this iteration took a
        chained step queued for more requests at a larger bucket (``key_for``), whose
        rows the batch now fits in a smaller one; the step queued next runs there (a
        closed round's last rows, after the others finished, would otherwise pay the
        round's full bucket at every iteration: on the H200, K = 3 at batch 8 iterated in
        ~1.1 ms down to its last row, against ~0.7 ms at bucket 1). The bucket is the
        one for the next step's K = ``k`` (the key keeps ``rec.key``'s K: ``_keys_for``
        sets the next)."""
        key, rows = rec.key, len(rec.batch)
        # In a group the key's bucket is the group's (SYNC's padded batch): a rank's own
        # smaller one would never match the next iteration's.
        if key.batch_size <= rows or not rows or not rec.graph_captured or self.group:
            return key
        own = self._own.get((key, rows, k))
        if own is None:
            picked, captured = self.worker.graph_cache.pick(
                rows, k, key.sampling_path, key.all_greedy)
            own = self._own[key, rows, k] = \
                attrs.evolve(picked, num_draft_tokens=key.num_draft_tokens) if captured else key
        return own

    def _keys_for(self, key: GraphKey, k: int) -> tuple[GraphKey, GraphKey]:
        """(the chained VERIFY's key at K = ``k``, its draft graph's key)."""
        keys = self._keys.get((key, k))
        if keys is None:
            chained = attrs.evolve(key, num_draft_tokens=k)
            keys = self._keys[key, k] = (chained, attrs.evolve(chained, stage="draft"))
        return keys

    def _can_queue(self, rec: IterationRecord, own: GraphKey, k: int, lengths: list[int],
                   joining: Sequence[Request]) -> bool:
        """Not when requests admitted now join the next iteration and the step cannot
        take them in (``_joining`` gave none of ``RunAhead.joining``: the chained step
        would be dropped; one waiting to be admitted is held back an iteration instead,
        as the step queued ahead does), when a position it writes may lie past the
        cache, off the captured graphs (at the next K), or, unless the drafter chains
        through K = 0, after a VERIFY that drafted nothing (adaptive K's K = 0: a head
        then has more rows to catch up on than VERIFY n's) or before one; never from
        K = 0 to K = 0 (the step queued ahead without a drafter, engine/_ahead.py).
        ``own``: the key of the batch and ``joining`` (``_own_key``, ``_joined_key``),
        ``lengths``: their lengths."""
        w = self.worker
        if not rec.graph_captured or not rec.batch or not (rec.k or k):
            return False
        if not (rec.k and k) and not self.through_k0:
            return False
        key, draft_key = self._keys_for(own, k)
        if not (w.graph_cache.has(key) and w.graph_cache.has(draft_key)):
            return False
        if max(lengths) + self.keep_ahead > w.config.model.max_seq_len:
            return False
        return bool(joining) or not w.ahead.joining

    def collected(self, rec: IterationRecord) -> None:
        """VERIFY n is read back: the lengths the chained step assumed are now known."""
        queued, self._queued = self._queued, None
        if queued is None or rec.result is None:
            return
        # Rows joining in the chained step come after VERIFY n's, nothing accepted.
        grown = rec.result.num_accepted.tolist()
        grown += [0] * (len(queued.start) - len(grown))
        self._chained = _Chained(queued, [s + n + 2 for s, n in zip(queued.start, grown)])

    # iteration n+1 ----------------------------------------------------------------------
    @property
    def has_step(self) -> bool:
        """Whether a chained step waits for iteration n+1 (SCHEDULE then holds back the
        requests it admits one iteration: ``RunAhead.schedule``)."""
        return self._chained is not None

    def key_for(self, key: GraphKey, rows: int) -> GraphKey:
        """PICK_GRAPH_KEY's ``key`` for a batch of ``rows``, or the chained step's key
        when the two differ only in its larger batch bucket, which still holds the rows:
        requests that left since it was queued let the batch fit a smaller bucket, and
        that key would drop the step the GPU has already run (then run DRAFT and VERIFY
        again, unchained). Only for that iteration: the step it queues runs at the
        batch's own bucket (``_own_key``)."""
        chained = self._chained
        if chained is None:
            return key
        queued = chained.queued.key
        if queued.batch_size > key.batch_size >= rows and \
                attrs.evolve(queued, batch_size=key.batch_size) == key:
            return queued
        return key

    def matches(self, rec: IterationRecord) -> bool:
        """In DRAFT: whether the chained step is this iteration's: its batch, or its
        batch less requests that left, in the same order, each as long as VERIFY n made
        it (then the drafter is not called: its catch-up rows were fed on the device; a
        row's draft and VERIFY do not depend on the rows beside it). Drops it otherwise."""
        chained, self._chained, self._matched = self._chained, None, None
        if chained is None or not rec.batch:
            return False
        queued, batch = chained.queued, rec.batch
        if rec.key != queued.key or len(batch) > len(queued.batch):
            return False
        self._matched_whole = len(batch) == len(queued.batch)
        if len(batch) == len(queued.batch):     # the same batch (the usual case)
            rows: Sequence[int] = range(len(batch))
            if tuple(batch) != queued.batch or \
                    [len(r.token_ids) for r in batch] != chained.seq_lens:
                return False
            slots = queued.slots
        else:
            subset = subset_rows(batch, queued.batch, chained.seq_lens)
            if subset is None:
                return False
            rows, slots = subset, [queued.slots[i] for i in subset]
            self.subset_steps += 1
        self.drafter.chained_consumed(slots)
        self._matched = (queued.pending, rows)
        return True

    @property
    def matched(self) -> bool:
        """Whether this iteration's DRAFT matched the chained step (``matches``)."""
        return self._matched is not None

    def take(self) -> tuple[Pending, Sequence[int]] | tuple[None, None]:
        """In VERIFY: (the chained step's (outputs, ReadBack), the rows of it that are
        this batch's) when DRAFT matched it, else (None, None)."""
        matched, self._matched = self._matched, None
        if matched is None:
            return None, None
        if self.worker.runner.keep_ahead == self.keep_ahead:    # RESCAN trimmed to them
            self._kept, self._kept_whole = matched[0], self._matched_whole
        self.taken_steps += 1
        return matched


def in_order(rows: Sequence[int]) -> bool:
    """Whether ``rows`` are 0, 1, .. (every row of the step, in order)."""
    if isinstance(rows, range):
        return rows.start == 0 and rows.step == 1
    return list(rows) == list(range(len(rows)))


def _own_or_view(made: torch.Tensor, verify_in: dict[str, torch.Tensor] | None,
                 name: str) -> torch.Tensor:
    """A draft graph's output ``made`` for VERIFY's input ``name``: VERIFY's static input
    itself when it is that tensor, else a fresh view of it."""
    if verify_in is not None and verify_in.get(name) is made:
        return made
    return made[:]
