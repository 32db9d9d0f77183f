"""Triton kernels tested on the CPU: a child process runs the test's source under Triton's
interpreter (TRITON_INTERPRET must be set before Triton is first imported, which this
process may already have done).

Each child is forked from a server process (one per test process, started on first use):
the server imports torch, Triton (TRITON_INTERPRET=1) and the kernels' modules once, then
forks a fresh child for every source, which runs it as ``python -c`` would (``__main__``,
its own argv, the caller's environment) and exits. A child's monkeypatching and caches end with it; what the fork
saves is the ~2.5 s of CPU a fresh interpreter spends importing torch and Triton (there
are ~9 interpreted tests). The tests that use it share an xdist group ("interpreted"),
so one worker starts one server for all. A server is tied to the environment it started
under (PYTEST_CURRENT_TEST aside): a call under another environment starts a new one."""

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile

# The server: reads one JSON request a line (source, argv, environment, paths for the
# child's stdout and stderr), forks (the child takes the request's argv and environment),
# and answers the child's exit code and CPU seconds; exits when its stdin closes.
_SERVER = r"""
import json, os, sys, traceback
import torch, triton, numpy
import specloop.models, specloop.samplers
from specloop.models import _kernels, _linear, _skinny
from specloop.models.drafters import _eagle3, _lm_head, _ngram_device
from specloop.samplers import _sampler, _triton_greedy


def _patch_lang_once_a_launch():
    # Triton's interpreter re-patches triton.language on every call of a @triton.jit helper
    # inside a kernel (InterpretedFunction.__call__ -> _patch_lang: inspect.getmembers over
    # tl, tl.tensor, tl.math, then re-setting the same attributes); ~20% of an interpreted
    # test's time. Inside a launch (GridExecutor.__call__, which patched them itself and
    # restores them at its end) that repeat changes nothing, so it is skipped for helpers
    # whose language modules the launch already patched; anything else runs Triton's own
    # code (the kernels compute the same bits: checked against the unpatched interpreter).
    # Without these internals (another Triton), nothing is changed.
    import inspect
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return
    orig_patch = getattr(interp, "_patch_lang", None)
    orig_call = getattr(getattr(interp, "GridExecutor", None), "__call__", None)
    if orig_patch is None or orig_call is None:
        return
    state = {"launches": 0, "patched": set()}

    class Patched:         # the scope a skipped patch returns (no caller restores it)
        def restore(self):
            pass

    langs = {}      # fn -> the ids of tl, tl.core among its globals (_patch_lang's langs)

    def langs_of(fn):
        if fn not in langs:
            langs[fn] = {id(v) for v in fn.__globals__.values()
                         if inspect.ismodule(v) and (v is tl or v is tl.core)}
        return langs[fn]

    def patch_lang(fn):
        if not state["launches"]:
            return orig_patch(fn)
        fn_langs = langs_of(fn)
        if fn_langs and fn_langs <= state["patched"]:
            return Patched()
        scope = orig_patch(fn)
        state["patched"] |= fn_langs
        return scope

    def call(self, *args, **kwargs):
        outer = state["patched"]
        state["launches"] += 1
        state["patched"] = set()
        try:
            return orig_call(self, *args, **kwargs)
        finally:
            state["launches"] -= 1
            state["patched"] = outer

    interp._patch_lang = patch_lang
    interp.GridExecutor.__call__ = call


def _skip_discarded_overflow_checks():
    # The interpreter's options have sanitize_overflow on and debug off: every int32 add,
    # sub and mul is redone in int64 and compared with the type's range, and the result
    # goes to device_assert, which returns at once when debug is off (semantic.py: "if not
    # self.builder.options.debug: return"). ~40% of an interpreted kernel's time computed
    # and thrown away: with debug off it is skipped (the same bits, and no check lost);
    # with debug on (another Triton, or one that honours TRITON_DEBUG here) it stays.
    import dataclasses
    try:
        from triton.runtime import interpreter as interp
        builder = interp.interpreter_builder
        options = builder.options
    except (ImportError, AttributeError):
        return
    if not getattr(options, "debug", True) and getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


_patch_lang_once_a_launch()
_skip_discarded_overflow_checks()
answers = sys.stdout
for line in sys.stdin:
    req = json.loads(line)
    answers.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(out, 1)
            os.dup2(err, 2)
            os.close(out)
            os.close(err)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            sys.argv = ["-c", *req["args"]]
            os.environ.clear()
            os.environ.update(req["env"])
            namespace = {"__name__": "__main__", "__builtins__": __builtins__}
            try:
                exec(compile(req["source"], "<string>", "exec"), namespace)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    _, status, usage = os.wait4(pid, 0)
    answers.write(json.dumps([os.waitstatus_to_exitcode(status),
                              usage.ru_utime + usage.ru_stime]) + "\n")
    answers.flush()
"""

_server: "subprocess.Popen[str] | None" = None
_server_children_cpu = 0.0     # of the children the running server forked
# CPU seconds (user + sys) of the children forked so far: this process never waits for them
# (the server does), so tests/conftest.py adds this to its per-test CPU tally.
forked_cpu_seconds = 0.0
_server_env: dict = {}


def _stop_server() -> None:
    global _server, forked_cpu_seconds, _server_children_cpu
    if _server is not None:
        proc, _server = _server, None
        try:
            proc.stdin.close()
            proc.wait(timeout=10)
        except Exception:
            _kill(proc)
        finally:
            proc.stdout.close()     # the answers' pipe (else a ResourceWarning at exit)
        # Reaped: RUSAGE_CHILDREN now holds the server's children too (counted once).
        forked_cpu_seconds -= _server_children_cpu
        _server_children_cpu = 0.0


def _kill(proc: "subprocess.Popen[str]") -> None:
    """The server and any child it forked (its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _get_server(env: dict) -> "subprocess.Popen[str]":
    global _server, _server_env
    # PYTEST_CURRENT_TEST changes with every test (the child still gets the caller's).
    env = {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}
    if _server is not None and (_server.poll() is not None or env != _server_env):
        _stop_server()
    if _server is None:
        _server = subprocess.Popen([sys.executable, "-c", _SERVER], env=env, text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   start_new_session=True)
        _server_env = env
    return _server


def _read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()


def run_interpreted(child: str, *args: str) -> None:
    """Runs ``child`` (Python source that prints "ok" last when all its checks passed) with
    ``args`` as its argv and TRITON_INTERPRET=1, in a process of its own (forked from the
    server); fails with the child's stderr otherwise."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    server = _get_server(env)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"stdout": os.path.join(tmp, "stdout"), "stderr": os.path.join(tmp, "stderr")}
        server.stdin.write(json.dumps({"source": child, "args": list(args), "env": env,
                                       **paths}) + "\n")
        server.stdin.flush()
        ready, _, _ = select.select([server.stdout], [], [], 300)
        answer = server.stdout.readline() if ready else ""
        if not answer:                  # timed out, or the server died: start afresh
            _kill(server)
            _stop_server()
        stdout, stderr = (_read(paths[k]) for k in ("stdout", "stderr"))
    global forked_cpu_seconds, _server_children_cpu
    returncode, cpu = json.loads(answer) if answer else (None, 0.0)
    forked_cpu_seconds += cpu
    _server_children_cpu += cpu
    assert returncode == 0 and stdout.strip().endswith("ok"), \
        f"exit {returncode}{'' if ready else ' (timed out after 300 s)'}\n" + stderr[-3000:]


atexit.register(_stop_server)
