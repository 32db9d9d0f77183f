"""Host time, on the CPU, of the calls that differ when adaptive n-gram switches out of a
K = 0 stretch (the iteration that queues the chained K = 4 step: ``0>4``) against one
inside the chain (``4>4``) and the K = 0 stretch (labelled ``4>0``, the last chained
move): the chain's ``chained_inputs`` and n-gram's ``_copy_meta`` (the tokens committed
at K = 0, copied to its device history), the runner's ``reserve`` and the page table's
``sync``. One request, K held to a cycle of six K = 0 and two K = 4 iterations
(``cycle_k``), one CUDA rank's path forced, graphs as the tests' StaticOutputCache (the
K = 0 graph feeds itself); median µs a call.

    python bench/bench_k0_switch_host.py [--tokens 1200]
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)     # the tests' graph cache and helpers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1200)
    args = ap.parse_args()

    import anyio  # noqa: PLC0415
    import torch  # noqa: PLC0415

    from specloop.engine import AsyncEngine, EngineConfig, _chain, _runner  # noqa: PLC0415
    from specloop.models import _cache, load_model  # noqa: PLC0415
    from specloop.models.drafters._ngram import NgramDrafter  # noqa: PLC0415
    from specloop.models.testing import write_tiny_checkpoint  # noqa: PLC0415
    from specloop.samplers import SamplingParams  # noqa: PLC0415
    from tests.engine.conftest import PROMPTS, make_config  # noqa: PLC0415
    from tests.engine.test_adaptive import cycle_k  # noqa: PLC0415

    times: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    move = ["other"]

    def timed(cls, name):
        f = getattr(cls, name)

        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                times[(name, move[0])].append(time.perf_counter() - start)
        setattr(cls, name, wrapper)

    for cls, name in [(NgramDrafter, "_copy_meta"), (NgramDrafter, "chained_inputs"),
                      (_runner.ModelRunner, "reserve"), (_cache.PageTable, "sync")]:
        timed(cls, name)
    queue = _chain.DeviceChain.queue

    def labelled(self, rec, pending, rows, k=None):
        move[0] = f"{rec.k}>{k}"
        return queue(self, rec, pending, rows, k)
    _chain.DeviceChain.queue = labelled

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_checkpoint(pathlib.Path(tmp) / "t", vocab_size=384, num_layers=2,
                                     hidden=32, seed=1)
        loaded = load_model(path, dtype=torch.float32)
        data = make_config(path, method="ngram", k=4, speculative={"adaptive": True},
                           max_batch_size=1, max_seq_len=2048).to_dict()
        data["components"]["graph_cache"] = "tests.graphs.test_chain:StaticOutputCache"
        data["graphs"] = {"batch_buckets": [1]}

        async def run():
            async with AsyncEngine(EngineConfig.from_dict(data), model=loaded) as engine:
                worker = engine.worker
                worker.verify_inline = worker.ahead.at_k0 = True     # one CUDA rank's path
                worker.chain = _chain.DeviceChain(worker=worker)
                cycle_k(worker.adaptive, [0, 0, 0, 0, 0, 0, 4, 4])
                params = SamplingParams(temperature=0.0, max_tokens=args.tokens,
                                        ignore_eos=True)
                async for _ in engine.generate(PROMPTS[0], params):
                    pass
        anyio.run(run)
    for (name, where), xs in sorted(times.items()):
        xs.sort()
        print(f"{name:15s} {where:6s} calls {len(xs):5d}  median "
              f"{xs[len(xs) // 2] * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
