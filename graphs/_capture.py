"""Capture at warmup: which variants an engine runs, what each is specialised on, and the
loop that captures every key's VERIFY (and, where a drafter offers one, DRAFT) step.

The engine supplies the steps (it owns the model and the sampler); this module decides
which keys are captured and seals the cache afterwards, so nothing is captured later.
"""

from __future__ import annotations

from typing import Callable, Iterable

import attrs
import torch

from specloop.samplers import SamplingBatch, SpecMetadata

from ._cache import GraphCache, Step, Tensors
from ._key import GraphKey, SamplingPath

# (key, template, has_draft_probs) -> the VERIFY step and an example of its inputs.
VerifyBuilder = Callable[[GraphKey, SamplingBatch, bool], tuple[Step, Tensors]]
# (key, template) -> the drafter's whole-proposal step and example inputs, or None.
DraftBuilder = Callable[[GraphKey, SamplingBatch], tuple[Step, Tensors] | None]


def capture_variants(use_rejection_sampling: bool, point_mass: bool
                     ) -> list[tuple[SamplingPath, bool, bool]]:
    """(path, all_greedy, has_draft_probs) for every variant an engine can run: an
    all-greedy batch and a batch with sampled rows, each on the path the one predicate
    (``SpecMetadata.wants_advanced_draft_sampling``) gives it."""
    variants = []
    for all_greedy in (True, False):
        spec = SpecMetadata(use_rejection_sampling=use_rejection_sampling,
                            is_all_greedy_sample=all_greedy)
        path = SamplingPath.of(spec)
        variants.append((path, all_greedy, path is SamplingPath.ADVANCED and not point_mass))
    return variants


def graph_template(key: GraphKey, device: torch.device | str) -> SamplingBatch:
    """The Python flags a captured variant is specialised on (``SamplingBatch.padding``)."""
    return SamplingBatch.padding(key.batch_size, all_greedy=key.all_greedy, device=device)


def warm_up(cache: GraphCache, *, max_batch_size: int, num_draft_tokens: int | Iterable[int],
            variants: Iterable[tuple[SamplingPath, bool, bool]], device: torch.device | str,
            verify: VerifyBuilder, draft: DraftBuilder,
            also: Callable[[], Iterable[tuple[GraphKey, Step, Tensors]]] | None = None,
            tree_k: int = 0, tree_max_batch: int = 0) -> list[GraphKey]:
    """Capture every key the cache asks for, VERIFY and then DRAFT (stage "draft"), then
    the steps ``also`` lists (e.g. prefill, stage "prefill") when the cache captures any
    key, and seal the cache; -> the VERIFY keys captured. Several ``num_draft_tokens``
    (adaptive K): the keys of each. ``tree_k``: a draft tree's node count, whose keys
    (VERIFY's rows less one, as a chain's K) are captured for the variants off the
    advanced path (a batch on it drafts the chain), at the buckets that serve batches of
    up to ``tree_max_batch`` rows."""
    has_q = {(path, greedy): q for path, greedy, q in variants}
    ks = [num_draft_tokens] if isinstance(num_draft_tokens, int) else list(num_draft_tokens)
    keys = [key for k in ks for key in cache.keys_to_capture(max_batch_size, k, list(has_q))]
    if tree_k:
        strict = [variant for variant in has_q if variant[0] is SamplingPath.GREEDY]
        tree_keys = cache.keys_to_capture(max_batch_size, tree_k, strict)
        # A bucket serves the batches above the bucket below it: those that reach one of
        # up to tree_max_batch rows.
        sizes = sorted({key.batch_size for key in tree_keys})
        served = {b for below, b in zip([0] + sizes, sizes) if below < tree_max_batch}
        keys += [key for key in tree_keys if key.batch_size in served]
    statics = getattr(cache, "static_inputs", None)
    for key in keys:
        template = graph_template(key, device)
        with torch.inference_mode():
            cache.capture(key, *verify(key, template, has_q[(key.sampling_path,
                                                              key.all_greedy)]))
            drafted = draft(key, template)
            if drafted is not None:
                step, example = drafted
                if statics is not None:
                    step = into_verify_inputs(step, statics(key))
                cache.capture(attrs.evolve(key, stage="draft"), step, example)
    if keys and also is not None:
        with torch.inference_mode():
            for key, step, example in also():
                cache.capture(key, step, example)
    cache.seal()
    return keys


# The draft graph's outputs that are its VERIFY's next inputs (a chaining drafter's glue:
# models/drafters/_mtp.py and _ngram.py ``graph_step``).
VERIFY_INPUTS = ("tokens", "start_pos", "slots")


def into_verify_inputs(step: Step, verify_in: Tensors) -> Step:
    """``step`` (a draft graph's) that also writes its outputs ``VERIFY_INPUTS`` into the
    same key's VERIFY static inputs ``verify_in``, and returns those tensors in their
    place: the chained step (engine/_chain.py) hands them to VERIFY's replay as they are,
    which then copies nothing for them. The copies run inside the draft graph, where the
    replay copied them from the host before (a torch call each an iteration, ~10-25 µs
    on the H200's host; the same device work). An output of another shape or dtype than
    VERIFY's input is left as it is (copied at the replay, as before). A step with
    ``outputs_into`` (models/drafters/_protocol.DraftGraphStep) writes them there itself."""
    targets = {name: verify_in[name] for name in VERIFY_INPUTS if name in verify_in}
    if not targets:
        return step
    # A step that can write them there itself (``outputs_into``: a DraftGraphStep, duck-
    # typed) returns those very tensors: no copy kernel in the graph for them.
    into = getattr(step, "outputs_into", None)
    inner: Step = into(targets) if into is not None else step

    def written(inputs: Tensors) -> Tensors:
        out = inner(inputs)
        moved = {}
        for name, static in targets.items():
            made = out.get(name)
            if made is static:
                continue
            if made is not None and made.shape == static.shape and made.dtype == static.dtype:
                static.copy_(made)
                moved[name] = static
        return {**out, **moved} if moved else out

    return written
