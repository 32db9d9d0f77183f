"""GPU: which Triton kernels compile a new specialisation after warm-up while an adaptive
engine (tiny random model and head, CUDA graphs, bf16) serves K switches and prompts of
many lengths -- each such compile stalls serving (~0.5 s a kernel). Prints, per new cache
entry: the kernel, the engine state it appeared in, the iteration's K and batch, and the
specialisation key; the last line is JSON {"new": count, "kernels": [...], "engine_counted":
the compiles the engine's own watch counted (engine/_compile_watch.py)}.

    python bench/probe_compiles_gpu.py [eagle3|ngram] [--pattern every|stretches] [--before]

``every``: adaptive K held to a cycle through every move of K (bench/results/
h200_1202d_probe_*: eagle3 crashed there until the draft argmax's NaN fix);
``stretches``: K = 0 stretches of 1 to 40 iterations between drafting ones (the catch-up
after each runs eagerly). Each pattern: three rounds of four ragged requests, then a
request alone (batch 1), greedy, then one sampled. ``--before``: the eager catch-up as
before 2026-12-02 (the longest row's width, no eager warm-up). A fresh process each time: Triton's in-process
caches outlive an engine, so only a fresh process sees what one engine's warm-up left out
(tests/graphs/test_chain_adaptive.py runs this script)."""
import argparse
import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))     # the tests' helpers
import anyio  # noqa: E402
import torch  # noqa: E402

from specloop.engine import AsyncEngine, EngineConfig  # noqa: E402
from specloop.models import load_model  # noqa: E402
from specloop.models.testing import write_tiny_checkpoint  # noqa: E402
from specloop.samplers import SamplingParams  # noqa: E402
from tests.engine.test_adaptive import cycle_k  # noqa: E402
from tests.graphs.test_chain_adaptive import (EVERY_MOVE, PROBE_LENGTHS,  # noqa: E402
                                              STRETCHES, ragged_config, ragged_rounds)
from tests.triton_variants import compiled_variants, jit_functions  # noqa: E402

PATTERNS = {"every": EVERY_MOVE, "stretches": STRETCHES}


def use_code_before() -> None:
    """The eager catch-up as before: the longest row's width, nothing warmed up."""
    from specloop.models.drafters._mtp import MtpEagleDrafter
    MtpEagleDrafter._eager_width = lambda self, counts: max(max(counts, default=1), 1)
    MtpEagleDrafter.warm_up_eager = lambda self, max_batch_size, sampler: None


def probe(method: str, pattern: list[int], tokens: int) -> tuple[list[dict], int]:
    """-> (one record per kernel specialisation compiled after warm-up, the compiles the
    engine itself counted while serving: ``EngineStats.kernels_compiled_while_serving``)."""
    found: list[dict] = []
    counted = [0]
    seen: list = [None]

    def check(state: str, k: int | None, batch: int | None) -> None:
        """Record the variants compiled since the last check, in ``state``."""
        if seen[0] is None:
            return
        now = compiled_variants()
        for name, keys in now.items():
            for key in keys - seen[0].get(name, set()):
                found.append({"kernel": name, "state": state, "k": k, "batch": batch,
                              "key": key[:300]})
        seen[0] = now

    class Observer:
        def on_transition(self, e):
            check(e.state.value, e.num_draft_tokens, e.batch_size)

    path = write_tiny_checkpoint(pathlib.Path(tempfile.mkdtemp()) / "t", vocab_size=384,
                                 num_layers=2, hidden=64, seed=1)
    loaded = load_model(path, dtype=torch.bfloat16, device="cuda")
    config = ragged_config(path, "cuda").to_dict()
    config["speculative"]["method"] = method
    cfg = EngineConfig.from_dict(config)

    async def main():
        async with AsyncEngine(cfg, model=loaded, observers=[Observer()]) as engine:
            cycle_k(engine.worker.adaptive, pattern)
            seen[0] = compiled_variants()
            print("after warm-up", sum(map(len, seen[0].values())), "entries")
            await ragged_rounds(engine, PROBE_LENGTHS, True, tokens=tokens)
            # A request alone, greedy then sampled: batch 1, where the engine's slots are
            # a view 8 bytes past a 16-byte boundary (row 1 of a [2, B] tensor), as at
            # every odd batch.
            for i, temperature in enumerate((0.0, 0.8)):
                params = SamplingParams(temperature=temperature, top_p=0.9, seed=i,
                                        max_tokens=tokens, ignore_eos=True)
                async for _ in engine.generate([5 + 7 * j % 300 for j in range(13 + i)],
                                               params, request_id=f"alone{i}"):
                    pass
            counted[0] = engine.stats.kernels_compiled_while_serving
    anyio.run(main)
    check("after serving", None, None)      # what compiled after the last transition
    return found, counted[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("method", nargs="?", default="eagle3")
    ap.add_argument("--pattern", choices=sorted(PATTERNS), default="every")
    ap.add_argument("--tokens", type=int, default=90)
    ap.add_argument("--before", action="store_true")
    args = ap.parse_args()
    if args.before:
        use_code_before()
    print("jit functions", len(jit_functions()))
    found, counted = probe(args.method, PATTERNS[args.pattern], args.tokens)
    print("new entries after warm-up", len(found))
    by: dict = {}
    for f in found:
        by.setdefault((f["kernel"], f["state"], f["k"]), []).append(f["key"])
    for (kern, state, k), keys in sorted(by.items(), key=str):
        print(f"{kern:40s} {state:15s} K={k} n={len(keys)}  e.g. {keys[0][:220]}")
    print(json.dumps({"new": len(found), "kernels": sorted({f["kernel"] for f in found}),
                      "engine_counted": counted}))


if __name__ == "__main__":
    main()
