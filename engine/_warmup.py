"""Warm-up: the engine's VERIFY and DRAFT steps for each key ``graphs.warm_up`` captures.

``graphs`` decides which keys are captured and seals the cache; this module only builds
the steps, since they need the model runner, the sampler and the drafter.
"""

from __future__ import annotations

import torch

from specloop.graphs import GraphKey, SamplingPath
from specloop.graphs._capture import capture_variants, warm_up
from specloop.samplers import SamplingBatch

from ._verify import make_verify_step, verify_inputs


def warm_up_graphs(*, config, runner, sampler, drafter, comm, graph_cache) -> None:
    """Capture every VERIFY variant this engine can run (and its DRAFT), before serving."""
    k = config.speculative.k
    device = runner.device
    point_mass = drafter is None or drafter.point_mass

    def verify(key: GraphKey, template: SamplingBatch, has_q: bool):
        q = None
        if k and has_q:
            q = torch.zeros(0, k, runner.args.vocab_size, device=device)
        example = verify_inputs([], None, q, template, k=k,
                                scratch_slot=runner.cache.scratch_slot, device=device)
        step = make_verify_step(runner, sampler, template,
                                advanced=key.sampling_path is SamplingPath.ADVANCED,
                                kv_len=runner.cache.max_seq_len)
        return step, example

    def draft(key: GraphKey, template: SamplingBatch):
        """The drafter's whole K-step proposal, when it offers a static step for this
        variant (not on the LM-head-TP path, whose collectives stay outside graphs)."""
        from specloop.models.drafters import DraftContext  # noqa: PLC0415

        advanced = key.sampling_path is SamplingPath.ADVANCED
        if not k or drafter is None or not drafter.can_graph(advanced):
            return None
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        ctx = DraftContext(token_ids=[], seq_lens=empty, slots=empty, sampling=template,
                           spec=None, sampler=sampler, comm=comm, run_sync=None,
                           graph_sampling=template)
        return (drafter.graph_step(sampler, template, advanced=advanced),
                drafter.graph_inputs(ctx))

    warm_up(graph_cache, max_batch_size=config.scheduler.max_batch_size, num_draft_tokens=k,
            variants=capture_variants(config.speculative.use_rejection_sampling, point_mass),
            device=device, verify=verify, draft=draft)
