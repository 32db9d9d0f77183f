"""The drafter protocol: what DRAFT asks of a drafter, and what it gets back."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Protocol, Sequence, TypeVar, runtime_checkable

import attrs
import torch

from specloop.comm import Communicator
from specloop.samplers import Sampler, SamplingBatch, SpecMetadata
from specloop.samplers._tree import DraftTree

from .._host import int64_tensor, to_device

T = TypeVar("T")
# A step over static tensors (a CUDA graph's body).
Step = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


class PrefillReplay(Protocol):
    """The replay of a drafter's prefill graphs, by padded shape (rows, tokens per row),
    which warm-up hands to ``Drafter.prefill_graphs``."""

    def __call__(self, shape: tuple[int, int], inputs: dict[str, torch.Tensor]
                 ) -> dict[str, torch.Tensor] | None:
        """Replay ``shape``'s graph on ``inputs``: its outputs (overwritten by its next
        replay), or None where ``shape`` was not captured."""
        ...

    def static_inputs(self, shape: tuple[int, int]) -> dict[str, torch.Tensor] | None:
        """``shape``'s captured graph's static inputs, which the drafter may write in place
        (queued on the stream) and hand back as the inputs themselves: the replay then
        copies nothing for them. None where not captured or the cache shows none."""
        ...


@attrs.frozen
class DraftContext:
    """One DRAFT call. Row i's committed sequence has length L = seq_lens[i]; its last
    token's K/V are not yet in the target cache; draft j (1-based) sits at L - 1 + j."""

    token_ids: Sequence[Sequence[int]]   # committed tokens per row, B rows
    seq_lens: torch.Tensor               # [B] int64 (L per row), on the model's device
    slots: torch.Tensor                  # [B] int64 KV slots
    sampling: SamplingBatch
    spec: SpecMetadata
    sampler: Sampler
    comm: Communicator
    run_sync: Callable[[Callable[[], T]], Awaitable[T]]  # runs compute off the event loop
    # Replays this iteration's captured draft graph (inputs -> outputs), or None: eager.
    # Call it under torch.inference_mode() (its static tensors are inference tensors),
    # off the event loop (run_sync); its outputs are overwritten by the next replay.
    replay: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    # ``slots`` / ``seq_lens`` as host lists (reading the device tensors back would sync);
    # () if unknown. Read them through ``slot_list`` / ``seq_len_list``.
    host_slots: Sequence[int] = ()
    # With ``replay``: the sampling rows padded to the graph's batch (the ones VERIFY uses).
    graph_sampling: SamplingBatch | None = None
    host_seq_lens: Sequence[int] = ()
    # Drafts this call (adaptive K, 0 .. the drafter's num_draft_tokens); None: all of
    # them. Only drafters whose ``variable_k`` is True are given a number.
    num_draft_tokens: int | None = None
    # A draft tree to propose instead of a chain (its nodes, the drafter's top-ranked
    # tokens whatever the rows' sampling, in its order: token_ids [B, tree.size]); only
    # drafters whose ``drafts_trees`` is True are given one.
    tree: DraftTree | None = None

    def draft_count(self, drafter: Drafter) -> int:
        """How many drafts ``drafter`` proposes in this call."""
        return drafter.num_draft_tokens if self.num_draft_tokens is None \
            else self.num_draft_tokens

    @property
    def graph_rows(self) -> int:
        """The captured graph's rows (the batch padded to its bucket): with ``replay`` or
        while a draft graph is captured; a ValueError otherwise."""
        if self.graph_sampling is None:
            raise ValueError("no draft graph: ctx.graph_sampling is None")
        return self.graph_sampling.size

    def slot_list(self) -> list[int]:
        """``slots`` on the host: the worker's copy, else read back (a device sync)."""
        return list(self.host_slots) if self.host_slots or not self.token_ids \
            else self.slots.tolist()

    def seq_len_list(self) -> list[int]:
        """``seq_lens`` on the host: the worker's copy, else read back (a device sync)."""
        return list(self.host_seq_lens) if self.host_seq_lens or not self.token_ids \
            else self.seq_lens.tolist()


@attrs.frozen
class DraftProposal:
    token_ids: torch.Tensor              # [B, K] int64, on the device or the host
    probs: torch.Tensor | None = None    # [B, K, V] q of each draft; None = point mass


@attrs.frozen
class DrafterDeps:
    """What a drafter factory may use besides the config."""

    target: Any        # specloop.models.LoadedModel
    target_cache: Any  # specloop.models.KVCache
    num_slots: int
    max_seq_len: int


