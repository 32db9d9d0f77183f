"""Graph key selection on CPU: buckets, eager fallback, sampling paths, ADP agreement."""

import pytest

from specloop.comm import LocalGroup
from specloop.engine import AsyncEngine, IterationRecord
from specloop.engine._request import Request
from specloop.graphs import CudaGraphCache, EagerGraphCache, GraphKey, SamplingPath, bucket_for
from specloop.samplers import SamplingParams, SpecMetadata

from ..engine.conftest import make_config

G, A = SamplingPath.GREEDY, SamplingPath.ADVANCED


def test_bucket_for():
    assert bucket_for(1, (1, 2, 4, 8)) == 1
    assert bucket_for(3, (8, 1, 4, 2)) == 4
    assert bucket_for(9, (1, 2, 4, 8)) is None


def cache_with(keys, buckets=(1, 2, 4, 8)):
    """A CUDA graph cache that believes ``keys`` were captured (no GPU needed)."""
    cache = CudaGraphCache(buckets=buckets)
    for key in keys:
        cache._graphs[key] = object()
    return cache


def test_pick_pads_to_the_nearest_captured_bucket():
    cache = cache_with([GraphKey(4, 3, G, True), GraphKey(8, 3, G, True)])
    assert cache.pick(3, 3, G, True) == (GraphKey(4, 3, G, True), True)
    assert cache.pick(5, 3, G, True) == (GraphKey(8, 3, G, True), True)


@pytest.mark.parametrize("args", [
    (9, 3, G, True),      # oversize batch
    (2, 3, G, True),      # bucket 2 was never captured
    (4, 2, G, True),      # other draft length
    (4, 3, A, False),     # the advanced variant was not captured
    (4, 3, G, False),     # nor the mixed greedy-path variant
])
def test_pick_falls_back_to_eager(args):
    cache = cache_with([GraphKey(4, 3, G, True)])
    key, captured = cache.pick(*args)
    assert not captured and key == GraphKey(*args)


def test_both_sampling_paths_have_their_own_graphs():
    cache = cache_with([GraphKey(4, 3, G, True), GraphKey(4, 3, A, False)])
    assert cache.pick(4, 3, G, True) == (GraphKey(4, 3, G, True), True)
    assert cache.pick(4, 3, A, False) == (GraphKey(4, 3, A, False), True)
    assert cache.pick(4, 3, A, False, agreed=False) == (GraphKey(4, 3, A, False), False)


def test_keys_to_capture_cover_buckets_up_to_max_batch():
    cache = CudaGraphCache(buckets=(1, 2, 4, 8, 16))
    keys = cache.keys_to_capture(6, 2, [(G, True), (A, False)])
    assert sorted({k.batch_size for k in keys}) == [1, 2, 4, 6]
    assert len(keys) == 8 and all(k.stage == "verify" for k in keys)


def test_eager_cache_never_captures():
    assert EagerGraphCache().pick(3, 2, A, False) == (GraphKey(3, 2, A, False), False)


class RecordingGraphCache(EagerGraphCache):
    picks: list = []

    def pick(self, batch_size, num_draft_tokens, sampling_path, all_greedy, *, agreed=True):
        RecordingGraphCache.picks.append((batch_size, sampling_path, all_greedy, agreed))
        return super().pick(batch_size, num_draft_tokens, sampling_path, all_greedy)


@pytest.mark.parametrize("gate", [False, True])
async def test_adp_ranks_agree_or_all_go_eager(tiny_dir, tiny_loaded, gate):
    config = make_config(tiny_dir, method="ngram", rejection=True,
                         components={"graph_cache":
                                     "tests.graphs.test_keys:RecordingGraphCache"},
                         parallel={"world_size": 2, "attention_dp": True,
                                   "lm_head_tp_in_adp": gate})
    RecordingGraphCache.picks = []
    flags = [True, False]

    async def rank_main(comm):
        engine = AsyncEngine(config, communicator=comm, model=tiny_loaded)
        engine._build()
        worker = engine.worker
        params = SamplingParams(temperature=0.0 if flags[comm.rank] else 1.0)
        rec = IterationRecord(0, SpecMetadata(use_rejection_sampling=True))
        rec.batch = [Request("x", (1, 2), params, 0, [1, 2], slot=0)] * (comm.rank + 1)
        await worker.exchange(worker._facts(rec))   # SYNC's facts ride it
        await worker.sync(rec)
        await worker.pick_graph_key(rec)
        return rec.graph_key

    keys = await LocalGroup(2).run(rank_main)
    picks = RecordingGraphCache.picks
    assert [p[0] for p in picks] == [2, 2]        # the group's padded batch on both ranks
    if gate:
        assert keys[0] == keys[1] and keys[0].sampling_path is A
        assert all(p[3] for p in picks)
    else:
        assert keys[0].sampling_path is G and keys[1].sampling_path is A
        assert not any(p[3] for p in picks)       # they differ, so every rank runs eagerly


@pytest.mark.parametrize("rejection", [False, True])
@pytest.mark.parametrize("point_mass", [False, True])
def test_capture_variants_follow_the_one_predicate(rejection, point_mass):
    from specloop.graphs._capture import capture_variants

    variants = capture_variants(rejection, point_mass)
    assert [greedy for _, greedy, _ in variants] == [True, False]
    for path, greedy, has_q in variants:
        spec = SpecMetadata(use_rejection_sampling=rejection, is_all_greedy_sample=greedy)
        assert path is (A if spec.wants_advanced_draft_sampling else G)
        assert has_q == (path is A and not point_mass)
    # The engine's real variants: greedy argmax always; sampled rows on the advanced path
    # exactly when rejection sampling is on.
    assert variants[0] == (G, True, False)
    assert variants[1][0] is (A if rejection else G)
