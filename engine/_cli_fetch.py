"""``specloop fetch-model``: convert a registry model into the local cache."""

from __future__ import annotations

import argparse

HELP = "convert a registry model into the local cache and print its directory"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", default="smollm2-135m-instruct")


def run(args: argparse.Namespace) -> int:
    from specloop.models import ensure_model_cached  # noqa: PLC0415
    print(ensure_model_cached(args.name))
    return 0
