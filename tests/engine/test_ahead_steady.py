"""The step queued ahead (no speculation, one GPU rank's path, run on the CPU) under a
server's load: rows ending at different iterations and requests arriving while others run
keep the step queued ahead in use (engine/_ahead.py), with the tokens of the eager path."""

from specloop.engine import AsyncEngine
from specloop.samplers import SamplingParams

from .conftest import PROMPTS, make_config


def _params(max_tokens, i):
    """Greedy and seeded sampled rows, alternately; EOS ignored (lengths end them)."""
    if i % 2:
        return SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _watch(worker, log):
    """Per VERIFY: (whether it took a step queued ahead, the batch); on the inline path."""
    take = worker.ahead.take

    def counted(rec):
        pending, rows = take(rec)
        log.append((pending is not None, tuple(rec.batch)))
        return pending, rows
    worker.ahead.take = counted


async def test_rows_ending_by_length_keep_the_step_ahead(tiny_dir, tiny_loaded):
    """Four requests admitted together end by max_tokens at four different iterations, one
    by the cache's length (max_seq_len 40): every iteration after the first takes the step
    the last one queued (for the rows left), the tokens are the eager path's, and every
    page comes back."""
    lengths = [5, 9, 13, 40]
    prompts = [PROMPTS[i] for i in range(4)]
    params = [_params(m, i) for i, m in enumerate(lengths)]

    async def run(ahead):
        log: list[tuple[bool, tuple]] = []
        async with AsyncEngine(make_config(tiny_dir, max_seq_len=40),
                               model=tiny_loaded) as engine:
            worker = engine.worker
            worker.verify_inline = worker.ahead.always = ahead
            _watch(worker, log)
            tokens: dict[str, list[int]] = {}
            async for outs in engine.generate_batch(prompts, params):
                for o in outs:
                    tokens.setdefault(o.request_id, []).extend(o.token_ids)
            pages = worker.runner.pages
            assert pages.num_free == pages.num_pages
        return [tokens[i] for i in sorted(tokens)], log

    eager, _ = await run(False)
    ahead, log = await run(True)
    assert ahead == eager
    assert [len(t) for t in ahead[:3]] == lengths[:3]
    assert len(ahead[3]) < lengths[3]           # ended by the cache's length
    taken = [t for t, _ in log]
    assert not taken[0] and all(taken[1:]), taken
    assert len({len(b) for _, b in log}) == 4   # taken for 4, 3, 2 and 1 rows

