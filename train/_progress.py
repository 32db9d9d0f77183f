"""Progress bars: tqdm when installed (the ``train`` extra), else a silent stand-in."""

from __future__ import annotations

import sys
from typing import Any, Protocol


class Progress(Protocol):
    """What the pipeline uses of a progress bar (tqdm's names)."""

    n: int

    def update(self, n: int = 1) -> object: ...

    def set_postfix(self, *args: Any, **kwargs: Any) -> None: ...

    def __enter__(self) -> Progress: ...

    def __exit__(self, *exc: object) -> None: ...


class _Silent:
    def __init__(self, **_kw: object) -> None:
        self.n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, *_a: Any, **_kw: Any) -> None:
        pass

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def progress(**kw: Any) -> Progress:
    try:
        from tqdm import tqdm  # noqa: PLC0415
    except ImportError:
        return _Silent(**kw)
    bar: Progress = tqdm(file=sys.stderr, mininterval=2.0, **kw)
    return bar
