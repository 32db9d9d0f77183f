"""``specloop certify``: the command line of the exactness certificate (``_certify.py``).

Arguments are read and checked here, before ``run`` imports the checks (and torch)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

import attrs

from ._certify_options import CHECKS, DEFAULT_PARAMS, DEFAULTS, CertifyOptions, parse_params
from ._cli_common import (OneLineParser, UsageError, add_engine_arguments, load_config,
                          report_failure)

if TYPE_CHECKING:
    from specloop.models import LoadedModel

    from ._config import EngineConfig

HELP = "an exactness certificate for a configuration (exit 0 only when every check passes)"


def add_arguments(p: argparse.ArgumentParser) -> None:
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


def options_from_args(args: argparse.Namespace) -> CertifyOptions:
    """The flags, checked (before the config: no torch); without --ranks, ``ranks`` is the
    default for one configured rank, which ``run`` replaces by ``default_ranks``."""
    try:
        ranks = tuple(int(r) for r in args.ranks.split(",")) if args.ranks else (1, 2)
    except ValueError:
        raise UsageError(f"--ranks {args.ranks!r}: not a list of integers (e.g. 1,2)"
                         ) from None
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


def default_ranks(config: EngineConfig) -> tuple[int, ...]:
    """1 and the config's world size, or 1,2 when that is 1."""
    world = config.parallel.world_size
    return (1, world) if world > 1 else (1, 2)


def run(args: argparse.Namespace, *, model: LoadedModel | None = None) -> int:
    """Exit code: 0 every check that ran passed, 1 a check failed, 3 inconclusive or
    nothing tested (the CLI's usage and config errors are 2)."""
    opts = options_from_args(args)
    # Exactness does not need a trained drafter: certify any configured one.
    args.allow_untrained_drafter = True
    config = load_config(args)
    if not args.ranks:
        opts = attrs.evolve(opts, ranks=default_ranks(config))
    import anyio  # noqa: PLC0415

    from ._certify import EXIT, certify, render  # noqa: PLC0415 - imports torch

    report = anyio.run(lambda: certify(config, opts, model=model))
    print(render(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return EXIT[report["verdict"]]


def main(argv: list[str] | None = None, *, model: LoadedModel | None = None) -> int:
    """``specloop certify ...`` without the CLI's dispatch (tests pass a loaded model)."""
    p = OneLineParser(prog="specloop certify", description=HELP)
    add_arguments(p)
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    try:
        return run(args, model=model)
    except Exception as exc:  # noqa: BLE001 - one line, like the CLI
        return report_failure(exc, "certify", debug=args.log_level == "debug")
