"""``specloop serve``: the OpenAI-compatible server (needs ``pip install 'specloop[serve]'``)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from specloop.engine._cli_common import (UsageError, add_engine_arguments, load_config,
                                         spawns_group, under_torchrun)

if TYPE_CHECKING:
    from specloop.engine import EngineConfig

HELP = "serve an OpenAI-compatible API (completions, chat, /metrics, /health)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="default: localhost only")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--api-key", default=os.environ.get("SPECLOOP_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $SPECLOOP_API_KEY)")
    p.add_argument("--served-model-name", help="the model id clients send (default: "
                   "model.name)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow browser requests from ORIGIN (CORS is off by default)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM, how long open streams may finish")
    p.add_argument("--core-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine core in a child process and the HTTP side here "
                   "(ProcessEngine: 1.1-2x the tokens/s from batch ~128 on an H200, ~1 %% "
                   "less at batch 1-8); with parallel.world_size N > 1, N cores it starts "
                   "as a torch.distributed group, no torchrun. Default: on for one rank on "
                   "a CUDA device and for N > 1 ranks outside torchrun, without --trace; "
                   "off otherwise")
    p.add_argument("--trace", metavar="FILE",
                   help="on shutdown, write a timeline of every iteration state and "
                   "collective on every rank (Chrome trace-event JSON, for Perfetto)")


def default_core_process(config: EngineConfig, *, traced: bool) -> bool:
    """``--core-process``'s default: the engine core in a child process where it pays and
    can run, one rank on a CUDA device without ``--trace`` (on the H200 the in-process
    engine is host-bound from batch ~128, docs/performance.md); a CPU's step is long
    enough that the front door's share of an iteration is small there, and the tests and
    the demo start faster without a child. Several ranks outside torchrun: the cores are
    the only way to start the group from one command (under torchrun each rank runs its
    engine in its own process already)."""
    if traced or under_torchrun():
        return False
    if spawns_group(config):
        return True
    from specloop.engine._runner import resolve_device  # noqa: PLC0415 - imports torch

    device: str = resolve_device(config.model.device).type
    return device == "cuda"


def run(args: argparse.Namespace) -> int:
    # The flags first, before the config (whose model check imports torch).
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port} is not a port; use 0..65535")
    if args.max_body_bytes < 1024:
        raise UsageError(f"--max-body-bytes {args.max_body_bytes} is too small; use >= 1024")
    if args.api_key == "":
        raise UsageError("--api-key is empty; give a key or leave it out")
    if args.core_process and args.trace:
        raise UsageError("--trace needs the engine in the server's process; leave out "
                         "--core-process")
    if args.core_process and under_torchrun():
        raise UsageError("--core-process starts the group's ranks itself; run it without "
                         "torchrun, or leave out --core-process under torchrun")
    config = load_config(args)
    core_process = args.core_process
    if core_process is None:
        core_process = default_core_process(config, traced=bool(args.trace))
    try:
        import anyio  # noqa: PLC0415

        from ._server import ServeOptions, bind, serve  # noqa: PLC0415
    except ImportError as exc:
        raise UsageError(f"specloop serve needs its extra: pip install 'specloop[serve]' "
                         f"({exc})") from None
    options = ServeOptions(
        host=args.host, port=args.port, api_key=args.api_key,
        served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
        cors_origins=tuple(args.cors_origin), trace=args.trace,
        shutdown_timeout_s=args.shutdown_timeout, core_process=core_process)
    # Bound before the model loads, so a busy port fails at once (rank 0 only).
    sock = bind(args.host, args.port) if int(os.environ.get("RANK", "0")) == 0 else None
    anyio.run(serve, config, options, sock)
    return 0
