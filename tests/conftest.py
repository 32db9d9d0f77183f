import gc
import logging
import os
import resource
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

# One torch (OpenMP) thread per test process, children included. The tests' tensors are
# small: a second thread mostly spins waiting for work, and on a loaded 2-core machine it
# made a module 5x the CPU and wall time (test_paged_cache: 21 s CPU with 2 threads, 4 s
# with 1). Parallelism comes from pytest-xdist workers instead (`make test` runs -n auto).
os.environ["OMP_NUM_THREADS"] = "1"

# The cyclic GC less often in test processes (not in the processes they start): a worker
# allocates fast (asyncio, engines, tensors) and holds a large heap (torch, transformers,
# every test module), so at the default 700 allocations it spent ~2% of its CPU collecting,
# mostly in full collections of ~150 ms each; at 20,000 about a quarter of that. No test
# depends on when cycles are freed (none waits for the collector: the engine's gc.freeze
# test counts freezes, not collections).
gc.set_threshold(20_000, *gc.get_threshold()[1:])

import pytest  # noqa: E402
import structlog  # noqa: E402

from . import interpreted  # noqa: E402
from . import smollm2 as smol  # noqa: E402

# torch is imported where tests run (pytest_configure below, the fixtures), not at this
# module's import: xdist's controller imports this file before it starts the workers, and
# torch's import (~2 s) there held every worker back that long.

# Tests that share an expensive session fixture run on one xdist worker (`--dist
# loadgroup`), so it is built once: the SmolLM2 model and its transformers reference, the
# live `specloop serve`. Tests that start several processes run one at a time on their own
# worker, so they do not oversubscribe the cores (or each other's timeouts).
SHARED_GROUPS = {
    "smollm2": {"smollm2", "smollm2_dir", "smollm2_hf", "smollm2_reference",
                "smollm2_engine_reference"},
    "serve": {"server", "core_server"},
    "plugin": {"plugin_venv", "project_wheels"},
}


@pytest.hookimpl(tryfirst=True)   # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    import torch  # noqa: PLC0415

    cuda = torch.cuda.is_available()
    grouping = config.pluginmanager.hasplugin("xdist")
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(skip_gpu)
        names = set(getattr(item, "fixturenames", ()))
        group = next((g for g, fixtures in SHARED_GROUPS.items() if names & fixtures), None)
        if group is None and "distributed" in item.keywords:
            group = "distributed"
        if group is not None and grouping:
            item.add_marker(pytest.mark.xdist_group(group))
    if getattr(config.option, "loadgroup", False):     # an xdist worker, --dist loadgroup
        _suffix_groups(items)


def _suffix_groups(items) -> None:
    """What pytest-xdist's loadgroup does to each grouped test's node id (``id@group``, the
    controller's scheduling unit), done so that pytest >= 9.2 sees it: xdist 3.8 assigns
    ``item._nodeid``, which pytest 9.2 no longer reads (the id is ``item._id``), and then
    no group stays on one worker: SmolLM2 was loaded on both, two `specloop serve`s started,
    the gloo tests ran side by side."""
    try:
        from _pytest.nodeid import NodeId  # noqa: PLC0415 (pytest >= 9.2 only)
    except ImportError:     # older pytest reads the ``_nodeid`` xdist rewrites itself
        return

    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid.rpartition("]")[2]:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


# ---- CPU seconds per test -----------------------------------------------------------------
# Wall time on a shared machine says little; CPU seconds (user + sys, of this process and
# of the children it waited for) do. Each report carries its phase's CPU seconds, so the
# totals also add up across xdist workers. `--cpu-durations=N` lists the N largest.
CPU_MARK = pytest.StashKey[float]()


def _cpu_seconds() -> float:
    own, children = (resource.getrusage(resource.RUSAGE_SELF),
                     resource.getrusage(resource.RUSAGE_CHILDREN))
    # Interpreted-Triton children are forked by a server process (tests/interpreted.py),
    # which waits for them: their CPU seconds as the server reported them.
    return (own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
            + interpreted.forked_cpu_seconds)


def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=0, metavar="N",
                     help="list the N tests that used the most CPU seconds (children "
                          "included); the total is always shown")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[CPU_MARK] = _cpu_seconds()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    now = _cpu_seconds()
    report.user_properties.append(("cpu_s", now - item.stash.get(CPU_MARK, now)))
    item.stash[CPU_MARK] = now
    return report


