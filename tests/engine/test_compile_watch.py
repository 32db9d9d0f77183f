"""engine/_compile_watch.py: a Triton compile while an engine serves is a
``kernel_compiled_while_serving`` warning and counts in its stats; the process's one
post-compile hook chains to the hook found, and goes back to it when the last engine
stops watching."""

import types

import pytest
from structlog.testing import capture_logs

from specloop.engine import AsyncEngine
from specloop.engine import _compile_watch as watch_mod

from .conftest import make_config

try:    # the real hook's test (GPU) compiles a kernel of its own
    import triton
    import triton.language as tl
except ImportError:     # pragma: no cover - the CPU venv has Triton (interpreted tests)
    triton = None

if triton is not None:
    @triton.jit
    def _watched_add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)


def compile_event(module="specloop.models._kernels", name="_paged_attention_kernel"):
    """What Triton passes its post-compile hook (the parts the watch reads)."""
    return {"fn": types.SimpleNamespace(module=module, name=name),
            "repr": f"{name}[num_warps=4](q: *bf16, n: i32)", "key": ("k",)}


@pytest.fixture
def knobs(monkeypatch):
    """A stand-in for ``triton.knobs.runtime`` holding a hook someone installed before."""
    seen = []
    runtime = types.SimpleNamespace(jit_post_compile_hook=lambda **kw: seen.append(kw))
    monkeypatch.setattr(watch_mod, "_runtime_knobs", lambda: runtime)
    monkeypatch.setattr(watch_mod, "_watchers", set())
    monkeypatch.setattr(watch_mod, "_previous", [])
    return runtime, seen


def test_every_watcher_hears_each_compile_and_the_hook_found_still_runs(knobs):
    runtime, seen = knobs
    before = runtime.jit_post_compile_hook
    heard_a, heard_b = [], []
    stop_a = watch_mod.watch(lambda kernel, spec: heard_a.append(kernel))
    stop_b = watch_mod.watch(lambda kernel, spec: heard_b.append(spec))
    runtime.jit_post_compile_hook(**compile_event())
    assert heard_a == ["specloop.models._kernels._paged_attention_kernel"]
    assert heard_b[0].startswith("_paged_attention_kernel[num_warps=4]")
    assert len(seen) == 1                       # the hook found before runs too
    stop_a()
    stop_a()                                    # idempotent
    runtime.jit_post_compile_hook(**compile_event(name="_skinny_kernel"))
    assert len(heard_a) == 1 and len(heard_b) == 2
    assert runtime.jit_post_compile_hook is not before      # b still watches
    stop_b()
    assert runtime.jit_post_compile_hook is before          # the last one gives it back


def test_compiles_while_an_engine_warms_up_are_reported_to_none(knobs):
    """Another engine of the process warming up compiles for itself: not a stall of the
    watching engine's serving (its biased twin: the same compile after warm-up is)."""
    runtime, seen = knobs
    heard = []
    stop = watch_mod.watch(lambda kernel, spec: heard.append(kernel))
    with watch_mod.warming():
        runtime.jit_post_compile_hook(**compile_event())
    assert heard == [] and len(seen) == 1       # the hook found still hears it
    runtime.jit_post_compile_hook(**compile_event())
    assert len(heard) == 1
    stop()


def test_a_hook_installed_after_ours_is_left_in_place(knobs):
    runtime, _ = knobs
    stop = watch_mod.watch(lambda kernel, spec: None)
    theirs = runtime.jit_post_compile_hook = lambda **kw: None    # e.g. torch's nvshmem init
    stop()
    assert runtime.jit_post_compile_hook is theirs


def test_without_triton_knobs_nothing_is_watched(monkeypatch):
    monkeypatch.setattr(watch_mod, "_runtime_knobs", lambda: None)
    stop = watch_mod.watch(lambda kernel, spec: pytest.fail("no hook to call this"))
    stop()


async def test_an_engine_warns_and_counts_a_compile_after_warm_up(knobs, tiny_dir,
                                                                  monkeypatch):
    """Once built (warm-up done), a compile is a warning event naming the kernel and
    counts in the engine's stats; closed, the engine stops watching. The biased twins: a
    compile before the engine was built, or in another engine's warm-up (each warm-up
    here compiles one), counts nowhere."""
    from specloop.engine._worker import RankWorker

    runtime, _ = knobs
    warm_up = RankWorker.warmup_graphs

    def compiling_warm_up(worker):
        warm_up(worker)
        runtime.jit_post_compile_hook(**compile_event(name="_warm_up_kernel"))
    monkeypatch.setattr(RankWorker, "warmup_graphs", compiling_warm_up)
    runtime.jit_post_compile_hook(**compile_event())    # before any engine: warm-up's
    async with AsyncEngine(make_config(tiny_dir)) as engine:
        assert engine.stats.kernels_compiled_while_serving == 0
        async with AsyncEngine(make_config(tiny_dir)):      # another's warm-up: not counted
            pass
        assert engine.stats.kernels_compiled_while_serving == 0
        with capture_logs() as logs:
            runtime.jit_post_compile_hook(**compile_event())
        assert engine.stats.kernels_compiled_while_serving == 1
        (event,) = [e for e in logs if e["event"] == "kernel_compiled_while_serving"]
        assert event["log_level"] == "warning" and event["count"] == 1
        assert event["kernel"] == "specloop.models._kernels._paged_attention_kernel"
    runtime.jit_post_compile_hook(**compile_event())
    assert engine.stats.kernels_compiled_while_serving == 1
    assert not watch_mod._watchers


def test_generate_summary_says_how_many_kernels_compiled_while_serving(tiny_dir):
    """`specloop generate`'s summary line names the compiles (each a stall of the whole
    batch) where any came, and says nothing of them where none did."""
    from specloop.engine._cli_generate import Progress, summary_line
    from specloop.engine._stats import EngineStats

    config = make_config(tiny_dir)
    stats = EngineStats()
    quiet = summary_line(Progress(completions=[], stats=stats), config, False)
    assert "compiled" not in quiet
    stats.kernels_compiled_while_serving = 2
    line = summary_line(Progress(completions=[], stats=stats), config, False)
    assert ", 2 kernel(s) compiled while serving" in line


@pytest.mark.gpu
def test_the_real_triton_hook_reports_a_compile():
    """On CUDA, Triton itself calls the watch's hook with what it reads (the kernel's
    module and name, its specialisation): a first launch of a kernel in this process is
    heard; a second launch of the same specialisation compiles nothing and is not. (The
    fakes above stand in for the hook's arguments; bench/probe_compiles_gpu.py's
    `engine_counted` reads 0 where nothing compiles, which a dead hook would read too.)"""
    import torch
    heard = []
    stop = watch_mod.watch(lambda kernel, spec: heard.append((kernel, spec)))
    try:
        x = torch.zeros(8, device="cuda")
        _watched_add_one[(1,)](x, 8, BLOCK=8)
        first = list(heard)
        _watched_add_one[(1,)](x, 8, BLOCK=8)
        torch.cuda.synchronize()
    finally:
        stop()
    assert torch.equal(x.cpu(), torch.full((8,), 2.0))
    assert [k for k, _ in first] == [f"{__name__}._watched_add_one"], first
    assert "_watched_add_one" in first[0][1]
    assert heard == first
