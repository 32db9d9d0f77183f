"""The engine's page bookkeeping: after every iteration a running request owns exactly the
pages of its committed K/V (drafts rejected past a page boundary are given back), no page
is owned twice, and after finishes and cancels every page is free again."""

import anyio

from specloop.engine import AsyncEngine, EngineConfig, IterationState
from specloop.samplers import SamplingParams

from .conftest import PROMPTS, make_config


class PageInvariants:
    """Checks the page table at the end of each iteration (observer on RESCAN)."""

    def __init__(self):
        self.worker, self.checked, self.errors = None, 0, []

    def on_transition(self, event):
        if self.worker is None or event.state is not IterationState.RESCAN:
            return
        pages = self.worker.runner.pages
        owned = []
        for request in self.worker.scheduler.running:
            mine = pages.pages_of(request.slot)
            owned += mine
            if len(mine) != pages.pages_for(request.num_cached):
                self.errors.append((request.request_id, len(mine), request.num_cached))
        if len(owned) != len(set(owned)) or len(owned) + pages.num_free != pages.num_pages:
            self.errors.append(("leak or share", sorted(owned), pages.num_free))
        self.checked += 1


async def test_pages_follow_requests_and_all_return(tiny_dir, tiny_loaded):
    data = make_config(tiny_dir, method="ngram", k=3, max_batch_size=3).to_dict()
    data["model"]["kv_page_size"] = 2
    check = PageInvariants()
    async with AsyncEngine(EngineConfig.from_dict(data), model=tiny_loaded,
                           observers=[check]) as engine:
        check.worker = engine.worker

        async def one(i, prompt):
            params = SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i,
                                    max_tokens=6 + 5 * i, ignore_eos=True)
            n = 0
            async for out in engine.generate(prompt, params, request_id=f"r{i}"):
                n += len(out.token_ids)
                if i == 3 and n >= 4:
                    engine.cancel("r3")

        async with anyio.create_task_group() as tg:
            for i, prompt in enumerate(PROMPTS + PROMPTS[:2]):
                tg.start_soon(one, i, prompt)
        for _ in range(50):
            if engine.num_free_slots == 3:
                break
            await anyio.sleep(0.01)
        pages = engine.worker.runner.pages
        assert pages.num_free == pages.num_pages
        stats = engine.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some drafts rejected
    assert check.checked > 10 and not check.errors, check.errors[:5]
