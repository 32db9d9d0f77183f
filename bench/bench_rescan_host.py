"""RESCAN's host time alone: ``RankWorker.rescan`` on a fixed batch of decoding requests,
with the real front door (one ``TextStream`` per request, detokenizing as it delivers) and
a waiting consumer per request (a future with a callback, as a ``generate`` task's), the
tiny random model (nothing runs on it: the verified tokens are set by hand, two accepted
tokens a row from a text's token ids). Times the handler's thread CPU time (a loaded,
shared host moves it far less than wall time); prints the median and the minimum over
blocks of 50 iterations.

    python bench/bench_rescan_host.py [--batch 32] [--k 3] [--iterations 1200]
        [--parts]    # also without text streams, without delivery, without trims
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

import torch

from _common import quiet_logs

TEXT = "The quick brown fox jumps over the lazy dog, then runs far away into the woods. "


async def measure(path, loaded, batch: int, k: int, iterations: int, *, text: bool = True,
                  deliver: bool = True, trim: bool = True) -> list[float]:
    """-> thread CPU µs of each block of 50 iterations' mean (after 200 warm-up ones)."""
    from specloop.engine import AsyncEngine, EngineConfig, IterationRecord  # noqa: PLC0415
    from specloop.engine._request import NewRequest  # noqa: PLC0415
    from specloop.engine._stop import TextStream  # noqa: PLC0415
    from specloop.samplers import RejectionResult, SamplingParams, SpecMetadata  # noqa: PLC0415
    config = EngineConfig.from_dict({
        "model": {"name": str(path), "dtype": "float32", "device": "cpu",
                  "max_seq_len": 1 << 15, "chat_template": False},
        "scheduler": {"max_batch_size": batch, "max_num_tokens": 4096},
        "speculative": {"method": "eagle3" if k else "none", "num_draft_tokens": k or 1}})
    engine = AsyncEngine(config, model=loaded)
    engine._build()
    worker, front = engine.worker, engine.front
    params = SamplingParams(temperature=0.0, max_tokens=10 ** 7, ignore_eos=True)
    channels = []
    for i in range(batch):
        new = NewRequest(f"r{i}", (1, 2, 3, 4), params, i, handle=i)
        stream = TextStream(engine.tokenizer, ()) if text else None
        channels.append(front.submit(new, text=stream))
    worker._apply(front.take_message(lambda news: tuple((0, r) for r in news)))
    requests = worker.scheduler.admit()
    for r in requests:
        r.num_cached = len(r.token_ids) - 1
    if not deliver:
        worker.outputs.deliver_many = lambda handles, outputs: None
    if not trim:
        worker.runner.trim_many = lambda requests: None
    loop = asyncio.get_running_loop()
    spec = SpecMetadata(use_rejection_sampling=False)
    k = worker.k
    ids = engine.tokenizer.encode(TEXT * 40)
    host = torch.zeros((batch, k + 2), dtype=torch.int64)
    host[:, -1] = min(1, k)
    times = []
    for it in range(iterations):
        for channel in channels:     # each consumer waits, as a generate task does
            waiter = channel._waiter = loop.create_future()
            waiter.add_done_callback(lambda f: None)
        worker.runner.reserve(requests, k)
        for j in range(k + 1):
            host[:, j] = ids[(it * (k + 1) + j) % len(ids)]
        rec = IterationRecord(it, spec)
        rec.batch, rec.num_draft_tokens = list(requests), k
        rec.result = RejectionResult(host[:, :-1], host[:, -1])
        start = time.thread_time()
        await worker.rescan(rec)
        times.append(time.thread_time() - start)
        await asyncio.sleep(0)      # the consumers' wake-ups run (not timed)
        for channel in channels:
            channel._items.clear()
    return [statistics.mean(times[i:i + 50]) * 1e6 for i in range(200, iterations, 50)]


def main() -> None:
    from specloop.models import load_model  # noqa: PLC0415
    from specloop.models.testing import write_tiny_checkpoint  # noqa: PLC0415
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--k", type=int, default=3, help="0: no speculation")
    ap.add_argument("--iterations", type=int, default=1200)
    ap.add_argument("--parts", action="store_true")
    args = ap.parse_args()
    quiet_logs()
    torch.set_num_threads(1)
    variants = {"rescan": {}}
    if args.parts:
        variants.update({"without text streams": {"text": False},
                         "without delivery": {"deliver": False},
                         "without delivery or trims": {"deliver": False, "trim": False}})
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_checkpoint(tmp, vocab_size=384, num_layers=2, hidden=64, seed=1)
        loaded = load_model(path, dtype=torch.float32)
        for name, kw in variants.items():
            blocks = asyncio.run(measure(path, loaded, args.batch, args.k, args.iterations,
                                         **kw))
            print(f"batch {args.batch} K={args.k} {name}: thread CPU per iteration median "
                  f"{statistics.median(blocks):.1f} us, min block {min(blocks):.1f} us; "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
