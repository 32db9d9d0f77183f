"""``specloop`` command line: ``generate`` and ``fetch-model``.

The CLI is the only place that configures structlog; the library never does.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from importlib.resources import files

import anyio
import structlog

from ._config import EngineConfig
from ._engine import AsyncEngine

DEFAULT_CONFIG = "smollm2-ngram.toml"


def configure_logging(fmt: str, level: str) -> None:
    renderer = (structlog.processors.JSONRenderer() if fmt == "json"
                else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso"), renderer],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))


def load_config(path: str | None) -> EngineConfig:
    if path is None:
        return EngineConfig.from_toml(files("specloop.engine") / "defaults" / DEFAULT_CONFIG)
    return EngineConfig.from_toml(path)


def sampling_params(args):
    from specloop.samplers import SamplingParams  # noqa: PLC0415
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens)


async def print_completions(engine, prompts, params) -> int:
    """One prompt streams to stdout as it is generated; several run concurrently (so a
    group spreads them over its ranks) and print in order once done. Returns new tokens."""
    if len(prompts) == 1:
        count = 0
        async for out in engine.generate(prompts[0], params):
            count += len(out.token_ids)
            print(out.text, end="", flush=True)
        print()
        return count
    texts, counts = [""] * len(prompts), [0] * len(prompts)

    async def one(i):
        async for out in engine.generate(prompts[i], params):
            texts[i] += out.text
            counts[i] += len(out.token_ids)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    for i, text in enumerate(texts):
        print(f"--- prompt {i}: {prompts[i]!r}\n{text}")
    return sum(counts)


async def run_generate(args) -> None:
    config = load_config(args.config)
    if args.method is not None:
        config = EngineConfig.from_dict(
            {**config.to_dict(), "speculative": {**config.to_dict()["speculative"],
                                                 "method": args.method}})
    async with AsyncEngine(config) as engine:
        if engine.front is None:          # ranks > 0 under torchrun serve until rank 0 exits
            await engine.wait_closed()
            return
        params = sampling_params(args)
        prompts = args.prompt or ["Tell me about llamas."]
        start = time.perf_counter()
        count = await print_completions(engine, prompts, params)
        elapsed = time.perf_counter() - start
        stats = engine.stats
        scope = " on rank 0" if config.parallel.world_size > 1 else ""
        print(f"[specloop] new tokens {count}, {count / elapsed:.1f} tok/s, "
              f"mean acceptance length {stats.mean_acceptance_length:.2f}, "
              f"acceptance rate {stats.acceptance_rate:.2f}{scope} "
              f"(method {config.speculative.method}, K {config.speculative.k})",
              flush=True)


def run_fetch_model(args) -> None:
    from specloop.models import ensure_model_cached  # noqa: PLC0415
    print(ensure_model_cached(args.name))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specloop", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion for each --prompt")
    g.add_argument("--config", help="TOML config (default: the embedded SmolLM2 config)")
    g.add_argument("--prompt", action="append", help="may be repeated")
    g.add_argument("--method", help="override speculative.method")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--log-format", choices=("console", "json"), default="console")
    g.add_argument("--log-level", default="warning", help="e.g. debug shows iteration_state")
    f = sub.add_parser("fetch-model", help="convert a registry model into the local cache")
    f.add_argument("name", nargs="?", default="smollm2-135m-instruct")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    fmt = getattr(args, "log_format", None) or "console"
    level = getattr(args, "log_level", None) or "warning"
    configure_logging(fmt, level)
    if args.command == "fetch-model":
        run_fetch_model(args)
    else:
        anyio.run(run_generate, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
