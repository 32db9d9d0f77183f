"""What a ``ProcessEngine``'s parent can deliver: outputs a second into N ``generate``
consumers (a task per request, text detokenized as delivered), fed as a core would feed
them, with no core: rank 0's own rows (``("out", rows, events)``) or another rank's block
(``("blocks", [bytes])``, decoded by handle here). No speculation (one token an output),
the SmolLM2 tokenizer; rank 0's rows also with ``detokenize=False`` (token ids only). A
group of ranks serves at most this many tokens a second through one parent, whatever its
GPUs do.

    python bench/bench_parent_outputs.py [--requests 128] [--iterations 200] [--runs 3]
"""

from __future__ import annotations

import argparse
import time

import anyio


def make_engine():
    from specloop.engine import EngineConfig, ProcessEngine
    from specloop.models._loading import load_tokenizer, resolve_model_path

    config = EngineConfig.from_dict({"model": {"name": "smollm2-135m-instruct",
                                               "device": "cpu", "chat_template": False}})
    engine = ProcessEngine(config)
    _, engine.tokenizer = load_tokenizer(resolve_model_path("smollm2-135m-instruct"))
    engine._core = {"k": 0, "verify_drafts": 0, "vocab_size": 49152}
    engine._state = "running"       # its request side only: no core is started
    return engine


async def run(requests: int, iterations: int, blocks: bool, detokenize: bool = True) -> float:
    """µs an output, consumers included; ``detokenize`` False: token ids only (no
    detokenizer at the front door, ``SamplingParams.detokenize``)."""
    from specloop.engine._request import FinishReason, RequestOutput
    from specloop.engine._wire import encode_rows, make_row
    from specloop.samplers import SamplingParams

    engine = make_engine()
    params = SamplingParams(temperature=0, max_tokens=iterations, ignore_eos=True,
                            detokenize=detokenize)
    received = [0]

    async def consume(i: int) -> None:
        async for out in engine.generate([10 + i, 20, 30], params, request_id=f"r{i}"):
            received[0] += len(out.token_ids)

    async with anyio.create_task_group() as tg:
        for i in range(requests):
            tg.start_soon(consume, i)
        await anyio.sleep(0.01)     # every request submitted
        taken = engine.front.take_message(lambda new: tuple((0, r) for r in new))
        handles = [r.handle for _, r in taken.assignments]
        start = time.perf_counter()
        for it in range(iterations):
            done = it == iterations - 1
            reason = FinishReason.LENGTH if done else None
            tokens = [(300 + 7 * it + i) % 5000 for i in range(requests)]
            if blocks:
                outs = [(h, RequestOutput("", (t,), "", done, reason))
                        for h, t in zip(handles, tokens)]
                block = encode_rows(outs, requests, 0)
                assert block is not None
                engine._handle(("blocks", [block.tobytes()]))
            else:
                engine._handle(("out", [make_row(f"r{i}", (t,), done, reason)
                                        for i, t in enumerate(tokens)], None))
            await anyio.sleep(0)    # the consumers' turn, once an iteration
    elapsed = time.perf_counter() - start
    assert received[0] == requests * iterations
    return elapsed / (requests * iterations) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    for blocks, detokenize in ((False, True), (False, False), (True, True)):
        us = sorted(anyio.run(run, args.requests, args.iterations, blocks, detokenize)
                    for _ in range(args.runs))
        print(f"{'another rank (blocks)' if blocks else 'rank 0 (rows)'}"
              f"{'' if detokenize else ', token ids only (detokenize=False)'}: "
              f"{', '.join(f'{u:.2f}' for u in us)} us an output "
              f"({1e6 / us[len(us) // 2]:,.0f} outputs a second at the median)", flush=True)


if __name__ == "__main__":
    main()
