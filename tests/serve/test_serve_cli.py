"""`specloop serve`'s own command-line checks: one line, before the model loads."""

from __future__ import annotations

import socket

import pytest
import structlog

from specloop.engine import cli as cli_module


@pytest.fixture
def cli(capsys):
    saved = structlog.get_config()

    def run(*argv):
        try:
            code = cli_module.main([str(a) for a in argv])
        except SystemExit as exc:
            code = exc.code
        return code, *capsys.readouterr()

    yield run
    structlog.configure(**saved)


@pytest.fixture
def poison(tmp_path):
    """A model that fails to load: errors reported against it came before loading."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{not json")
    config = tmp_path / "poison.toml"
    config.write_text(f'[model]\nname = "{model}"\ndevice = "cpu"\n')
    return config


@pytest.mark.parametrize("args, expected", [
    (["--port", "70000"], "--port 70000"),
    (["--api-key", ""], "--api-key"),
    (["--max-body-bytes", "10"], "--max-body-bytes"),
    (["--method", "mtp_eagle"], "--allow-untrained-drafter"),
])
def test_serve_usage_errors(cli, poison, args, expected):
    code, out, err = cli("serve", "--config", poison, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and expected in err, err


def test_busy_port_fails_at_once_in_one_line(cli, poison):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        code, out, err = cli("serve", "--config", poison, "--port", busy.getsockname()[1])
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Address already in use" in lines[0]
