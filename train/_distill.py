"""Self-distillation: the target answers the prompts through specloop's own engine.

Batched (continuous batching over ``generate.batch_size`` slots), greedy for some prompts
and sampled at ``generate.temperature`` for the rest, seeded per prompt. The result is a
list of sequences (prompt ids + answer ids) and where each answer starts.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from os import PathLike
from typing import TYPE_CHECKING

import anyio
import attrs
import structlog
import torch

from specloop.engine import AsyncEngine, EngineConfig
from specloop.samplers import SamplingParams

from ._progress import Progress, progress

if TYPE_CHECKING:
    from specloop.models import LoadedModel, Tokenizer

    from ._config import TrainConfig
    from ._prompts import Prompt

log = structlog.get_logger(__name__)
MIN_ANSWER_TOKENS = 8
# One answer to generate: (split, prompt ids, sampling params, "greedy" or "sampled").
Job = tuple[str, list[int], SamplingParams, str]


@attrs.frozen
class Sequence:
    tokens: tuple[int, ...]
    prompt_len: int
    split: str       # "train" or "eval"
    mode: str        # "greedy" or "sampled"


def engine_config(cfg: TrainConfig, device: str) -> EngineConfig:
    gen = cfg.generate
    return EngineConfig.from_dict({
        "model": {"name": cfg.target.model, "dtype": cfg.target.dtype, "device": device,
                  "max_seq_len": gen.max_seq_len, "chat_template": False},
        "scheduler": {"max_batch_size": gen.batch_size,
                      "max_num_tokens": max(4096, gen.max_seq_len), "seed": cfg.data.seed},
        "speculative": {"method": "none"}})


def _params(cfg: TrainConfig, index: int) -> tuple[SamplingParams, str]:
    gen = cfg.generate
    # Every n-th prompt sampled: interleaved, so a time-cut run keeps both kinds.
    f = gen.sampled_fraction
    sampled = int((index + 1) * f) > int(index * f)
    temperature = gen.temperature if sampled else 0.0
    return (SamplingParams(temperature=temperature, seed=cfg.data.seed * 1_000_003 + index,
                           max_tokens=gen.max_new_tokens),
            "sampled" if sampled else "greedy")


def encode_prompts(tokenizer: Tokenizer, prompts: Iterable[Prompt], room: int
                   ) -> list[list[int]]:
    """Chat-templated ids, each cut to ``room`` tokens (the template's tail kept)."""
    out = []
    for p in prompts:
        ids = tokenizer.encode_chat([{"role": "user", "content": p.text}])
        out.append(ids if len(ids) <= room else ids[:room // 2] + ids[-(room - room // 2):])
    return out


async def _distill(engine: AsyncEngine, jobs: list[Job], cfg: TrainConfig, bar: Progress
                  ) -> list[Sequence]:
    results: list[Sequence | None] = [None] * len(jobs)
    limiter = anyio.CapacityLimiter(2 * cfg.generate.batch_size)

    async def one(i: int, split: str, ids: list[int], params: SamplingParams, mode: str
                  ) -> None:
        answer: list[int] = []
        try:
            async with limiter:
                if time.monotonic() > deadline:   # budget spent: start no more requests
                    return
                async for out in engine.generate(ids, params):
                    answer.extend(out.token_ids)
                    bar.update(len(out.token_ids))
        finally:
            if len(answer) >= MIN_ANSWER_TOKENS:
                results[i] = Sequence(tuple(ids) + tuple(answer), len(ids), split, mode)

    # Requests already running finish (a consumer leaving early is not this loop's job).
    deadline = time.monotonic() + cfg.generate.time_budget_s
    async with anyio.create_task_group() as tg:
        for i, job in enumerate(jobs):
            tg.start_soon(one, i, *job)
    return [r for r in results if r is not None]


def make_jobs(cfg: TrainConfig, splits: dict[str, list[Prompt]], tokenizer: Tokenizer
              ) -> list[Job]:
    """(split, ids, SamplingParams, mode) per answer: the held-out prompts first (they are
    few), then the training prompts; extra answers per training prompt come last, sampled."""
    room = cfg.generate.max_seq_len - cfg.generate.max_new_tokens - 2
    prompts = [(split, ids) for split in ("eval", "train")
               for ids in encode_prompts(tokenizer, splits[split], room)]
    jobs = [(split, ids, *_params(cfg, i)) for i, (split, ids) in enumerate(prompts)]
    gen, n = cfg.generate, len(prompts)
    for extra in range(1, gen.answers_per_prompt):
        for i, (split, ids) in enumerate(prompts):
            if split == "train":
                params = SamplingParams(temperature=gen.temperature,
                                        seed=cfg.data.seed * 1_000_003 + extra * n + i,
                                        max_tokens=gen.max_new_tokens)
                jobs.append((split, ids, params, "sampled"))
    return jobs


def distill(cfg: TrainConfig, splits: dict[str, list[Prompt]], *, device: str
            ) -> list[Sequence]:
    from specloop.models import load_model  # noqa: PLC0415
    from specloop.engine._runner import DTYPES  # noqa: PLC0415

    loaded = load_model(cfg.target.model, dtype=DTYPES[cfg.target.dtype], device=device)
    jobs = make_jobs(cfg, splits, loaded.tokenizer)
    start = time.perf_counter()
    with progress(total=None, desc="distill (tokens)", unit="tok") as bar:
        if cfg.generate.backend == "batched":
            seqs = _distill_batched(cfg, loaded, jobs, bar)
        else:
            async def main() -> list[Sequence]:
                async with AsyncEngine(engine_config(cfg, device), model=loaded) as engine:
                    return await _distill(engine, jobs, cfg, bar)
            seqs = anyio.run(main)
    answered = sum(len(s.tokens) - s.prompt_len for s in seqs)
    log.info("distilled", sequences=len(seqs), answer_tokens=answered,
             backend=cfg.generate.backend, seconds=round(time.perf_counter() - start, 1))
    return seqs


def _distill_batched(cfg: TrainConfig, loaded: LoadedModel, jobs: list[Job], bar: Progress
                     ) -> list[Sequence]:
    from ._batched import distill_batched  # noqa: PLC0415

    gen = cfg.generate
    answers = distill_batched(
        loaded, [(ids, p.temperature, split != "eval") for split, ids, p, _ in jobs],
        batch_size=gen.batch_size, max_new_tokens=gen.max_new_tokens,
        max_seq_len=gen.max_seq_len, time_budget_s=gen.time_budget_s, seed=cfg.data.seed,
        bar=bar)
    return [Sequence(tuple(ids) + tuple(a), len(ids), split, mode)
            for (split, ids, _, mode), a in zip(jobs, answers)
            if a is not None and len(a) >= MIN_ANSWER_TOKENS]


def save_sequences(path: str | PathLike[str], seqs: list[Sequence]) -> None:
    torch.save([{**attrs.asdict(s), "tokens": torch.tensor(s.tokens, dtype=torch.int32)}
                for s in seqs], path)


def load_sequences(path: str | PathLike[str]) -> list[Sequence]:
    return [Sequence(**{**d, "tokens": tuple(d["tokens"].tolist())})
            for d in torch.load(path, weights_only=True)]
