"""Progress bars: tqdm when installed (the ``train`` extra), else a silent stand-in."""

from __future__ import annotations

import sys


class _Silent:
    def __init__(self, **_kw) -> None:
        self.n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, *_a, **_kw) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def progress(**kw):
    try:
        from tqdm import tqdm  # noqa: PLC0415
    except ImportError:
        return _Silent(**kw)
    return tqdm(file=sys.stderr, mininterval=2.0, **kw)