class CpuTally:
    """On the controller (or the only process): CPU seconds per test, summed over phases."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.by_test: dict[str, float] = {}
        self.start = time.monotonic()
        self.load_start = os.getloadavg()[0]

    def pytest_runtest_logreport(self, report):
        for key, value in report.user_properties:
            if key == "cpu_s":
                self.by_test[report.nodeid] = self.by_test.get(report.nodeid, 0.0) + value

    def pytest_terminal_summary(self, terminalreporter):
        if not self.by_test:
            return
        wall = time.monotonic() - self.start
        total = sum(self.by_test.values())
        if self.top:
            terminalreporter.write_sep("=", f"{self.top} largest CPU users (user+sys, s)")
            ranked = sorted(self.by_test.items(), key=lambda kv: -kv[1])[:self.top]
            for nodeid, seconds in ranked:
                terminalreporter.write_line(f"{seconds:8.2f}  {nodeid}")
        terminalreporter.write_line(
            f"CPU {total:.0f} s (user+sys, children included) in {len(self.by_test)} tests; "
            f"wall {wall:.0f} s; load average {self.load_start:.1f} at start, "
            f"{os.getloadavg()[0]:.1f} at end")


def pytest_configure(config):
    worker = hasattr(config, "workerinput")
    if not worker:   # an xdist worker reports to the controller
        config.pluginmanager.register(CpuTally(config.getoption("cpu_durations")),
                                      "specloop-cpu-tally")
    if worker or not getattr(config.option, "numprocesses", None):   # runs tests
        import torch  # noqa: PLC0415

        torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _quiet_structlog():
    # Tests may configure structlog (the library never does): warnings and up only, so
    # per-iteration debug events cost nothing; capture_logs tests lower it themselves.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        processors=[structlog.dev.ConsoleRenderer(colors=False)])
    yield


# The project's wheel and the example plugin's, built once per session (pip wheel of the
# project: ~4.5 s of CPU) for test_packaging and tests/plugin (one xdist group, above).
ROOT = Path(__file__).resolve().parents[1]
_BUILT = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__")


def _copy_project(dest: Path) -> Path:
    """What building specloop reads: pyproject, README and the package folders."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    for folder in {f.split("/")[0] for f in meta["tool"]["setuptools"]["package-dir"].values()}:
        shutil.copytree(ROOT / folder, dest / folder, ignore=_BUILT)
    return dest


@pytest.fixture(scope="session")
def project_wheels(tmp_path_factory) -> dict[str, Path]:
    """Distribution name -> its wheel: specloop and examples/plugin. Built from copies:
    setuptools writes build/ and *.egg-info next to the sources (a stale build/ in the
    tree could also slip into the wheel)."""
    tmp = tmp_path_factory.mktemp("wheels")
    dist = tmp / "dist"
    sources = [_copy_project(tmp / "specloop"),
               shutil.copytree(ROOT / "examples" / "plugin", tmp / "plugin", ignore=_BUILT)]
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            "--no-build-isolation", "-w", str(dist), *map(str, sources)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    wheels = {w.name.split("-")[0]: w for w in dist.glob("*.whl")}
    assert sorted(wheels) == ["specloop", "specloop_example_plugin"], wheels
    return wheels


# SmolLM2 (slow tests only): loaded and its transformers reference computed once per
# session, shared by tests/models/test_smollm2.py and tests/engine/test_smollm2_engine.py.
@pytest.fixture(scope="session")
def smollm2_dir():
    """The converted SmolLM2 checkpoint (converted once into $SPECLOOP_CACHE)."""
    smol.require_smollm2()
    from specloop.models import ensure_model_cached  # noqa: PLC0415
    return ensure_model_cached("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    import torch  # noqa: PLC0415

    from specloop.models import load_model  # noqa: PLC0415
    return load_model(smollm2_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    return smol.load_hf(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_reference_long(smollm2, smollm2_hf):
    """transformers' greedy tokens for smol.PROMPTS, smol.HEAD_TOKENS each."""
    return smol.hf_greedy(smollm2_hf, smollm2.tokenizer, n=smol.HEAD_TOKENS)


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_reference_long):
    """transformers' greedy tokens for smol.PROMPTS, smol.NEW_TOKENS each: the long
    reference's prefix (greedy decoding does not depend on how far it will run)."""
    return [ref[:smol.NEW_TOKENS] for ref in smollm2_reference_long]


def _cut_at_eos(references, eos):
    """Each reference cut after its first EOS: there the engine, whose requests do not
    ignore EOS, stops."""
    cut = []
    for ref in references:
        ends = [i for i, t in enumerate(ref) if t in eos]
        cut.append(ref[:ends[0] + 1] if ends else ref)
    return cut


@pytest.fixture(scope="session")
def smollm2_engine_reference(smollm2, smollm2_reference):
    """The transformers tokens (EOS ignored) cut after the first EOS. What every SmolLM2
    engine run of smol.NEW_TOKENS must equal."""
    return _cut_at_eos(smollm2_reference, smollm2.tokenizer.eos_token_ids)


@pytest.fixture(scope="session")
def smollm2_engine_reference_long(smollm2, smollm2_reference_long):
    """As smollm2_engine_reference, for runs of smol.HEAD_TOKENS."""
    return _cut_at_eos(smollm2_reference_long, smollm2.tokenizer.eos_token_ids)
