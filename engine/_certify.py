"""``specloop certify``: an exactness certificate for one engine configuration.

Runs the configured engine (drafter, K, verification, ranks, graphs) through its public
API and checks: the distribution of sampled tokens per position (chi-square against the
target's own distribution, with a wrong-temperature control that must fail), greedy ==
no-speculation greedy, and invariance of seeded outputs to batch composition, KV-slot
reuse, 1-token prompts, rank placement, graph replay and warm-up. docs/exactness.md.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Sequence

import anyio
import attrs
import torch

from specloop.models import LoadedModel
from specloop.samplers import SamplingParams

from ._certify_checks import (FAIL, INCONCLUSIVE, PASS, SKIPPED, CheckResult,
                              distribution_check, distribution_rows, worst)
from ._certify_invariance import run_invariance
from ._certify_run import Job, generate_all, on_engine, with_ranks
from ._config import EngineConfig
from ._errors import ConfigError

DEFAULT_PARAMS = ("temperature=1.0", "temperature=0.7,top_p=0.9")
CHECKS = ("distribution", "greedy", "invariance")
# A certificate where every check was skipped tested nothing: not a pass.
EXIT = {PASS: 0, FAIL: 1, INCONCLUSIVE: 3, SKIPPED: 3}


@attrs.frozen
class CertifyOptions:
    ranks: tuple[int, ...] = (1, 2)
    trials: int = 800                 # samples per (prompt, params) for the distribution
    positions: int = 3                # generated positions tested per sample
    params: tuple[str, ...] = DEFAULT_PARAMS
    control_ratio: float = 1.5        # the control's wrong temperature = T * ratio
    probe_tokens: int = 8             # tokens per invariance / greedy probe
    checks: tuple[str, ...] = CHECKS
    timeout_s: float = 60.0           # a collective waiting longer fails the run


DEFAULTS = CertifyOptions()


def parse_params(text: str) -> SamplingParams:
    """"temperature=0.7,top_p=0.9" -> SamplingParams (validated by its own checks)."""
    fields: dict[str, Any] = {}     # SamplingParams checks each value
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name.strip() not in ("temperature", "top_k", "top_p", "min_p"):
            raise ConfigError("--params", text, f"cannot read {item!r}",
                              "use name=value pairs of temperature, top_k, top_p, min_p")
        caster = int if name.strip() == "top_k" else float
        try:
            fields[name.strip()] = caster(value)
        except ValueError:
            raise ConfigError("--params", text, f"{name.strip()} = {value!r} is not a number"
                              ) from None
    return SamplingParams(**fields)


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


HELP = "an exactness certificate for a configuration (exit 0 only when every check passes)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ._cli_common import add_engine_arguments  # noqa: PLC0415

    add_engine_arguments(p)
    p.add_argument("--ranks", help="rank counts to run, e.g. 1,2,3; the first is the "
                   "reference, the others are compared with it (default: 1 and the "
                   "config's parallel.world_size, or 1,2 when that is 1)")
    p.add_argument("--trials", type=int, default=DEFAULTS.trials,
                   help="samples per prompt and params for the distribution check")
    p.add_argument("--positions", type=int, default=DEFAULTS.positions,
                   help="generated positions tested per sample")
    p.add_argument("--params", action="append", metavar="NAME=VALUE,...",
                   help='sampling params, e.g. "temperature=0.7,top_p=0.9" (repeatable; '
                   f'default {" and ".join(DEFAULT_PARAMS)})')
    p.add_argument("--control-ratio", type=float, default=DEFAULTS.control_ratio,
                   help="the power control's wrong temperature is T times this")
    p.add_argument("--checks", default=",".join(CHECKS), help="a subset of " + ",".join(CHECKS))
    p.add_argument("--json", metavar="FILE", help="write the full report here")


def options_from_args(args: argparse.Namespace, config: EngineConfig) -> CertifyOptions:
    from ._cli_common import UsageError  # noqa: PLC0415

    world = config.parallel.world_size
    text = args.ranks or (f"1,{world}" if world > 1 else "1,2")
    try:
        ranks = tuple(int(r) for r in text.split(","))
    except ValueError:
        raise UsageError(f"--ranks {text!r}: not a list of integers (e.g. 1,2)") from None
    checks = tuple(c for c in args.checks.split(",") if c)
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        raise UsageError(f"--checks: unknown {', '.join(unknown)}; use {', '.join(CHECKS)}")
    if not ranks or min(ranks) < 1 or args.trials < 1 or args.positions < 1:
        raise UsageError("--ranks, --trials and --positions must be >= 1")
    if not args.control_ratio > 0 or args.control_ratio == 1:
        raise UsageError("--control-ratio must be > 0 and not 1 (the control's T differs)")
    params = tuple(args.params or DEFAULT_PARAMS)
    for text in params:
        parse_params(text)
    return CertifyOptions(ranks=ranks, trials=args.trials, positions=args.positions,
                          params=params, control_ratio=args.control_ratio, checks=checks)


def run(args: argparse.Namespace, *, model: LoadedModel | None = None) -> int:
    """Exit code: 0 every check that ran passed, 1 a check failed, 3 inconclusive or
    nothing tested (the CLI's usage and config errors are 2)."""
    from ._cli_common import load_config  # noqa: PLC0415

    # Exactness does not need a trained drafter: certify any configured one.
    args.allow_untrained_drafter = True
    config = load_config(args)
    opts = options_from_args(args, config)
    report = anyio.run(lambda: certify(config, opts, model=model))
    print(render(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return EXIT[report["verdict"]]


def main(argv: list[str] | None = None, *, model: LoadedModel | None = None) -> int:
    """``specloop certify ...`` without the CLI's dispatch (tests pass a loaded model)."""
    from ._cli_common import OneLineParser, report_failure  # noqa: PLC0415

    p = OneLineParser(prog="specloop certify", description=HELP)
    add_arguments(p)
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    try:
        return run(args, model=model)
    except Exception as exc:  # noqa: BLE001 - one line, like the CLI
        return report_failure(exc, "certify", debug=args.log_level == "debug")