@runtime_checkable
class Drafter(Protocol):
    """Everything the engine calls on or reads from a drafter.

    Subclass it to inherit the defaults of the optional members (a drafter that is model
    free and never runs in a CUDA graph then writes only ``num_draft_tokens``, ``prefill``,
    ``propose`` and ``release``), or implement every member yourself. The factory named
    in config is called as ``factory(config, deps: DrafterDeps)``.

    Defaults: ``point_mass`` False (proposals carry q), ``variable_k`` False,
    ``drafts_trees`` False, ``needs_empty_calls`` False,
    ``feature_layers`` () (no target features), ``on_verified`` and ``warm_up_eager`` do nothing,
    ``can_graph`` False (so ``graph_step`` and ``graph_inputs``, which raise, are never
    called).
    """

    num_draft_tokens: int

    def prefill(self, slot: int, token_ids: Sequence[int], hidden: torch.Tensor | None
                ) -> None:
        """A new request's prompt (all but the last token) and the target's final hidden
        states for it, [P, H]; runs off the event loop."""
        ...

    async def propose(self, ctx: DraftContext) -> DraftProposal:
        """K drafts per row; argmax, or sampled from q when the predicate says advanced."""
        ...

    def prefill_many(self, slots: Sequence[int], token_ids: Sequence[Sequence[int]],
                     hidden: Sequence[torch.Tensor | None]) -> None:
        """``prefill`` of requests admitted together (a drafter may share its forwards
        between them). Default: ``prefill`` of each."""
        for slot, ids, h in zip(slots, token_ids, hidden):
            self.prefill(slot, ids, h)

    def release(self, slot: int) -> None:
        """The request in ``slot`` finished; forget its state."""
        ...

    def prefill_graphs(self, shapes: Sequence[tuple[int, int]], replay: PrefillReplay
                       ) -> list[tuple[tuple[int, int], Step, dict[str, torch.Tensor]]]:
        """Called once at warm-up on a GPU whose target prefills at padded shapes
        (models/_prefill.py): the drafter's own prefill forward at each of ``shapes``
        (rows, tokens per row) as (shape, step, example inputs) for warm-up to capture as
        CUDA graphs, which ``replay(shape, inputs)`` then runs (None: not captured).
        Default [] (the drafter prefills eagerly)."""
        return []

    def warm_up_eager(self, max_batch_size: int, sampler: Sampler) -> None:
        """Called once at warm-up on a GPU, after the graphs are captured: run the eager
        paths serving may still take (shapes no graph has) for up to ``max_batch_size``
        rows, drafting through ``sampler``, so that their Triton kernels compile now, not
        in the middle of serving. Default: nothing."""
        return None

    @property
    def point_mass(self) -> bool:
        """True when every proposal's ``probs`` is None (drafts are point masses): VERIFY
        graphs are then captured without a q input. Default False."""
        return False

    @property
    def variable_k(self) -> bool:
        """True when ``propose`` honours ``ctx.num_draft_tokens`` (any K from 1 to
        ``num_draft_tokens``) and ``graph_step`` takes ``num_draft_tokens=``; at K = 0 the
        engine then does not call ``propose`` (``on_verified`` still runs, with one row per
        request: keep what the next ``propose`` needs). Default False: under adaptive K
        the engine asks for all ``num_draft_tokens`` and keeps the first K."""
        return False

    @property
    def drafts_trees(self) -> bool:
        """True when ``propose`` drafts ``ctx.tree`` where it is given (a draft tree,
        samplers/_tree.py: token_ids [B, tree.size], the nodes in the tree's order, each
        row's children its top-ranked tokens; the engine gives one to a batch off the
        advanced path, with ``speculative.tree`` set, and verifies it strictly; under
        LM-head TP the drafter enters the same collectives on every rank, an idle one
        too). Default False: the engine refuses ``speculative.tree``."""
        return False

    @property
    def needs_empty_calls(self) -> bool:
        """True when ``propose`` runs collectives (e.g. LM-head TP), so it is called on
        ranks with no rows too (an empty ``ctx``). Default False."""
        return False

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs the drafter reads (EAGLE-3): the engine makes the
        target capture them, and ``prefill``/``on_verified`` get them concatenated as
        ``hidden``. Read once, when the engine is built. Default () (final hidden only)."""
        return ()

    def on_verified(self, slots: Sequence[int], start_pos: Sequence[int],
                    hidden: torch.Tensor, num_accepted: Sequence[int]) -> None:
        """After each VERIFY (off the event loop): the target's hidden states [B, K+1, H]
        at positions start_pos.., of which rows 0..num_accepted are now committed.
        Default: nothing."""
        return None

    def can_graph(self, advanced: bool) -> bool:
        """Whether the K-step proposal on this sampling path can be captured in a CUDA
        graph (``graph_step``/``graph_inputs``); read once per variant at warmup, and a
        captured draft graph is replayed through ``ctx.replay``. Default False."""
        return False

    def graph_step(self, sampler: Sampler, template: SamplingBatch, *, advanced: bool,
                   num_draft_tokens: int | None = None
                   ) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        """The whole K-step proposal as a function over static tensors (inputs as
        ``graph_inputs`` builds them -> ``token_ids`` [Bp, K] and, when advanced,
        ``probs`` [Bp, K, V]); called only where ``can_graph`` is True. The engine
        passes the step's K as ``num_draft_tokens``: any K from 1 to
        ``self.num_draft_tokens`` when ``variable_k`` is True (adaptive K captures one
        step per K), else always ``self.num_draft_tokens`` (``FixedKGraphDrafter``)."""
        raise RuntimeError(f"{type(self).__name__} does not run in CUDA graphs "
                           "(its can_graph is False)")

    def graph_inputs(self, ctx: DraftContext) -> dict[str, torch.Tensor]:
        """The static inputs of ``graph_step`` (and ``tree_graph_step``) for ``ctx``'s
        rows padded to ``ctx.graph_rows``; called only where ``can_graph`` is True."""
        raise RuntimeError(f"{type(self).__name__} does not run in CUDA graphs "
                           "(its can_graph is False)")

    def tree_graph_step(self, sampler: Sampler, template: SamplingBatch, tree: DraftTree
                        ) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        """A draft tree's proposal as a function over static tensors (inputs as
        ``graph_inputs`` builds them -> ``token_ids`` [Bp, tree.size], the nodes in the
        tree's order); called only where ``drafts_trees`` and ``can_graph(False)`` are
        True (the engine captures it with the tree's VERIFY graphs, both variants off the
        advanced path)."""
        raise RuntimeError(f"{type(self).__name__} does not draft trees in CUDA graphs "
                           "(its drafts_trees is False)")

    @property
    def can_chain(self) -> bool:
        """True when ``chained_inputs`` builds the next iteration's draft-graph inputs on
        the device from VERIFY's outputs, so the engine may queue DRAFT and VERIFY of
        iteration n+1 before reading VERIFY n back (engine/_chain.py). Default False."""
        return False

    @property
    def chains_through_k0(self) -> bool:
        """True when the chained draft reads VERIFY's tokens only (no feature rows), so
        that under adaptive K the engine chains across K = 0 too: ``graph_step`` is then
        also asked for K = 0 (no drafts: the step only places VERIFY n's bonus token and
        its position), and ``chained_inputs`` may get a K = 0 VERIFY's outputs (one token,
        none accepted), or a smaller K's, widened to the graph's width: its ``token_ids``
        and ``num_accepted`` may then be the draft graph's own static ``verified`` and
        ``accepted`` (engine/_chain.py, ``_into_statics``), whose columns past VERIFY's
        hold stale tokens, so the draft must read no column past a row's accepted count
        (its bonus token). Default False."""
        return False

    @property
    def num_draft_classes(self) -> int:
        """How many classes ``draft_classes`` tells rows apart by (0: it is not called).
        Default 0."""
        return 0

    def draft_classes(self, slots: Sequence[int], token_ids: Sequence[Sequence[int]]
                      ) -> list[int]:
        """Each row's class (0 .. ``num_draft_classes`` - 1) before it drafts from its
        committed tokens ``token_ids`` (the requests' own lists): a sign, known on the
        host, of how much of its draft will be accepted (n-gram: the length of the match
        it would draft from). Adaptive K keeps acceptance counts per class and weighs each
        row by its class's (engine/_adaptive.py); the classes steer only how many tokens
        are drafted, never which tokens are committed. Called only where
        ``num_draft_classes`` > 0, on the host, once per iteration for batches of up to
        ``CLASSED_ROWS`` rows; keep it cheap (a few us a row)."""
        raise RuntimeError(f"{type(self).__name__} has no draft classes")

    def chained_inputs(self, verified: dict[str, torch.Tensor], start: Sequence[int],
                       slots: Sequence[int], sampling: SamplingBatch,
                       into: dict[str, torch.Tensor] | None = None,
                       tokens: Sequence[Sequence[int]] | None = None,
                       continued: bool = False
                       ) -> dict[str, torch.Tensor]:
        """``graph_inputs`` of the iteration after a VERIFY whose rows sat at ``start``
        (L - 1) in ``slots``, built on the device from its outputs (``token_ids``,
        ``num_accepted``, ``hidden``, ``packed``) for ``sampling.size`` rows, plus
        ``slots`` [Bp] (VERIFY n+1's, unless the draft graph outputs them). VERIFY n+1's
        ``tokens`` [Bp, K+1] and ``start_pos`` [Bp] (0 on padding rows) are outputs of the
        draft graph of those names (``graph_step``; the capture writes each such output
        into VERIFY's static input of that name, in the graph:
        graphs/_capture.into_verify_inputs); only called where ``can_chain`` is True.
        ``into``: the draft graph's static inputs; an input of the same name and shape
        may be written into in place and returned as itself, so that the replay copies
        nothing for it; a drafter may ignore it.
        ``tokens``: each row's committed tokens (the requests' own lists, ``start + 1``
        long), for a drafter that keeps them on the device. ``continued``: VERIFY n is the
        chained step the last call queued, taken for its whole batch, nothing run between:
        what that step's draft wrote on the device is current for its rows (a drafter
        relying on it should still check that ``slots`` and the padded rows are the last
        call's)."""
        raise RuntimeError(f"{type(self).__name__} does not chain (its can_chain is False)")

    def chained_consumed(self, slots: Sequence[int]) -> None:
        """The chained draft of these slots ran (as ``propose`` would have). Default:
        nothing."""
        return None

    @property
    def chains_joiners(self) -> bool:
        """True when a chained step may take in requests prefilled since the last DRAFT
        (engine/_chain.py): each such row reaches ``chained_inputs`` as if a VERIFY had
        left it at ``start`` = P - 2 of its P-token prompt with nothing accepted and the
        prompt's last token as its bonus (``packed``: that token, -1 after it, count 0),
        its ``hidden`` row 0 ``joining_rows``' row, its ``tokens`` the prompt. Default
        False: such requests join one iteration later, in an unchained step."""
        return False

    def joining_rows(self, slots: Sequence[int]) -> torch.Tensor | None:
        """[len(slots), F]: the feature row each of these newly prefilled slots' first
        catch-up starts from (its prompt's target row at position P - 2, which its
        ``prefill`` left pending), for ``chains_joiners``; None where the chained draft
        reads tokens only. Default None."""
        return None


@attrs.frozen
class DraftGraphStep:
    """A draft graph's step whose outputs VERIFY reads next (``tokens``, ``start_pos``)
    may be written straight into tensors the caller names: ``fn(inputs, into)``, ``into``
    empty for its own. Called as the step itself; ``outputs_into(into)`` is the step
    writing into those (its VERIFY's static inputs, so neither the draft graph nor the
    replay copies them: graphs/_capture.into_verify_inputs). An output returned as the
    very tensor named was written there."""

    fn: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], dict[str, torch.Tensor]]

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.fn(inputs, {})

    def outputs_into(self, into: dict[str, torch.Tensor]) -> Step:
        return lambda inputs: self.fn(inputs, into)


