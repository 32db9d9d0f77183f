"""Where the chained eagle step's catch-up starts come from (models/drafters/_mtp.py,
``chained_inputs``): the host's, copied into the draft graphs' ``_lengths`` buffer, unless
the last chained step was taken for this very batch with no DRAFT of the drafter's own
since; then that step's ``start_pos`` output, already there. The engine-level tests
(tests/graphs/test_chain*.py) check the tokens; this one checks each case of the rule,
including those the engine rarely reaches (an eager DRAFT after a taken chained step)."""

from types import SimpleNamespace

import anyio
import pytest
import torch

from specloop.models import load_model
from specloop.models.drafters._mtp import MtpEagleDrafter
from specloop.models.drafters._protocol import DraftContext, DrafterDeps
from specloop.models.testing import write_tiny_checkpoint
from specloop.samplers import DefaultSampler, SamplingBatch, SpecMetadata

ROWS = 2


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    loaded = load_model(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m"))
    spec = SimpleNamespace(num_draft_tokens=2, adaptive=False, draft_weights=None,
                           draft_dtype="auto", mtp_weights=None, method="mtp_eagle")
    config = SimpleNamespace(speculative=spec, parallel=SimpleNamespace(lm_head_tp_in_adp=False))
    d = MtpEagleDrafter(config, DrafterDeps(loaded, loaded.model.make_cache(4, 64), 4, 64))
    template = SamplingBatch.from_params([], [], pad_to=ROWS)
    d.graph_step(DefaultSampler(), template, advanced=False)     # makes the buffer
    return d


def _chain(d, start, slots=(1,)):
    verified = {"packed": torch.zeros(ROWS, 4, dtype=torch.int64),
                "hidden": torch.zeros(ROWS, 3, d.head.feature_size)}
    sampling = SamplingBatch.from_params([], [], pad_to=ROWS)
    d.chained_inputs(verified, list(start), list(slots), sampling)
    return d._lengths_of(ROWS)[1].tolist()


def _ran(d, start_pos):
    """What the chained step's draft graph leaves: VERIFY n+1's positions."""
    d._lengths_of(ROWS)[1].copy_(torch.tensor(start_pos))


def test_the_taken_steps_positions_are_the_next_start(drafter):
    d = drafter
    assert _chain(d, [5]) == [5, 0]                 # a first chained step: the host's
    _ran(d, [9, 0])
    d.chained_consumed([1])                         # taken for its whole batch
    assert _chain(d, [-1]) == [9, 0]                # not copied: the host's is not read
    _ran(d, [12, 0])
    assert _chain(d, [11]) == [11, 0]               # dropped (not consumed): the host's
    _ran(d, [14, 0])
    d.chained_consumed([1])
    assert _chain(d, [13, 7], slots=(1, 3)) == [13, 7]  # another batch: the host's
    _ran(d, [15, 9])
    d.chained_consumed([3])                         # taken for some of its rows only
    assert _chain(d, [14, 8], slots=(1, 3)) == [14, 8]


def test_a_drafters_own_draft_in_between_takes_the_hosts(drafter):
    """After a taken chained step, iterations without one (adaptive K = 0, an eager
    catch-up of rows piled up) move the lengths past its positions: the next chained
    step after a DRAFT of the drafter's own reads the host's starts."""
    d = drafter
    _chain(d, [20])
    _ran(d, [23, 0])
    d.chained_consumed([1])
    empty = torch.zeros(0, dtype=torch.int64)
    ctx = DraftContext(token_ids=[], seq_lens=empty, slots=empty,
                       sampling=SamplingBatch.from_params([], []), spec=SpecMetadata(use_rejection_sampling=False),
                       sampler=DefaultSampler(), comm=None, run_sync=None)
    anyio.run(d.propose, ctx)
    assert _chain(d, [30]) == [30, 0]
