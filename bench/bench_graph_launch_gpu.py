"""What launching a captured CUDA graph costs the host, by how the graph was instantiated.

``bench_host_ops_gpu.py`` once put ``CUDAGraph.replay()`` at ~1.1 µs a kernel on the lent
H200's host (a graph of 200 kernels 220 µs), which would make a chained step's replays
host time the GPU waits for where the step is host-bound. It timed 100 launches in a row
behind ~1 ms of queued work, so the launch queue filled and the median was the GPU's time
for the graph. Here each group of launches starts behind ~1 ms of work on an idle GPU,
and the launch alone is timed, for graphs like the engine's (CUDA 12.6 made repeat
launches constant-time; this also checks whether another instantiation does better):

- ``torch``: elementwise torch ops (as bench_host_ops_gpu.py);
- ``pdl``: a chain of Triton kernels launched with Programmatic Dependent Launch (each a
  programmatic edge, as the model's kernels);
- ``copies``: torch ops with a device-to-device copy every 10 kernels (memcpy nodes, as
  the chained step's glue).

and for each graph these launches, every one timed alone with ~1 ms of GPU work queued
ahead (median µs a launch over ``--calls``, ``--rounds`` rounds):

- ``replay``: ``torch.cuda.CUDAGraph.replay()`` (torch instantiates with
  AUTO_FREE_ON_LAUNCH);
- ``driver``: ``cuGraphLaunch`` of torch's own executable graph through ctypes (the
  driver's cost without torch's wrapper);
- ``flags=F``: the captured graph instantiated again by ``cuGraphInstantiateWithFlags``
  with flags F (0: none; 1: AUTO_FREE_ON_LAUNCH; 8: USE_NODE_PRIORITY), uploaded
  (``cuGraphUpload``), launched by ``cuGraphLaunch``.

Also each graph's device time (CUDA events around 20 back-to-back launches) and whether
every launch form computes the same result. On the H200 (2026-12-04, driver 580,
``bench/results/h200_1204k_graph_launch.txt``): 2.3-4.5 µs a ``replay()`` and 1.6-3.0 a
``cuGraphLaunch`` at 50 and 200 kernels alike, for every kind and instantiation: the
launch is constant-time, and torch's wrapper adds ~0.8 µs.

    python bench/bench_graph_launch_gpu.py [--calls 1000] [--rounds 3] [--kernels 50,200]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from typing import Callable

import torch

from specloop.samplers import _pdl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import device_seconds  # noqa: E402
from bench_host_ops_gpu import timed  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the GPU machine has Triton
    triton = None


if triton is not None:

    @triton.jit
    def _bump(x_ptr, n, GDC: tl.constexpr):
        if GDC:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        offs = tl.program_id(0) * 1024 + tl.arange(0, 1024)
        ok = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=ok) * 1.0001 + 1.0, mask=ok)


class Driver:
    """The few driver calls, through ctypes on libcuda (torch made the context current)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        for name in ("cuGraphInstantiateWithFlags", "cuGraphUpload", "cuGraphLaunch",
                     "cuGraphExecDestroy", "cuGraphGetNodes"):
            getattr(self.lib, name).restype = ctypes.c_int
        self.lib.cuGraphInstantiateWithFlags.argtypes = [
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_ulonglong]
        self.lib.cuGraphUpload.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.lib.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.lib.cuGraphExecDestroy.argtypes = [ctypes.c_void_p]
        self.lib.cuGraphGetNodes.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                             ctypes.POINTER(ctypes.c_size_t)]

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: CUresult {rc}")

    def instantiate(self, graph: int, flags: int, stream: int) -> int:
        exe = ctypes.c_void_p()
        self.check(self.lib.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph, flags),
                   f"cuGraphInstantiateWithFlags({flags})")
        self.check(self.lib.cuGraphUpload(exe, stream), "cuGraphUpload")
        return exe.value

    def nodes(self, graph: int) -> int:
        n = ctypes.c_size_t(0)
        self.check(self.lib.cuGraphGetNodes(graph, None, ctypes.byref(n)), "cuGraphGetNodes")
        return n.value

    def launcher(self, exe: int, stream: int) -> Callable[[], None]:
        launch, e, s = self.lib.cuGraphLaunch, ctypes.c_void_p(exe), ctypes.c_void_p(stream)
        return lambda: launch(e, s)


def build(kind: str, kernels: int, stream: torch.cuda.Stream):
    """-> (a kept, instantiated torch graph of ``kernels`` kernels of ``kind``, its output
    tensor, a function that resets the input)."""
    x = torch.zeros(32 * 576, device="cuda")
    y = torch.zeros_like(x)
    pdl = _pdl.ON if _pdl.device_supports(0) else _pdl.OFF

    def body() -> None:
        for i in range(kernels):
            if kind == "pdl":
                _bump[(triton.cdiv(x.numel(), 1024),)](x, x.numel(), **pdl)
            elif kind == "copies" and i % 10 == 9:
                y.copy_(x)
                x.copy_(y)
            else:
                x.mul_(1.0001).add_(1.0) if kind == "torch2" else x.mul_(1.0001)

    with torch.cuda.stream(stream):
        body()                                  # compile and warm up off the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(g, stream=stream):
            body()
        g.instantiate()
    torch.cuda.synchronize()
    return g, x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernels", default="50,200")
    ap.add_argument("--kinds", default="torch,pdl,copies")
    args = ap.parse_args()
    drv = Driver()
    big = torch.randn(4096, 4096, device="cuda")

    def work() -> None:
        for _ in range(4):
            torch.mm(big, big)      # ~1 ms queued ahead

    stream = torch.cuda.Stream()
    with torch.inference_mode(), torch.cuda.stream(stream):
        sid = stream.cuda_stream
        for kind in args.kinds.split(","):
            for n in map(int, args.kernels.split(",")):
                g, x = build(kind, n, stream)
                raw = g.raw_cuda_graph()
                forms: dict[str, Callable[[], object]] = {
                    "replay": g.replay,
                    "driver": drv.launcher(g.raw_cuda_graph_exec(), sid),
                }
                for flags in (0, 1, 8):
                    forms[f"flags={flags}"] = drv.launcher(drv.instantiate(raw, flags, sid),
                                                           sid)
                # The same result from every form: x after 3 launches from zero.
                results = {}
                for name, fn in forms.items():
                    x.zero_()
                    for _ in range(3):
                        fn()
                    torch.cuda.synchronize()
                    results[name] = x.clone()
                same = all(torch.equal(results["replay"], r) for r in results.values())
                found: dict[str, list[float]] = {name: [] for name in forms}
                for _ in range(args.rounds):
                    for name, fn in forms.items():
                        found[name].append(timed(fn, args.calls, work, every=50))
                line = "  ".join(f"{name} {min(us):6.1f}-{max(us):6.1f}"
                                 for name, us in found.items())
                dev = "  ".join(f"{name} {device_seconds(fn, 20) * 1e6:6.1f}"
                                for name, fn in forms.items())
                print(f"{kind:7s} {n:4d} kernels ({drv.nodes(raw)} nodes), host us a launch: "
                      f"{line}; same result: {same}")
                print(f"{'':7s} device us a launch (20 back to back): {dev}", flush=True)


if __name__ == "__main__":
    main()
