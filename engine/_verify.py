"""VERIFY as a step over static-shape tensors, so a graph cache can capture and replay it.

inputs: tokens [Bp, K+1] ([last, d1..dK]), start_pos [Bp] (L-1), slots [Bp], the sampling
columns [Bp] and, on the advanced path with a non-point-mass drafter, draft_probs
[Bp, K, V]. outputs: token_ids [Bp, K+1], num_accepted [Bp], hidden [Bp, K+1, H] (what
the drafter reads: [Bp, K+1, F*H] when it asked for feature layers), and
``packed`` [Bp, K+2] (token ids, then the count): what the host reads, in one copy.
Rows past the real batch are padding: scratch slot, position 0, greedy sentinel params.

At K = 0 a captured step also writes the next step's inputs for the same rows into its own
``tokens`` and ``start_pos`` (``feeds_itself``): its token, one position further (padding
rows stay at position 0). A step queued ahead for an unchanged batch (engine/_ahead.py)
then replays the graph with no inputs: no copy runs between the two graphs.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from specloop.graphs import Step, Tensors
from specloop.graphs._cache import FeedsItself
from specloop.models import DecoderModel, TreeMask
from specloop.models._host import to_device
from specloop.samplers import SamplingBatch
from specloop.samplers._sampler import DefaultSampler, packed_result
from specloop.samplers._tree import DraftTree, TreeTables, accept_tree
from specloop.samplers._triton_greedy import tree_greedy_verify, usable

from ._request import Request

if TYPE_CHECKING:
    from specloop.samplers import Sampler

    from ._runner import ModelRunner


def verify_inputs(batch: Sequence[Request], drafts: torch.Tensor | None,
                  draft_probs: torch.Tensor | None, sampling: SamplingBatch, *, k: int,
                  scratch_slot: int, device: torch.device | str) -> Tensors:
    """Tensors for ``len(sampling)`` rows; the first ``len(batch)`` are the requests."""
    rows, real = sampling.size, len(batch)
    # One host row per request, [last, 0 * K, start, slot]: one host-to-device copy;
    # filled column by column (a list each: ~4x faster than a tuple a row at batch 256).
    columns: np.ndarray[Any, np.dtype[np.int64]] = np.zeros((rows, k + 3), dtype=np.int64)
    if real:
        columns[:real, 0] = [r.token_ids[-1] for r in batch]
        columns[:real, k + 1] = [len(r.token_ids) - 1 for r in batch]
        columns[:real, k + 2] = [r.batch_slot for r in batch]
    columns[real:, k + 2] = scratch_slot
    host = torch.from_numpy(columns)
    on_host = False
    if k and real:
        assert drafts is not None, "K > 0 with rows: DRAFT proposed K tokens per row"
        on_host = drafts.device.type == "cpu"
    if on_host:     # drafts proposed on the host (n-gram) travel in the same copy
        host[:real, 1:k + 1] = drafts
    packed = to_device(host, device)
    inputs = {"tokens": packed[:, :k + 1], "start_pos": packed[:, k + 1],
              "slots": packed[:, k + 2]}
    if k and real and not on_host:
        inputs["tokens"][:real, 1:] = drafts
    inputs.update(sampling.columns())
    if draft_probs is not None:
        inputs["draft_probs"] = pad_draft_probs(draft_probs, rows)
    return inputs


def ahead_inputs(batch: Sequence[Request], last_tokens: torch.Tensor,
                 source_rows: Sequence[int], sampling: SamplingBatch, *, scratch_slot: int,
                 device: torch.device | str, joining: Sequence[Request] = ()) -> Tensors:
    """No speculation: the inputs of the step after the one just queued, for ``batch``,
    before the host knows its tokens: row i forwards ``last_tokens[source_rows[i], 0]``
    (that step's output, still on the device) at position ``seq_len`` (one past that
    step's). ``joining``: requests joining the batch in that step, after it; each
    forwards its prompt's last token at its own last position, as its first VERIFY
    would (engine/_ahead.py, ``RunAhead.schedule``)."""
    rows, real = sampling.size, len(batch)
    # Column by column (a list each: ~4x faster than a tuple a row at batch 256).
    # token, position, slot, source row
    host: np.ndarray[Any, np.dtype[np.int64]] = np.zeros((rows, 4), dtype=np.int64)
    if real:
        host[:real, 1] = [len(r.token_ids) for r in batch]
        host[:real, 2] = [r.batch_slot for r in batch]
        host[:real, 3] = source_rows
    end = real + len(joining)
    if joining:
        host[real:end, 0] = [r.token_ids[-1] for r in joining]
        host[real:end, 1] = [len(r.token_ids) - 1 for r in joining]
        host[real:end, 2] = [r.batch_slot for r in joining]
    host[end:, 2] = scratch_slot
    packed = to_device(torch.from_numpy(host), device)
    inputs = {"tokens": packed[:, :1], "start_pos": packed[:, 1], "slots": packed[:, 2]}
    inputs["tokens"][:real] = last_tokens.index_select(0, packed[:real, 3])[:, :1]
    inputs.update(sampling.columns())
    return inputs


def pad_draft_probs(q: torch.Tensor, rows: int) -> torch.Tensor:
    """[B, K, V] -> [rows, K, V]; padding rows are one-hot at token 0 (their drafts)."""
    if q.shape[0] == rows:
        return q
    pad = q.new_zeros(rows - q.shape[0], *q.shape[1:])
    pad[..., 0] = 1.0
    return torch.cat([q, pad])


def _logits(runner: ModelRunner, hidden: torch.Tensor, keep_dtype: bool) -> torch.Tensor:
    """VERIFY's logits: f32, or where ``keep_dtype`` and the model is this package's
    DecoderModel in its own dtype (a model handed in by an embedder keeps the documented
    ``logits(hidden) -> f32``)."""
    model = runner.model
    if keep_dtype and isinstance(model, DecoderModel):
        return model.logits(hidden, keep_dtype=True)
    return model.logits(hidden)


def make_verify_step(runner: ModelRunner, sampler: Sampler, template: SamplingBatch, *,
                     advanced: bool, kv_len: int | None, feeds_itself: bool = False) -> Step:
    """The step function; ``template`` supplies SamplingBatch's Python flags.
    ``feeds_itself`` (K = 0, for capture): a ``FeedsItself`` step that also writes its
    next inputs (see the module doc)."""
    scratch = runner.cache.scratch_slot
    # The default sampler's strict verification of an all-greedy batch takes the argmax of
    # the logits as they are (bf16 compared as f32 in its kernels: the same tokens), so
    # they stay in the model's dtype (no f32 copy of [B, K+1, V]); anything else reads f32.
    keep_dtype = (not advanced and template.all_greedy
                  and type(sampler).verify is DefaultSampler.verify)

    def step(inputs: Tensors) -> Tensors:
        tokens, start = inputs["tokens"], inputs["start_pos"]
        hidden, features = runner.forward(tokens, start, inputs["slots"], kv_len=kv_len)
        logits = _logits(runner, hidden, keep_dtype)
        batch = template.with_columns(inputs)
        result = sampler.verify(tokens[:, 1:], logits, inputs.get("draft_probs"), batch,
                                start + 1, advanced=advanced)
        # A view when the sampler wrote the two into one tensor (all-greedy on CUDA).
        packed = packed_result(result)
        if feeds_itself:    # last: everything above read this step's inputs
            assert tokens.shape[1] == 1, "only a K = 0 step feeds itself"
            tokens.copy_(result.token_ids)
            start.add_(inputs["slots"].lt(scratch))     # padding rows stay at 0
        return {"token_ids": result.token_ids, "num_accepted": result.num_accepted,
                "hidden": features, "packed": packed}

    return FeedsItself(step, ("tokens", "start_pos")) if feeds_itself else step


@functools.lru_cache(maxsize=8)
def tree_layout(tree: DraftTree, device: torch.device) -> tuple[TreeTables, TreeMask]:
    """A tree's index tables and attention mask on ``device`` (built once a tree)."""
    tables = TreeTables.of(tree, device)
    return tables, TreeMask(tables.depths, tree.visible(device))


def make_tree_verify_step(runner: ModelRunner, sampler: Sampler, template: SamplingBatch,
                          tree: DraftTree, *, kv_len: int | None) -> Step:
    """Strict VERIFY of a draft tree (samplers/_tree.py) for the rows of a batch that is
    not on the advanced path (greedy rows, and sampled rows verified strictly), on the
    reference path. Its inputs are a chain's of K = ``tree.size`` (``tokens`` [Bp, 1 + N]:
    the last committed token, then the nodes in the tree's order; ``start_pos``,
    ``slots``, the sampling columns); its outputs a chain's of K = ``tree.depth``: the
    accepted path's tokens and count, its rows' hidden states (what the drafter reads:
    [Bp, D + 1, F]) and ``packed``. Every node's K/V is written at start_pos + its row;
    the accepted path's then move to start_pos + depth (``KVCache.keep_path``), where a
    chain's would be. A row's target token is the sampler's ``strict_targets`` at the
    position it predicts (start_pos + 1 + its depth). On CUDA an all-greedy batch's
    argmax, walk and move (with the path's feature rows) are three kernels
    (``samplers._triton_greedy.tree_greedy_verify``, ``models._kernels.keep_path``), not
    ~35 small torch ops (~2.5 µs of device time each on the H200)."""
    tables, mask = tree_layout(tree, torch.device(runner.device))

    def step(inputs: Tensors) -> Tensors:
        tokens, start, slots = inputs["tokens"], inputs["start_pos"], inputs["slots"]
        hidden, features = runner.forward(tokens, start, slots, kv_len=kv_len, tree=mask)
        logits = _logits(runner, hidden, True)
        if template.all_greedy and usable(tokens[:, 1:], logits):
            # (the kernels compare the model's bf16 as f32: no f32 copy of the logits)
            packed, rows = tree_greedy_verify(tokens, logits, tables.parents,
                                              tables.ancestors, tables.depths)
        else:
            logits = logits.float()
            positions = (start + 1).unsqueeze(1) + tables.depths
            target = sampler.strict_targets(logits, template.with_columns(inputs), positions)
            result = accept_tree(tables, tokens, target)
            packed = torch.cat([result.token_ids, result.num_accepted[:, None]], dim=1)
            rows = result.path
        # The path's K/V moved and its feature rows gathered (one kernel on CUDA).
        kept = runner.cache.keep_path(slots, start, rows, features)
        assert kept is not None
        return {"token_ids": packed[:, :-1], "num_accepted": packed[:, -1],
                "hidden": kept, "packed": packed}

    return step
