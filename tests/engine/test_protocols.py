"""The component contract at run time: every built-in component has every member of its
kind's protocol (what the engine calls, without probing), and a component that lacks one
is refused when the engine is built, naming what is missing. tests/test_typecheck.py
checks the same statically (mypy)."""

import pytest

from specloop.comm import CollectiveCounter, LocalGroup
from specloop.engine import AsyncEngine, ConfigError, EngineConfig, known_components
from specloop.engine._components import (build_graph_cache, build_sampler, missing_members,
                                         protocol_members, protocol_of)
from specloop.engine._trace import TraceRecorder

from .conftest import make_config

# What the engine uses of each kind: a protocol that drops one of these fails here.
USED = {
    "sampler": {"draft", "verify", "strict_targets"},
    "communicator": {"rank", "world_size", "name", "all_gather", "all_gather_object", "all_gather_bytes",
                     "all_reduce", "broadcast_object", "barrier", "subgroup", "timeout_s",
                     "bounded", "close", "host_tensors"},
    "graph_cache": {"pick", "keys_to_capture", "capture", "has", "replay", "seal"},
    "drafter": {"num_draft_tokens", "prefill", "propose", "release", "point_mass",
                "needs_empty_calls", "feature_layers", "on_verified", "can_graph",
                "graph_step", "graph_inputs", "variable_k", "can_chain", "chained_inputs",
                "chained_consumed", "prefill_many", "prefill_graphs", "chains_through_k0",
                "chains_joiners", "joining_rows", "num_draft_classes", "draft_classes", "warm_up_eager",
                "drafts_trees", "tree_graph_step"},
    "observer": {"on_transition"},
}


@pytest.mark.parametrize("kind", sorted(USED))
def test_protocols_declare_what_the_engine_uses(kind):
    assert protocol_members(protocol_of(kind)) == USED[kind]


def test_wrapped_communicators_report_the_inner_ones_host_tensors():
    """SCHEDULE's exchange reads ``host_tensors`` off the communicator it is given, which
    --trace and the collective counter wrap."""
    from specloop.comm import SingleRankCommunicator

    class OnHost(SingleRankCommunicator):
        host_tensors = True

    for inner, want in ((SingleRankCommunicator(), False), (OnHost(), True)):
        for wrapped in (CollectiveCounter(inner), TraceRecorder().communicator(inner)):
            assert wrapped.host_tensors is want
            assert wrapped.bounded(5.0).host_tensors is want


@pytest.mark.parametrize("name", sorted(known_components("graph_cache")))
def test_builtin_graph_caches_are_complete(name):
    config = EngineConfig.from_dict({"components": {"graph_cache": name}})
    assert missing_members(build_graph_cache(config), protocol_of("graph_cache")) == []


def test_builtin_samplers_and_communicators_are_complete():
    from specloop.comm import SingleRankCommunicator

    assert missing_members(build_sampler(EngineConfig()), protocol_of("sampler")) == []
    assert missing_members(TraceRecorder(), protocol_of("observer")) == []
    comm = protocol_of("communicator")
    local = LocalGroup(2).communicator(0)
    for obj in (SingleRankCommunicator(), local, local.bounded(1.0), CollectiveCounter(local),
                TraceRecorder().communicator(local)):
        assert missing_members(obj, comm) == [], type(obj).__name__


@pytest.mark.parametrize("method", ["ngram", "draft_model", "early_exit", "mtp_eagle",
                                    "eagle3"])
def test_builtin_drafters_are_complete(tiny_dir, tiny_draft_dir, tiny_loaded, method):
    config = make_config(tiny_dir, method=method, k=2,
                         draft_model=tiny_draft_dir if method == "draft_model" else None)
    engine = AsyncEngine(config, model=tiny_loaded)
    engine._build()
    drafter = engine.worker.drafter
    assert missing_members(drafter, protocol_of("drafter")) == []
    assert drafter.point_mass is (method == "ngram")
    assert drafter.needs_empty_calls is False
    assert (len(drafter.feature_layers) >= 2) is (method == "eagle3")
    if not drafter.variable_k:      # a fixed-K drafter's graph step refuses another K
        assert method in ("draft_model", "early_exit")
        with pytest.raises(ValueError, match="fixed K = 2 .*num_draft_tokens = 1"):
            drafter.graph_step(None, None, advanced=False, num_draft_tokens=1)


class HalfDrafter:
    """Written against the old, partial protocol: no needs_empty_calls, can_graph, ..."""

    def __init__(self, config, deps) -> None:
        self.num_draft_tokens = config.speculative.num_draft_tokens

    def prefill(self, slot, token_ids, hidden) -> None:
        pass

    async def propose(self, ctx):
        raise AssertionError("never built")

    def release(self, slot) -> None:
        pass


def test_incomplete_component_is_refused_naming_what_it_lacks(tiny_dir, tiny_loaded):
    config = make_config(tiny_dir, method="ngram",
                         components={"drafter": "tests.engine.test_protocols:HalfDrafter"})
    with pytest.raises(ConfigError) as err:
        AsyncEngine(config, model=tiny_loaded)._build()
    message = str(err.value)
    for member in ("can_graph", "feature_layers", "graph_inputs", "graph_step",
                   "needs_empty_calls", "on_verified", "point_mass"):
        assert member in message
    assert "specloop.models.drafters.Drafter" in message


def test_missing_members_reads_no_property():
    from specloop.models.drafters import Drafter

    class Lazy(Drafter):
        @property
        def needs_empty_calls(self) -> bool:
            raise AssertionError("evaluated")

    lazy = Lazy()
    lazy.num_draft_tokens = 1
    assert missing_members(lazy, Drafter) == []
