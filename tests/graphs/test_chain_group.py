"""DRAFT and VERIFY chained on the device in a group of ranks (ADP, no LM-head TP), on the
CPU through graphs whose replays write static outputs (tests/graphs/test_chain.py): each
rank takes its chained step when SYNC agreed on the key it was queued under, else drops
it; outputs equal one rank's unchained, token for token, greedy and seeded sampled rows.
(Each batch all greedy or all sampled: ranks whose greedy flags differ run eagerly,
``RankWorker._group_agrees``, so no graph and no chain.)"""

import pytest

from specloop.comm import LocalGroup
from specloop.engine import AsyncEngine, EngineConfig
from specloop.engine._chain import DeviceChain
from specloop.samplers import SamplingParams

from ..engine.conftest import PROMPTS
from .test_chain import SEEDS, chain_config
from .test_static_steps import outputs_of


def group_config(tiny_dir, world, **spec):
    data = chain_config(tiny_dir, True, **spec).to_dict()
    data["parallel"] = {"world_size": world, "attention_dp": True}
    data["scheduler"]["max_batch_size"] = 2
    return EngineConfig.from_dict(data)


async def one_rank(cfg, loaded, reqs):
    async with AsyncEngine(cfg, model=loaded) as engine:
        return await outputs_of(engine, reqs)


def requests(sampled: bool):
    """Requests of different lengths (some end early, stop tokens in some), every one
    greedy or every one seeded sampled."""
    stops = tuple(range(40, 90))
    return [(p, SamplingParams(temperature=0.9 if sampled else 0.0, top_p=0.9,
                               seed=SEEDS[i % len(SEEDS)], max_tokens=10 + 3 * i,
                               stop_token_ids=stops if i % 3 == 1 else (), ignore_eos=True))
            for i, p in enumerate(PROMPTS * 2)]


async def chained_group(cfg, loaded, reqs) -> tuple[list, dict[int, DeviceChain]]:
    """``reqs`` through 2 LocalGroup ranks with DRAFT + VERIFY chained (forced on, as on a
    GPU rank: the chain runs on CUDA only) -> (rank 0's outputs, each rank's chain)."""
    chains: dict[int, DeviceChain] = {}

    async def rank_main(comm):
        async with AsyncEngine(cfg, communicator=comm, model=loaded) as engine:
            worker = engine.worker
            worker.verify_inline = True
            worker.chain = chains[comm.rank] = DeviceChain(worker=worker)
            if comm.rank == 0:
                return await outputs_of(engine, reqs)
            await engine.wait_closed()
            return None

    results = await LocalGroup(2, timeout=30.0).run(rank_main)
    return results[0], chains


@pytest.mark.parametrize("spec", [{"method": "eagle3", "k": 3, "rejection": True},
                                  {"method": "mtp_eagle", "k": 2, "rejection": False}])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
async def test_group_chained_equals_one_rank(tiny_dir, tiny_loaded, spec, sampled):
    reqs = requests(sampled)
    expected = await one_rank(chain_config(tiny_dir, False, **spec), tiny_loaded, reqs)
    got, chains = await chained_group(group_config(tiny_dir, 2, **spec), tiny_loaded, reqs)
    assert got == expected
    # Both ranks chained steps and took some; a key or batch SYNC changed dropped others.
    for chain in chains.values():
        assert chain.taken_steps > 0, (chain.queued_steps, chain.taken_steps)


async def test_group_newcomers_wait_for_the_chained_step(tiny_dir, tiny_loaded):
    """Under continuous admission (more requests than slots, ending at different
    iterations) a rank of a group holds the requests it admits back one iteration while
    its chained step is on the device, and takes them into the next one (``joined``), as
    one rank does: its chained steps are taken, not dropped at each newcomer (joining at
    once dropped 9 of 78 here, and 24 % on 2 x H200 under a server's load). Outputs equal
    one rank's."""
    spec = {"method": "eagle3", "k": 3}
    reqs = [(PROMPTS[i % len(PROMPTS)],
             SamplingParams(temperature=0.0, max_tokens=6 + (5 * i) % 13, ignore_eos=True))
            for i in range(24)]
    expected = await one_rank(chain_config(tiny_dir, False, **spec), tiny_loaded, reqs)
    got, chains = await chained_group(group_config(tiny_dir, 2, **spec), tiny_loaded, reqs)
    assert got == expected
    for chain in chains.values():
        assert chain.joined_steps > 0, "no newcomer joined a chained step"
        # A step is dropped only where the other rank's batch changed the group's key.
        assert chain.queued_steps - chain.taken_steps <= 3, \
            (chain.queued_steps, chain.taken_steps)
