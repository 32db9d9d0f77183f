"""``specloop generate``: complete each --prompt, streaming one, or several concurrently."""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

import anyio
import attrs

from ._cli_common import (EXIT_INTERRUPTED, UsageError, add_engine_arguments, load_config,
                          spawns_group)

if TYPE_CHECKING:
    from specloop.samplers import SamplingParams

    from ._config import EngineConfig
    from ._engine import AsyncEngine
    from ._process import ProcessEngine
    from ._stats import EngineStats

HELP = "generate a completion for each --prompt"
DEFAULT_PROMPT = "Tell me about llamas."


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--prompt", action="append", help="may be repeated")
    p.add_argument("--system", help="a system message (chat template only)")
    add_sampling_arguments(p, max_tokens=64, temperature=0.0)
    p.add_argument("--trace", metavar="FILE",
                   help="write a timeline of every iteration state and collective on every "
                   "rank (Chrome trace-event JSON; open it in https://ui.perfetto.dev)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt (text, token_ids, usage)")


def add_sampling_arguments(p: argparse.ArgumentParser, *, max_tokens: int,
                           temperature: float) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=temperature)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the completion before this text (may be repeated)")
    p.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    from specloop.samplers import SamplingParams  # noqa: PLC0415
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens,
                          stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_id),
                          ignore_eos=args.ignore_eos)


@attrs.define
class Completion:
    prompt: str
    text: str = ""
    token_ids: list[int] = attrs.Factory(list)
    finish_reason: str | None = None


@attrs.define
class Progress:
    """What was generated so far: survives Ctrl-C so the summary can still be printed."""

    completions: list[Completion]
    start: float = attrs.Factory(time.perf_counter)
    stats: EngineStats | None = None
    scope: str = ""

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)


def run(args: argparse.Namespace) -> int:
    # Everything checkable is checked before the model loads: the flags first, before the
    # config (whose model-name check imports the model registry, and so torch).
    params = sampling_params(args)
    prompts = args.prompt or [DEFAULT_PROMPT]
    if any(not p.strip() for p in prompts):
        raise UsageError("--prompt is empty; give some text")
    config = load_config(args)
    if args.trace and spawns_group(config):
        raise UsageError(f"--trace on {config.parallel.world_size} ranks needs each rank's "
                         "engine in its own torchrun process: launch with torchrun "
                         f"--nproc-per-node {config.parallel.world_size}")
    if args.system is not None and not config.model.chat_template:
        raise UsageError("--system needs the chat template; drop --no-chat-template or "
                         "--system")
    progress = Progress([Completion(p) for p in prompts])
    try:
        anyio.run(_generate, config, args, params, progress)
    except KeyboardInterrupt:
        print("\n[specloop] interrupted", flush=True)
        _finish(progress, config, args, interrupted=True)
        return EXIT_INTERRUPTED
    return 0


async def _generate(config: EngineConfig, args: argparse.Namespace, params: SamplingParams,
                    progress: Progress) -> None:
    from ._cli_engine import open_engine  # noqa: PLC0415

    progress.scope = " on rank 0" if config.parallel.world_size > 1 else ""
    if spawns_group(config):    # several ranks without torchrun: it starts them itself
        from ._process import ProcessEngine  # noqa: PLC0415

        async with ProcessEngine(config) as group:
            await _complete(group, args, params, progress)
            progress.stats = await group.fetch_stats()
        _finish(progress, config, args, interrupted=False)
        return
    async with open_engine(config, trace=args.trace) as engine:
        if engine.front is None:          # ranks > 0 under torchrun: serve until rank 0 exits
            await engine.wait_closed()
            return
        progress.stats = engine.stats
        await _complete(engine, args, params, progress)
    _finish(progress, config, args, interrupted=False)


async def _complete(engine: AsyncEngine | ProcessEngine, args: argparse.Namespace,
                    params: SamplingParams, progress: Progress) -> None:
    """Every prompt at once, the one of a single prompt streamed to stdout."""
    progress.start = time.perf_counter()
    prompts = [_prompt(engine, c.prompt, args.system) for c in progress.completions]
    stream = len(prompts) == 1 and not args.json
    async with anyio.create_task_group() as tg:
        for completion, prompt in zip(progress.completions, prompts):
            tg.start_soon(_one, engine, prompt, params, completion, stream)


def _prompt(engine: AsyncEngine | ProcessEngine, text: str, system: str | None
            ) -> str | list[int]:
    """A string lets the engine apply its own chat template; --system needs the messages."""
    if system is None:
        return text
    tokenizer = engine.tokenizer
    assert tokenizer is not None, "open_engine returns a built engine"
    if not tokenizer.chat_template:
        raise UsageError("--system needs a chat template, and this model's tokenizer has none")
    return tokenizer.encode_chat([{"role": "system", "content": system},
                                  {"role": "user", "content": text}])


async def _one(engine: AsyncEngine | ProcessEngine, prompt: str | list[int],
               params: SamplingParams, completion: Completion, stream: bool) -> None:
    async for out in engine.generate(prompt, params):
        completion.text += out.text
        completion.token_ids.extend(out.token_ids)
        if stream:
            print(out.text, end="", flush=True)
        if out.finish_reason is not None:      # set on the finished output alone
            completion.finish_reason = out.finish_reason.value
    if stream:
        print(flush=True)


def _finish(progress: Progress, config: EngineConfig, args: argparse.Namespace, *,
            interrupted: bool) -> None:
    if args.json:
        for c in progress.completions:
            print(json.dumps({"prompt": c.prompt, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason}), flush=True)
    elif len(progress.completions) > 1:
        for i, c in enumerate(progress.completions):
            print(f"--- prompt {i}: {c.prompt!r}\n{c.text}", flush=True)
    print(summary_line(progress, config, interrupted), flush=True)


def summary_line(progress: Progress, config: EngineConfig, interrupted: bool) -> str:
    count = progress.num_tokens
    elapsed = max(time.perf_counter() - progress.start, 1e-9)
    line = f"[specloop] new tokens {count}, {count / elapsed:.1f} tok/s"
    stats = progress.stats
    if stats is not None:
        line += (f", mean acceptance length {stats.mean_acceptance_length:.2f}, "
                 f"acceptance rate {stats.acceptance_rate:.2f}")
        if stats.num_drafting_rows:     # of the rows that drafted position j, the accepted
            per = " ".join(f"{a:.2f}" for a in stats.acceptance_per_position)
            line += f", acceptance per position {per}"
        line += progress.scope
        # Each a stall of the whole batch (engine/_compile_watch.py): said where any came.
        compiled = stats.kernels_compiled_while_serving
        if compiled:
            line += f", {compiled} kernel(s) compiled while serving"
    k = f"K {config.speculative.k}"
    if config.speculative.adaptive and config.speculative.k:
        per_k = dict(sorted(stats.iterations_per_k.items())) if stats is not None else {}
        k = f"adaptive K <= {config.speculative.k}, iterations per K {per_k}"
    tree = config.speculative.draft_tree
    if tree is not None:    # greedy batches draft it; the chain of its depth otherwise
        k += f", a draft tree of {tree.size} nodes"
    line += f" (method {config.speculative.method}, {k})"
    return line + (" [interrupted]" if interrupted else "")