def static_or_view(tensor: torch.Tensor, into: dict[str, torch.Tensor] | None, name: str
                   ) -> torch.Tensor:
    """For ``chained_inputs``: ``tensor`` itself when it is the draft graph's static input
    ``name`` (the chain wrote it there in place: the replay copies nothing), else a fresh
    view of it (a replay copies an input it has not been given before)."""
    return tensor if into is not None and into.get(name) is tensor else tensor[:]


class FixedKGraphDrafter(Drafter):
    """The base of a drafter whose K is its own (``variable_k`` False) and whose whole
    K-step proposal is one function, ``_draft_steps(inputs, sampler, batch, advanced=,
    kv_len=)``, over the tensors ``graph_inputs`` builds, attending up to ``cache``'s
    length (draft model, early exit): it runs in CUDA graphs on every sampling path, its
    ``graph_step`` that function on the graph's static tensors (its sampling columns,
    ``kv_len`` the cache's ``max_seq_len``). A step asked for another K than its own is a
    caller's bug, not something to draft silently."""

    cache: Any      # a KVCache: its max_seq_len fixes a graph's attended length

    def _draft_steps(self, inputs: dict[str, torch.Tensor], sampler: Sampler,
                     batch: SamplingBatch, *, advanced: bool, kv_len: int | None
                     ) -> dict[str, torch.Tensor]:
        """The one drafting loop, eager (``kv_len`` None, the real rows) and graph alike
        (``kv_len`` fixed, padded rows): ``token_ids`` [B, K] and, when ``advanced``,
        ``probs`` [B, K, V]."""
        raise NotImplementedError(f"{type(self).__name__} subclasses FixedKGraphDrafter "
                                  "without its _draft_steps")

    def can_graph(self, advanced: bool) -> bool:
        return True

    def graph_step(self, sampler: Sampler, template: SamplingBatch, *, advanced: bool,
                   num_draft_tokens: int | None = None
                   ) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        if num_draft_tokens not in (None, self.num_draft_tokens):
            raise ValueError(f"{type(self).__name__} drafts a fixed K = "
                             f"{self.num_draft_tokens} (its variable_k is False); "
                             f"graph_step got num_draft_tokens = {num_draft_tokens}")
        kv_len = self.cache.max_seq_len

        def step(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return self._draft_steps(inputs, sampler, template.with_columns(inputs),
                                     advanced=advanced, kv_len=kv_len)

        return step


class VerifyObserver(Protocol):
    """The ``on_verified`` member of a drafter, alone (kept for existing imports)."""

    def on_verified(self, slots: Sequence[int], start_pos: Sequence[int],
                    hidden: torch.Tensor, num_accepted: Sequence[int]) -> None: ...


def sample_draft_step(ctx: DraftContext, logits: torch.Tensor, step: int
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft ``step`` (0-based) of every row from logits [B, V]: (tokens [B], q [B, V])."""
    positions = ctx.seq_lens + step
    sample = ctx.sampler.draft(logits, ctx.sampling, positions,
                               advanced=ctx.spec.wants_advanced_draft_sampling)
    return sample.token_ids, sample.probs


def stack_proposal(tokens: list[torch.Tensor], probs: list[torch.Tensor | None]
                   ) -> DraftProposal:
    q = torch.stack(probs, dim=1) if probs and probs[0] is not None else None
    return DraftProposal(torch.stack(tokens, dim=1), q)


def graph_outputs(tokens: list[torch.Tensor], probs: list[torch.Tensor | None],
                  advanced: bool) -> dict[str, torch.Tensor]:
    """A static draft step's outputs: token_ids [Bp, K] and, when sampled, probs [Bp, K, V]."""
    out = {"token_ids": torch.stack(tokens, dim=1)}
    if advanced:
        out["probs"] = torch.stack(probs, dim=1)
    return out


def graph_int_inputs(ctx: DraftContext, host: dict[str, list[Any]]
                     ) -> dict[str, torch.Tensor]:
    """A draft graph's inputs: the host-side int64 columns (already padded to the graph's
    rows) on the model's device, plus the padded sampling columns."""
    if ctx.graph_sampling is None:
        raise ValueError("graph inputs need ctx.graph_sampling (the graph's padded rows)")
    # One host-to-device copy for all columns (a copy each cost a launch each); a column
    # is a list of ints [B] or of equal-length rows [B, W].
    values: list[int] = []
    shapes: list[tuple[int, ...]] = []
    for column in host.values():
        if column and isinstance(column[0], (list, tuple)):
            width = len(column[0])
            shapes.append((len(column), width))
            for row in column:
                if len(row) != width:
                    raise ValueError(f"graph input rows of lengths {width} and {len(row)}")
                values += row
        else:
            shapes.append((len(column),))
            values += column
    flat = int64_tensor(values)
    packed = to_device(flat, ctx.slots.device)
    inputs, at = {}, 0
    for name, shape in zip(host, shapes):
        size = shape[0] * (shape[1] if len(shape) > 1 else 1)
        inputs[name] = packed[at:at + size].view(shape)
        at += size
    inputs.update(ctx.graph_sampling.columns())
    return inputs


def replay_proposal(ctx: DraftContext, inputs: dict[str, torch.Tensor], advanced: bool
                    ) -> DraftProposal:
    """Replay the captured draft graph; copy the real rows out of its static outputs
    (the next replay overwrites them)."""
    if ctx.replay is None:
        raise ValueError("no captured draft graph to replay (ctx.replay is None)")
    rows = len(ctx.token_ids)
    with torch.inference_mode():
        out = ctx.replay(inputs)
        q = out["probs"][:rows].clone() if advanced else None
        return DraftProposal(out["token_ids"][:rows].clone(), q)
