"""Host overhead per iteration with a trivial stand-in model, logging at warning level.

The stand-in's forward and LM head cost ~nothing, so the time per iteration is the
engine's own: scheduling, SYNC, the graph key, drafting, sampling and RESCAN.

    python bench/bench_host_overhead.py [--batch 64] [--iterations 300] [--consumers stream,batch]
"""

from __future__ import annotations

import argparse
import time

import anyio
import torch

from _common import quiet_logs


class TrivialModel(torch.nn.Module):
    """Logits favour token (position-independent) 7; no attention, no weights to speak of."""

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.row = torch.zeros(args.vocab_size)
        self.row[7] = 1.0

    def forward(self, tokens, start_pos, slots, cache, *, num_layers=None, kv_len=None):
        return torch.zeros(*tokens.shape, self.args.hidden_size)

    def logits(self, hidden):
        return self.row.expand(*hidden.shape[:-1], -1)


def stand_in(tmp):
    from specloop.models import LoadedModel, load_model
    from specloop.models.testing import write_tiny_checkpoint
    real = load_model(write_tiny_checkpoint(tmp, vocab_size=320, num_layers=1, hidden=16,
                                            num_heads=2, num_kv_heads=1, intermediate=32))
    return LoadedModel(TrivialModel(real.args), real.tokenizer, real.args, real.path)


class StateTimes:
    """Sums each state's handler time: the engine's own cost, without its consumers."""

    def __init__(self):
        self.total_us = {}

    def on_transition(self, event):
        if event.batch_size:
            key = event.state.value
            self.total_us[key] = self.total_us.get(key, 0.0) + event.duration_us


async def measure(config, loaded, batch, iterations, consumer="stream"):
    """-> (wall us, process CPU us) per iteration, state times, K. ``consumer``: one
    ``generate`` task per request ("stream") or one ``generate_batch`` ("batch")."""
    from specloop.engine import AsyncEngine
    from specloop.samplers import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
    k = config.speculative.k
    times = StateTimes()
    async with AsyncEngine(config, model=loaded, observers=[times]) as engine:
        counts = []

        async def one(i):
            async for out in engine.generate([1, 2, 3, 4], params, request_id=f"r{i}"):
                counts.append(len(out.token_ids))

        async def all_at_once():
            async for item in engine.generate_batch([[1, 2, 3, 4]] * batch, params):
                for out in item:
                    counts.append(len(out.token_ids))
        async with anyio.create_task_group() as tg:
            if consumer == "batch":
                tg.start_soon(all_at_once)
            else:
                for i in range(batch):
                    tg.start_soon(one, i)
            while engine.stats.num_iterations < 20:
                await anyio.sleep(0.01)
            start_it, start = engine.stats.num_iterations, time.perf_counter()
            cpu = time.process_time()
            times.total_us.clear()
            while engine.stats.num_iterations < start_it + iterations:
                await anyio.sleep(0.01)
            done = engine.stats.num_iterations - start_it
            per_it = (time.perf_counter() - start) / done
            cpu_it = (time.process_time() - cpu) / done
            states = {k_: v / done for k_, v in times.total_us.items()}
            tg.cancel_scope.cancel()
    return per_it * 1e6, cpu_it * 1e6, sum(states.values()), states, k


async def direct_handlers_us(config, loaded, batch, iterations):
    """The engine's own host work: every handler of an iteration called in order on a
    fixed batch of ``batch`` decoding requests, compute inline (no thread hop, no
    consumers), the stand-in model costing ~nothing."""
    from specloop.engine import AsyncEngine, IterationRecord
    from specloop.engine._request import Request
    from specloop.samplers import SamplingParams, SpecMetadata
    engine = AsyncEngine(config, model=loaded)
    engine._build()
    worker = engine.worker
    params = SamplingParams(temperature=0.0, max_tokens=10**9, ignore_eos=True)
    requests = [Request(f"r{i}", (1, 2, 3, 4), params, i, [1, 2, 3, 4], slot=i,
                        num_cached=3) for i in range(batch)]
    worker.scheduler.running = list(requests)
    spec = SpecMetadata(use_rejection_sampling=config.speculative.use_rejection_sampling)
    if worker.drafter is not None:
        for r in requests:
            worker.drafter.prefill(r.slot, r.token_ids[:-1], None)

    async def one():
        rec = IterationRecord(0, spec)
        rec.batch = list(requests)
        await worker.sync(rec)
        await worker.pick_graph_key(rec)
        await worker.draft(rec)
        rec.result = worker._verify(rec)
        await worker.rescan(rec)

    for _ in range(20):
        await one()
    start = time.perf_counter()
    for _ in range(iterations):
        await one()
    return (time.perf_counter() - start) / iterations * 1e6


def main():
    import tempfile
    from specloop.engine import EngineConfig
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--consumers", default="stream,batch",
                    help="stream: a generate task per request; batch: one generate_batch")
    ap.add_argument("--methods", default="none,ngram")
    args = ap.parse_args()
    quiet_logs()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        loaded = stand_in(tmp)
        for method in args.methods.split(","):
            config = EngineConfig.from_dict({
                "model": {"name": str(loaded.path), "max_seq_len": 4096, "chat_template": False},
                "scheduler": {"max_batch_size": args.batch},
                "speculative": {"method": method, "num_draft_tokens": 4}})
            direct = anyio.run(direct_handlers_us, config, loaded, args.batch,
                               args.iterations)
            for consumer in args.consumers.split(","):
                wall, cpu, engine_us, states, k = anyio.run(
                    measure, config, loaded, args.batch, args.iterations, consumer)
                split = ", ".join(f"{s_} {v:.0f}" for s_, v in states.items())
                print(f"host overhead, batch {args.batch}, method {method} (K={k}): engine "
                      f"handlers {direct:.0f} us/iteration (goal <= 200); in the running "
                      f"engine with {consumer} consumers and compute off the event loop "
                      f"{wall:.0f} us/iteration wall, {cpu:.0f} us process CPU [state "
                      f"times incl. consumers run meanwhile: {split}]", flush=True)


if __name__ == "__main__":
    main()
