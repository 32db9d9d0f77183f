"""Triton kernels compiled while an engine serves.

Warm-up compiles every kernel specialisation the engine's captured graphs and eager paths
use; a shape it did not foresee (a new row count on an eager path, a prompt length past
the prefill graphs) compiles on first use, and that compile (or the load of a kernel from
Triton's disk cache) holds the GIL for ~0.1-0.5 s: every request in flight stalls, and
nothing in the iteration's own events says why. So, once warm-up is done, each engine
watches Triton's post-compile hook (``triton.knobs.runtime.jit_post_compile_hook``, the
hook vLLM's "JIT compilation" warning reads too): each compile is a
``kernel_compiled_while_serving`` warning event (the kernel, its specialisation) and
counts in ``EngineStats.kernels_compiled_while_serving``.

The hook is one per process: a module-level function, installed at the first watch and
given back at the last unwatch, that calls the hook installed before it (if any), then
every watching engine's callback — except while an engine of the process warms up
(``warming``): its compiles are warm-up's, not a stall of the others' serving (a bench
builds several engines in one process, one after the other). A Triton without ``knobs``
(before 3.4) watches nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

# Each watching engine's callback, given (the kernel's "module.name", its specialisation).
_watchers: set[Callable[[str, str], None]] = set()
_previous: list[Any] = []       # [the hook found at install] while installed
_warming = [0]                  # engines of this process warming up now


def _runtime_knobs() -> Any | None:
    try:
        from triton import knobs  # noqa: PLC0415 - optional, and slow to import
    except ImportError:
        return None
    return getattr(knobs, "runtime", None)


def _hook(**kwargs: Any) -> Any:
    previous = _previous[0] if _previous else None
    result = previous(**kwargs) if previous is not None else None
    if _warming[0]:
        return result
    info = kwargs.get("fn")
    kernel = f"{getattr(info, 'module', '?')}.{getattr(info, 'name', '?')}"
    specialisation = str(kwargs.get("repr", ""))
    for callback in list(_watchers):
        callback(kernel, specialisation)
    return result


def watch(callback: Callable[[str, str], None]) -> Callable[[], None]:
    """Call ``callback(kernel, specialisation)`` at each Triton compile from now on; ->
    the function that stops it (idempotent)."""
    runtime = _runtime_knobs()
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return lambda: None
    if runtime.jit_post_compile_hook is not _hook:
        _previous[:] = [runtime.jit_post_compile_hook]
        runtime.jit_post_compile_hook = _hook
    _watchers.add(callback)

    def unwatch() -> None:
        if callback not in _watchers:
            return
        _watchers.discard(callback)
        if _watchers:
            return
        # The last watcher gone: give back the hook found, unless another took it since.
        if runtime.jit_post_compile_hook is _hook:
            runtime.jit_post_compile_hook = _previous[0] if _previous else None
        _previous.clear()
    return unwatch


@contextlib.contextmanager
def warming() -> Iterator[None]:
    """While an engine warms up: compiles are warm-up's, reported to no watcher."""
    _warming[0] += 1
    try:
        yield
    finally:
        _warming[0] -= 1
