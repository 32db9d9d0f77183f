"""Which Triton kernel specialisations this process has compiled, per kernel of the
project (the GPU tests that serve after warm-up and bench/probe_compiles_gpu.py: a compile
while serving stalls the engine for ~0.5 s a kernel)."""

from __future__ import annotations

import importlib

MODULES = ("specloop.models._kernels", "specloop.models._skinny",
           "specloop.models.drafters._ngram_device", "specloop.samplers._triton_greedy",
           "specloop.samplers._triton_rejection")


def jit_functions() -> dict[str, object]:
    """{"module.name": JITFunction} of every Triton kernel in ``MODULES`` ({} without Triton)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return {}
    out = {}
    for module in MODULES:
        mod = importlib.import_module(module)
        for name, obj in vars(mod).items():
            fn = obj if isinstance(obj, JITFunction) else getattr(obj, "fn", None)
            if isinstance(fn, JITFunction):
                out[f"{module.rsplit('.', 1)[-1]}.{name}"] = fn
    return out


def compiled_variants() -> dict[str, set[str]]:
    """{kernel: the specialisation keys compiled so far, on any device}."""
    out = {}
    for name, fn in jit_functions().items():
        keys: set[str] = set()
        for cache in getattr(fn, "device_caches", {}).values():
            keys |= set(map(str, cache[0].keys()))
        out[name] = keys
    return out


def new_variants(before: dict[str, set[str]]) -> dict[str, set[str]]:
    """The kernels with keys compiled since ``before`` (``compiled_variants()``), and those."""
    now = compiled_variants()
    return {name: keys - before.get(name, set()) for name, keys in now.items()
            if keys - before.get(name, set())}
