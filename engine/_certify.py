"""``specloop certify``: an exactness certificate for one engine configuration.

Runs the configured engine (drafter, K, verification, ranks, graphs) through its public
API and checks: the distribution of sampled tokens per position (chi-square against the
target's own distribution, with a wrong-temperature control that must fail), greedy ==
no-speculation greedy, and invariance of seeded outputs to batch composition, KV-slot
reuse, 1-token prompts, rank placement, graph replay and warm-up. docs/exactness.md.
Its command line is ``_cli_certify.py``; its options ``_certify_options.py``.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import attrs
import torch

from specloop.models import LoadedModel
from specloop.samplers import SamplingParams

from ._certify_checks import (FAIL, INCONCLUSIVE, PASS, SKIPPED, CheckResult,
                              distribution_check, distribution_rows, worst)
from ._certify_invariance import run_invariance
from ._certify_options import CertifyOptions, parse_params
from ._certify_run import Job, generate_all, on_engine, with_ranks
from ._config import EngineConfig

# A certificate where every check was skipped tested nothing: not a pass.
EXIT = {PASS: 0, FAIL: 1, INCONCLUSIVE: 3, SKIPPED: 3}


def prompts(vocab: int, lengths: Sequence[int], seed: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, vocab, (n,), generator=gen).tolist()) for n in lengths]


def seeded(params: SamplingParams, seed: int, max_tokens: int) -> SamplingParams:
    return attrs.evolve(params, seed=seed, max_tokens=max_tokens, ignore_eos=True)


async def run_distribution(config: EngineConfig, loaded: LoadedModel, opts: CertifyOptions
                           ) -> CheckResult:
    vocab = loaded.args.vocab_size
    groups: list[dict[str, Any]] = []
    jobs: list[Job] = []
    for pi, prompt in enumerate(prompts(vocab, (1, 6), seed=1)):
        for text in opts.params:
            params = parse_params(text)
            if params.is_greedy:
                continue
            base = 1_000_003 * len(groups)
            groups.append({"prompt_index": pi, "prompt": list(prompt), "params_text": text,
                           "params": params, "first_job": len(jobs)})
            jobs += [Job(prompt, seeded(params, base + i, opts.positions))
                     for i in range(opts.trials)]
    if not jobs:
        return distribution_check([])
    cfg = with_ranks(config, opts.ranks[0])
    width = cfg.scheduler.max_batch_size * cfg.parallel.world_size
    outputs = await on_engine(cfg, loaded, lambda e: generate_all(e, jobs, concurrency=width),
                              timeout=opts.timeout_s)
    for g in groups:
        rows = outputs[g["first_job"]:g["first_job"] + opts.trials]
        samples = torch.tensor([list(r) for r in rows], dtype=torch.int64)
        g["rows"] = distribution_rows(loaded, g["prompt"], g.pop("params"), samples,
                                      opts.control_ratio)
        del g["first_job"]
    return distribution_check(groups)


def load_target(config: EngineConfig) -> LoadedModel:
    """The target once, shared by every engine certify builds and its reference forwards."""
    from specloop.models import load_model  # noqa: PLC0415

    device = config.model.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return load_model(config.model.name, dtype=getattr(torch, config.model.dtype),
                      device=torch.device(device))


async def certify(config: EngineConfig, opts: CertifyOptions, *,
                  model: LoadedModel | None = None) -> dict[str, Any]:
    """The whole certificate as a JSON-able dict; ``verdict`` is its worst check."""
    start = time.perf_counter()
    loaded = model or load_target(config)
    checks: list[CheckResult] = []
    timings = {"load": round(time.perf_counter() - start, 2)}
    if "distribution" in opts.checks:
        checks.append(await run_distribution(config, loaded, opts))
        timings["distribution"] = round(time.perf_counter() - start - sum(timings.values()), 2)
    if "greedy" in opts.checks or "invariance" in opts.checks:
        probe_params = [parse_params(t) for t in opts.params]
        checks += await run_invariance(config, loaded, opts, probe_params, prompts)
        timings["greedy_invariance"] = round(time.perf_counter() - start
                                             - sum(timings.values()), 2)
    verdict = worst([c.status for c in checks])
    return {"verdict": verdict, "seconds": round(time.perf_counter() - start, 2),
            "timings": timings,
            "config": config.to_dict(), "options": attrs.asdict(opts),
            "checks": [c.as_dict() for c in checks]}


def render(report: dict[str, Any]) -> str:
    spec = report["config"]["speculative"]
    lines = [f"specloop certificate: {report['verdict'].upper()}  "
             f"(method {spec['method']}, K {spec['num_draft_tokens']}, verification "
             f"{spec['verification']}, rejection sampling {spec['use_rejection_sampling']}, "
             f"ranks {report['options']['ranks']}, {report['seconds']} s)"]
    for check in report["checks"]:
        lines.append(f"  [{check['status']:>12}] {check['name']}: {check['summary']}")
    return "\n".join(lines)
