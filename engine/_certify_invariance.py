"""certify's greedy and invariance checks: the same seeded probes run in several
scenarios must give identical tokens, and greedy probes must equal no-speculation greedy.

Scenarios (each a fresh engine, or group): ``alone`` (the reference: every probe in its
own fresh engine), ``batch_composition`` (all probes with fillers of other lengths and
params in one batch, so rows are padded), ``kv_slot_reuse`` (each probe after a filler
used its slot), ``warm_up`` (after greedy-only iterations), ``rank_placement`` (N
in-process ranks) and ``graph_replay`` (captured graphs vs eager, where CUDA is there).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Sequence

import attrs
import torch

from specloop.models import LoadedModel
from specloop.samplers import SamplingParams

from ._certify_checks import (FAIL, PASS, CheckResult, compare_outputs, skipped)
from ._certify_run import Job, evolve, generate, generate_all, generate_each, on_engine, \
    with_ranks
from ._config import EngineConfig
from ._engine import AsyncEngine

if TYPE_CHECKING:
    from ._certify_options import CertifyOptions

Output = tuple[int, ...]          # a job's generated tokens

GREEDY = SamplingParams(temperature=0.0)


def make_jobs(params_list: Iterable[SamplingParams], prompt_set: Sequence[tuple[int, ...]],
              seed_base: int, max_tokens: int) -> list[Job]:
    jobs = []
    for k, params in enumerate(list(params_list) + [GREEDY]):
        for i, prompt in enumerate(prompt_set):
            seed = None if params.is_greedy else seed_base + 7919 * k + 101 * i
            jobs.append(Job(prompt, attrs.evolve(params, seed=seed, max_tokens=max_tokens,
                                                 ignore_eos=True)))
    return list(dict.fromkeys(jobs))      # greedy given in --params too: once


def label(job: Job) -> str:
    p = job.params
    kind = "greedy" if p.is_greedy else f"T={p.temperature:g} top_p={p.top_p:g} seed={p.seed}"
    return f"prompt len {len(job.prompt)} {list(job.prompt)[:4]} {kind}"


def no_speculation(config: EngineConfig) -> EngineConfig:
    data = config.to_dict()
    data["speculative"] = {**data["speculative"], "method": "none",
                           "use_rejection_sampling": False}
    data["components"] = {**data["components"], "drafter": None}
    return type(config).from_dict(data)


class Scenarios:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, opts: CertifyOptions,
                 probes: list[Job], fillers: list[Job]) -> None:
        self.config, self.loaded, self.opts = config, loaded, opts
        self.probes, self.fillers = probes, fillers
        self.base = with_ranks(config, opts.ranks[0])

    def run(self, config: EngineConfig, fn: Callable[[AsyncEngine], Awaitable[Any]]
            ) -> Awaitable[Any]:
        return on_engine(config, self.loaded, fn, timeout=self.opts.timeout_s)

    def width(self, config: EngineConfig) -> int:
        return config.scheduler.max_batch_size * config.parallel.world_size

    async def alone(self, config: EngineConfig | None = None) -> list[Output]:
        config = config or self.base
        return [(await self.run(config, partial(generate, job=job))) for job in self.probes]

    async def batched(self, config: EngineConfig | None = None) -> list[Output]:
        config = config or self.base
        jobs = self.probes + self.fillers
        out: list[Output] = await self.run(config, lambda e: generate_all(e, jobs,
                                                            concurrency=self.width(config)))
        return out[:len(self.probes)]

    async def reuse(self) -> list[Output]:
        jobs = [j for probe, filler in zip(self.probes, self._cycle()) for j in (filler, probe)]
        out: list[Output] = await self.run(self.base, lambda e: generate_each(e, jobs))
        return out[1::2]

    async def warm_up(self) -> list[Output]:
        greedy = [j for j in self.fillers if j.params.is_greedy]

        async def fn(engine: AsyncEngine) -> list[Output]:
            await generate_all(engine, greedy, concurrency=len(greedy))
            return await generate_all(engine, self.probes, concurrency=self.width(self.base))

        out: list[Output] = await self.run(self.base, fn)
        return out

    def _cycle(self) -> list[Job]:
        return [self.fillers[i % len(self.fillers)] for i in range(len(self.probes))]


def graphs_available(config: EngineConfig) -> bool:
    """A graph cache is configured and can run here (any cache but eager; "cuda" needs a
    GPU): then the whole certificate runs on it and graph_replay compares with eager."""
    cache = config.components.graph_cache
    return cache != "eager" and (cache != "cuda" or torch.cuda.is_available())


async def run_invariance(config: EngineConfig, loaded: LoadedModel, opts: CertifyOptions,
                         params_list: Sequence[SamplingParams],
                         prompt_fn: Callable[..., list[tuple[int, ...]]]) -> list[CheckResult]:
    vocab = loaded.args.vocab_size
    probes = make_jobs(params_list, prompt_fn(vocab, (1, 1, 2, 5, 11), seed=2), 17,
                       opts.probe_tokens)
    fillers = make_jobs(params_list, prompt_fn(vocab, (3, 7, 14), seed=3), 99_991,
                        opts.probe_tokens + 3)
    sc = Scenarios(config, loaded, opts, probes, fillers)
    labels = [label(j) for j in probes]
    alone = await sc.alone()
    outputs = {"batch_composition": await sc.batched()}
    checks = []
    if "invariance" in opts.checks:
        outputs["kv_slot_reuse"] = await sc.reuse()
        outputs["warm_up"] = await sc.warm_up()
        for ranks in opts.ranks[1:]:
            outputs[f"rank_placement[{ranks}]"] = await sc.batched(with_ranks(config, ranks))
        if graphs_available(config):
            eager = evolve(sc.base, "components", graph_cache="eager")
            outputs["graph_replay"] = await sc.batched(eager)
        checks += [compare_outputs(f"invariance.{name}", alone, out, labels, "seeded probes")
                   for name, out in outputs.items()]
        if len(opts.ranks) < 2:
            checks.append(skipped("invariance.rank_placement",
                                  "one rank count; pass --ranks 1,2 to compare"))
        if not graphs_available(config):
            checks.append(skipped("invariance.graph_replay",
                                  "components.graph_cache is 'eager' (or 'cuda' without a "
                                  "CUDA device)"))
        checks.append(one_token_check(probes, alone, outputs, labels))
    if "greedy" in opts.checks:
        checks.append(await greedy_check(sc, probes, labels, {"alone": alone, **outputs}))
    return checks


def one_token_check(probes: list[Job], alone: list[Output], outputs: dict[str, list[Output]],
                    labels: list[str]) -> CheckResult:
    """The 1-token probes across every scenario (issue 14's mtp_eagle bug lived here)."""
    rows = [i for i, job in enumerate(probes) if len(job.prompt) == 1]
    mismatches = [f"{name}: {labels[i]}" for name, out in outputs.items() for i in rows
                  if tuple(out[i]) != tuple(alone[i])]
    total = len(rows) * len(outputs)
    summary = f"{total - len(mismatches)}/{total} 1-token probe runs identical" + (
        "; first mismatch: " + mismatches[0] if mismatches else "")
    return CheckResult("invariance.one_token_prompts", FAIL if mismatches else PASS,
                       summary, {"mismatches": mismatches})


async def greedy_check(sc: Scenarios, probes: list[Job], labels: list[str],
                       outputs: dict[str, list[Output]]) -> CheckResult:
    rows = [i for i, job in enumerate(probes) if job.params.is_greedy]
    ref_config = no_speculation(sc.base)
    greedy_jobs = [probes[i] for i in rows]
    reference = await sc.run(ref_config, lambda e: generate_each(e, greedy_jobs))
    results = [compare_outputs("greedy", reference, [out[i] for i in rows],
                               [f"{name}: {labels[i]}" for i in rows], "greedy probes")
               for name, out in outputs.items()]
    mismatches = [m for r in results for m in r.details["mismatches"]]
    total = len(rows) * len(outputs)
    summary = (f"{total - len(mismatches)}/{total} greedy probe runs equal no-speculation "
               "greedy" + ("; first mismatch: " + mismatches[0]["job"] if mismatches else ""))
    return CheckResult("greedy", FAIL if mismatches else PASS, summary,
                       {"mismatches": mismatches, "scenarios": list(outputs)})
