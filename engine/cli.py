"""``specloop`` command line: one subcommand per module, dispatched from ``COMMANDS``.

A command module has ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``
and keeps its heavy imports inside ``run``. Errors come out as one line: exit 2 for usage and
config errors, 1 for runtime failures, 130 on Ctrl-C; the traceback only with
``--log-level debug``. The CLI is the only place that configures structlog.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from types import ModuleType
from importlib.metadata import PackageNotFoundError, version

from ._cli_common import EXIT_INTERRUPTED, LOG_LEVELS, OneLineParser, report_failure


def configure_logging(fmt: str, level: str) -> None:
    """The CLI's logging (the only place that configures structlog): console or JSON
    lines on stderr, filtered at ``level``."""
    import structlog  # noqa: PLC0415 - not for `specloop --help` (half its import time)

    renderer = (structlog.processors.JSONRenderer() if fmt == "json"
                else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso"), renderer],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))


# Subcommand name -> module implementing it. A new command plugs in with one line here.
COMMANDS: dict[str, str] = {
    "generate": "specloop.engine._cli_generate",
    "serve": "specloop.serve._cli",
    "fetch-model": "specloop.engine._cli_fetch",
    "certify": "specloop.engine._cli_certify",
    "train-draft": "specloop.train._cli",
}


def _version() -> str:
    try:
        return version("specloop")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _common_options() -> OneLineParser:
    common = OneLineParser(add_help=False)
    common.add_argument("--log-level", choices=LOG_LEVELS, default="warning",
                        help="debug shows every iteration_state event and full tracebacks")
    common.add_argument("--log-format", choices=("console", "json"), default="console")
    return common


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="specloop", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"specloop {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           parser_class=OneLineParser)
    common = _common_options()
    for name, module_name in COMMANDS.items():
        module = _command_module(name, module_name)
        command = sub.add_parser(name, help=module.HELP, description=module.HELP,
                                 parents=[common])
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return p


def _command_module(name: str, module_name: str) -> ModuleType | _Unavailable:
    """The module, or a stand-in that explains what is missing (e.g. an optional extra)."""
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        return _Unavailable(name, exc)


class _Unavailable:
    def __init__(self, name: str, exc: ImportError) -> None:
        self.HELP = f"(unavailable: {exc})"
        self._name, self._exc = name, exc

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("rest", nargs=argparse.REMAINDER)

    def run(self, args: argparse.Namespace) -> int:
        from ._cli_common import UsageError  # noqa: PLC0415
        raise UsageError(f"`specloop {self._name}` cannot load: {self._exc}; install the "
                         "extra it needs (e.g. pip install 'specloop[serve]')")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    configure_logging(args.log_format, args.log_level)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("\nspecloop: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BaseException as exc:  # noqa: BLE001 - every failure becomes one line
        if isinstance(exc, SystemExit):
            raise
        return report_failure(exc, args.command, debug=args.log_level == "debug")


if __name__ == "__main__":
    sys.exit(main())
