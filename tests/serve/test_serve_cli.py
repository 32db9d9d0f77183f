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


def test_core_process_defaults_to_the_gpu_and_to_groups_outside_torchrun(monkeypatch):
    """``--core-process`` left out: on for one rank on a CUDA device without --trace (where
    the in-process engine is host-bound at a server's batch sizes), off on the CPU and
    under --trace; on for a group outside torchrun (ProcessEngine starts its ranks), off
    under torchrun (each rank is a process already)."""
    import attrs

    from specloop.engine import EngineConfig
    from specloop.serve._cli import default_core_process

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cpu = EngineConfig.from_dict({"model": {"name": "tiny", "device": "cpu"}})
    gpu = attrs.evolve(cpu, model=attrs.evolve(cpu.model, device="cuda"))
    assert default_core_process(gpu, traced=False)
    assert not default_core_process(cpu, traced=False)
    assert not default_core_process(gpu, traced=True)
    group = attrs.evolve(gpu, parallel=attrs.evolve(gpu.parallel, world_size=2,
                                                    attention_dp=True))
    assert default_core_process(group, traced=False)      # it starts the ranks
    assert default_core_process(attrs.evolve(group, model=cpu.model), traced=False)
    assert not default_core_process(group, traced=True)
    monkeypatch.setenv("WORLD_SIZE", "2")     # torchrun's, before the config knows it
    assert not default_core_process(gpu, traced=False)
    assert not default_core_process(group, traced=False)  # torchrun started them


def test_core_process_under_torchrun_is_a_usage_error(cli, poison, monkeypatch):
    """Each torchrun rank would start a group of its own: refused, in one line."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, out, err = cli("serve", "--config", poison, "--core-process")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--core-process starts the group's ranks itself" in err
