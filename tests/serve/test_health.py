"""/health answers while the engine runs and fails once it has died; requests then get 503
(the server itself stays up so a supervisor can see it). /metrics reads the engine's
counters at each scrape."""

from __future__ import annotations

import anyio
import httpx
import pytest

from specloop.engine import EngineConfig
from specloop.models.drafters import Drafter
from specloop.serve import ServeOptions, serve
from specloop.serve._server import bind


class ExplodingDrafter(Drafter):
    """A drafter whose first proposal fails: the engine loop dies mid-request."""

    point_mass = True

    def __init__(self, config, deps) -> None:
        self.num_draft_tokens = config.speculative.num_draft_tokens

    def prefill(self, slot, token_ids, hidden) -> None:
        pass

    async def propose(self, ctx):
        raise RuntimeError("drafter exploded")

    def release(self, slot) -> None:
        pass


async def test_health_fails_once_the_engine_died(serve_model):
    config = EngineConfig.from_dict({
        "model": {"name": str(serve_model), "device": "cpu", "max_seq_len": 128},
        "speculative": {"method": "ngram", "num_draft_tokens": 2},
        "components": {"drafter": "tests.serve.test_health:ExplodingDrafter"}})
    sock = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with sock:   # serve() leaves the socket it was given open (a ResourceWarning here)
        await _health_after_the_engine_died(config, sock, url)


async def _health_after_the_engine_died(config, sock, url):
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve, config, ServeOptions(shutdown_timeout_s=1), sock)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            with anyio.fail_after(60):
                while True:
                    try:
                        if (await http.get("/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await anyio.sleep(0.05)
            body = {"prompt": "hello", "max_tokens": 4}
            failed = await http.post("/v1/completions", json=body)
            assert failed.status_code in (500, 503), failed.text
            health = await http.get("/health")
            assert health.status_code == 503
            assert "drafter exploded" in health.json()["error"]
            again = await http.post("/v1/completions", json=body)
            assert again.status_code == 503
            assert again.json()["error"]["type"] == "server_error"
        tg.cancel_scope.cancel()


class SlowDrafter(ExplodingDrafter):
    """Built in the engine's build thread: holds the start-up for a while."""

    def __init__(self, config, deps) -> None:
        super().__init__(config, deps)
        import time
        time.sleep(2.0)


async def test_ctrl_c_while_the_model_loads_stops_serve(serve_model):
    import os
    import signal
    import threading

    import pytest

    config = EngineConfig.from_dict({
        "model": {"name": str(serve_model), "device": "cpu", "max_seq_len": 128},
        "speculative": {"method": "ngram", "num_draft_tokens": 2},
        "components": {"drafter": "tests.serve.test_health:SlowDrafter"}})
    sock = bind("127.0.0.1", 0)

    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):       # main() turns it into exit 130
            await serve(config, ServeOptions(), sock)
    finally:
        timer.cancel()
        sock.close()


async def test_the_address_is_announced_once_it_accepts_connections(monkeypatch, capsys):
    """serve's "on http://HOST:PORT" line comes once the socket listens: a client that
    connects on reading it is queued, not refused (uvicorn's serve, stubbed here, listens
    only later; a test that connected at once was refused)."""
    import socket

    from specloop.serve import _server
    from specloop.serve._app import ServerState
    from specloop.serve._metrics import ServeMetrics
    from specloop.serve._spec import SpecTracker

    connected = []

    async def serve_stub(self, sockets):
        host, port = sockets[0].getsockname()[:2]
        assert " on http://" in capsys.readouterr().out
        with socket.create_connection((host, port), timeout=5):
            connected.append(port)
    monkeypatch.setattr(_server._Server, "serve", serve_stub)
    state = ServerState(engine=None, model_name="m", metrics=ServeMetrics(num_draft_tokens=2),
                        spec=SpecTracker(2))
    with bind("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        await _server._serve_http(state, ServeOptions(), sock)
    assert connected == [port]


@pytest.mark.parametrize("kind", ["in-process", "core-process"])
async def test_metrics_count_the_kernels_the_engine_compiled_while_serving(kind):
    """/metrics reads the engine's compile count at each scrape (a ProcessEngine's fetched
    from its core) into `specloop:kernels_compiled_while_serving_total`, which only grows;
    an engine whose core has gone still gets its scrape answered."""
    import copy
    import types

    from specloop.engine import EngineClosedError, EngineStats
    from specloop.serve._app import ServerState, build_app
    from specloop.serve._metrics import ServeMetrics
    from specloop.serve._spec import SpecTracker

    stats, gone = EngineStats(), [False]

    async def fetch_stats():
        if gone[0]:
            raise EngineClosedError("the engine core closed before it sent its stats")
        return stats
    async def copied():     # AsyncEngine.fetch_stats: a copy of its live counters
        return copy.deepcopy(stats)
    engine = types.SimpleNamespace(fetch_stats=copied if kind == "in-process" else fetch_stats)
    state = ServerState(engine=engine, model_name="m", metrics=ServeMetrics(num_draft_tokens=2),
                        spec=SpecTracker(2))
    name = "specloop:kernels_compiled_while_serving_total"

    async def scrape() -> float:
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            response = await client.get("/metrics")
        assert response.status_code == 200
        (line,) = [x for x in response.text.splitlines() if x.startswith(name + " ")]
        return float(line.split()[1])

    assert await scrape() == 0.0
    stats.kernels_compiled_while_serving = 2
    assert await scrape() == 2.0
    stats.kernels_compiled_while_serving = 5
    assert await scrape() == 5.0 and await scrape() == 5.0      # counted once
    if kind == "core-process":
        gone[0] = True
        assert await scrape() == 5.0
