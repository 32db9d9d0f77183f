"""The command line as a user meets it, through real subprocesses: one-line errors, exit
codes (2 usage/config, 1 runtime, 130 Ctrl-C), checks before the model loads, the flags."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def specloop(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specloop.engine.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=ENV)


def write_config(path: Path, model, extra: str = "", method: str = "ngram") -> Path:
    path.write_text(f'[model]\nname = "{model}"\ndevice = "cpu"\nmax_seq_len = 256\n'
                    f'chat_template = false\n{extra}\n[speculative]\nmethod = "{method}"\n')
    return path


@pytest.fixture(scope="module")
def poison(tmp_path_factory):
    """A model directory that fails to load: any error reported against it was found
    before the model was loaded."""
    root = tmp_path_factory.mktemp("poison")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text("{not json")
    return write_config(root / "poison.toml", model)


USAGE_CASES = {
    "missing config": (["--config", "/nonexistent/x.toml"], "not found"),
    "typo key": (["--config", "{typo}"], "nmae"),
    "gate": (["--config", "{gate}"], "parallel.lm_head_tp_in_adp"),
    "bad temperature": (["--temperature", "-1"], "temperature"),
    "max tokens 0": (["--max-tokens", "0"], "max_tokens"),
    "empty prompt": (["--prompt", " "], "--prompt is empty"),
    "unknown flag": (["--bogus"], "unrecognized arguments: --bogus"),
    "log level": (["--log-level", "verbose"], "invalid choice: 'verbose'"),
    "untrained drafter": (["--method", "mtp_eagle"], "--allow-untrained-drafter"),
    "untrained eagle3": (["--method", "eagle3"], "--allow-untrained-drafter"),
    "missing head": (["--method", "eagle3", "--draft-weights", "no-such-head"],
                     "shipped heads: smollm2-135m-instruct-eagle, smollm2-135m-instruct-eagle3"),
    "missing draft model": (["--draft-model", "/nonexistent/draft"], "speculative.draft_model"),
    "bad method": (["--method", "magic"], "speculative.method"),
    "empty stop": (["--stop", ""], "SamplingParams.stop"),
    "system without template": (["--system", "be brief", "--no-chat-template"], "--system"),
    "trace on spawned ranks": (["--config", "{group}", "--trace", "t.json"],
                               "--trace on 2 ranks needs each rank's engine"),
}


@pytest.fixture
def cli(capsys):
    """``main(argv)`` in this process (no torch import per case): (exit code, out, err)."""
    from specloop.engine import cli as cli_module

    saved = structlog.get_config()

    def run(*argv):
        try:
            code = cli_module.main([str(a) for a in argv])
        except SystemExit as exc:
            code = exc.code
        out, err = capsys.readouterr()
        return code, out, err

    yield run
    structlog.configure(**saved)


@pytest.mark.parametrize("case", sorted(USAGE_CASES))
def test_usage_errors_are_one_line_exit_2_before_loading(cli, poison, tmp_path, case,
                                                        monkeypatch):
    typo = tmp_path / "typo.toml"
    typo.write_text('[model]\nnmae = "x"\n')
    gate = write_config(tmp_path / "gate.toml", poison.parent / "model",
                        "[parallel]\nlm_head_tp_in_adp = true\n")
    group = write_config(tmp_path / "group.toml", poison.parent / "model",
                         '[parallel]\nworld_size = 2\nattention_dp = true\n\n'
                         '[components]\ncommunicator = "torch_distributed"\n')
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args, expected = USAGE_CASES[case]
    args = [a.format(typo=typo, gate=gate, group=group) for a in args]
    if "--config" not in args:
        args = ["--config", poison, *args]
    code, out, err = cli("generate", *args)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1, err
    assert expected in lines[0]
    assert "Traceback" not in err and out == ""


# argv -> (exit code, what its one line of stderr says, or what stdout starts with).
NO_TORCH_CASES = [
    (["--help"], 0, "usage: specloop [-h] [--version] COMMAND"),
    (["generate", "--help"], 0, "usage: specloop generate [-h]"),
    (["generate", "--temperature", "-1"], 2, "SamplingParams.temperature = -1.0 is invalid"),
    (["generate", "--bogus"], 2, "unrecognized arguments: --bogus"),
    (["generate", "--config", "/nonexistent/x.toml"], 2, "'/nonexistent/x.toml': not found"),
    (["generate", "--method", "eagle3", "--draft-weights", "no-such-head"], 2,
     "neither a shipped head nor a file"),
    (["certify", "--params", "top_p=0"], 2, "SamplingParams.top_p = 0.0 is invalid"),
    (["serve", "--port", "70000"], 2, "--port 70000 is not a port"),
    (["train-draft", "--config", "/nonexistent/t.toml"], 2, "not found"),
    (["generate", "--config", "{unknown_model}"], 2, "neither a registry model nor an existing path"),
]


def test_help_and_usage_errors_import_no_torch(tmp_path):
    """In a real process (fast: it imports no torch), each case in turn: its exit code, one
    line, and torch still not imported after it (so the case that imports it is named)."""
    unknown_model = tmp_path / "unknown_model.toml"
    unknown_model.write_text('[model]\nname = "no-such-model"\n')
    code = """
import contextlib, io, json, sys
from specloop.engine.cli import main
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
    print(json.dumps([rc, out.getvalue(), err.getvalue(), "torch" in sys.modules]))
"""
    argvs = [[a.format(unknown_model=unknown_model) for a in argv]
             for argv, _, _ in NO_TORCH_CASES]
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)], capture_output=True,
                          text=True, timeout=60, env=ENV)
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(NO_TORCH_CASES)
    for (argv, expected_rc, expected), (rc, out, err, torch_loaded) in zip(NO_TORCH_CASES,
                                                                           results):
        assert rc == expected_rc, (argv, err)
        if rc == 0:
            assert out.startswith(expected) and err == "", (argv, out, err)
        else:
            assert err.count("\n") == 1 and expected in err and out == "", (argv, err)
        assert not torch_loaded, f"specloop {' '.join(argv)} imported torch"


@pytest.mark.slow  # a real process (imports torch): the in-process twin is fast
def test_runtime_failure_is_one_line_exit_1_traceback_only_in_debug(poison):
    plain = specloop("generate", "--config", poison)
    assert plain.returncode == 1
    lines = plain.stderr.strip().splitlines()
    assert len(lines) == 1 and "JSONDecodeError" in lines[0], plain.stderr
    assert "--log-level debug" in lines[0]


def test_traceback_with_debug(cli, poison):
    code, _, err = cli("generate", "--config", poison)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "JSONDecodeError" in lines[0], err
    assert "--log-level debug" in lines[0]
    code, _, err = cli("generate", "--config", poison, "--log-level", "debug")
    assert code == 1
    assert "Traceback" in err
    assert err.strip().splitlines()[-1].startswith("specloop generate: error:")


def test_version_and_help(cli):
    code, out, _ = cli("--version")
    assert code == 0 and out.startswith("specloop ")
    code, out, _ = cli("generate", "--help")
    assert code == 0
    for flag in ("--draft-model", "--stop", "--stop-token-id", "--ignore-eos", "--system",
                 "--no-chat-template", "--json", "--allow-untrained-drafter"):
        assert flag in out


@pytest.mark.slow  # a real process (imports torch): the in-process twin is fast
def test_generate_json_greedy_matches_a_second_run(cli, tiny_dir, tmp_path):
    config = write_config(tmp_path / "tiny.toml", tiny_dir)
    args = ["generate", "--config", config, "--prompt", "The quick brown fox",
            "--prompt", "A llama is", "--max-tokens", "12", "--json", "--ignore-eos"]
    first = specloop(*args)
    assert first.returncode == 0, first.stderr
    rows = [json.loads(line) for line in first.stdout.splitlines() if line.startswith("{")]
    assert [len(r["token_ids"]) for r in rows] == [12, 12]
    assert all(r["finish_reason"] == "length" for r in rows)
    assert "[specloop] new tokens 24" in first.stdout
    assert first.stderr == ""
    code, out, _ = cli(*args)
    assert code == 0 and out.splitlines()[:2] == first.stdout.splitlines()[:2]


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow  # a real process (imports torch, then generates until the SIGINT)
def test_ctrl_c_prints_partial_text_and_summary_and_exits_130(tiny_dir, tmp_path):
    config = tmp_path / "long.toml"
    config.write_text(f'[model]\nname = "{tiny_dir}"\ndevice = "cpu"\nmax_seq_len = 60000\n'
                      'chat_template = false\n[speculative]\nmethod = "none"\n')
    proc = subprocess.Popen(
        [sys.executable, "-m", "specloop.engine.cli", "generate", "--config", str(config),
         "--prompt", "hello", "--max-tokens", "50000", "--ignore-eos"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
        # As from a terminal: a suite started in the background (`make test &`, some CI
        # runners) ignores SIGINT, the child would inherit that, and Python (rightly)
        # leaves an ignored SIGINT ignored, so the Ctrl-C under test would never arrive.
        preexec_fn=_sigint_default)
    try:
        first = proc.stdout.read(1)         # generation has started
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()      # reaped here: its CPU counts here, and no ResourceWarning later
    out = first + out
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    summary = [line for line in out.splitlines() if line.startswith("[specloop] new tokens")]
    assert len(summary) == 1 and summary[0].endswith("[interrupted]")
    count = int(summary[0].split()[3].rstrip(","))
    assert 0 < count < 50000


def test_generate_stop_string(cli, tiny_dir, tmp_path):
    config = write_config(tmp_path / "tiny.toml", tiny_dir)
    base = ["generate", "--config", config, "--prompt", "A llama", "--max-tokens", "24",
            "--ignore-eos", "--json"]
    code, out, _ = cli(*base)
    full = json.loads(out.splitlines()[0])["text"]
    stop = full[5:8]
    code, out, err = cli(*base, "--stop", stop)
    row = json.loads(out.splitlines()[0])
    assert code == 0, err
    assert row["text"] == full[:full.find(stop)] and row["finish_reason"] == "stop"


def test_generate_system_message_reaches_the_prompt(cli, tiny_dir, tmp_path):
    config = tmp_path / "chat.toml"
    config.write_text(f'[model]\nname = "{tiny_dir}"\ndevice = "cpu"\nmax_seq_len = 256\n'
                      '[speculative]\nmethod = "none"\n')
    base = ["generate", "--config", config, "--prompt", "A llama", "--max-tokens", "16",
            "--ignore-eos", "--json"]
    outs = []
    for extra in ([], ["--system", "You are terse."], ["--no-chat-template"]):
        code, out, err = cli(*base, *extra)
        assert code == 0, err
        outs.append(json.loads(out.splitlines()[0])["token_ids"])
    # Each changes the prompt the model sees, so the greedy continuation changes.
    assert outs[0] != outs[1] and outs[0] != outs[2]


def test_runtime_failure_grouped_with_cancellations_is_one_line(capsys):
    # The engine's task group ends with the real error beside the cancellations of its
    # siblings; report_failure runs after the event loop ended and must name the real one.
    import asyncio

    from specloop.engine._cli_common import report_failure

    group = BaseExceptionGroup("engine", [asyncio.CancelledError(), RuntimeError("rank 1 died")])
    assert report_failure(group, "generate", debug=False) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "RuntimeError: rank 1 died" in err[0]


def test_generate_with_an_eagle3_head_by_path(cli, tiny_dir, tmp_path):
    """--method eagle3 --draft-weights FILE: the head loads and drafts (greedy output equals
    the no-speculation output; the summary line reports acceptance)."""
    import torch

    from specloop.models import load_model
    from specloop.models.drafters import Eagle3Head

    head = Eagle3Head(load_model(tiny_dir).model, dtype=torch.float32, device="cpu",
                      feature_layers=(0, 1))
    head.init_random(3)
    weights = tmp_path / "e3.safetensors"
    head.save(str(weights), {"method": "eagle3"})
    config = write_config(tmp_path / "tiny.toml", tiny_dir)
    base = ["generate", "--config", config, "--prompt", "A llama is", "--max-tokens", "10",
            "--json", "--ignore-eos"]
    code, plain, err = cli(*base, "--method", "none")
    assert code == 0, err
    code, out, err = cli(*base, "--method", "eagle3", "--draft-weights", weights)
    assert code == 0, err
    assert out.splitlines()[0] == plain.splitlines()[0]
    assert "mean acceptance length" in out
    # One share a drafted position, each in [0, 1]: K of them at a fixed K ("K 3"), at
    # most K under adaptive K ("adaptive K <= 3, ...": the largest K drafted).
    line = next(x for x in out.splitlines() if x.startswith("[specloop]"))
    per = line.split("acceptance per position ")[1].split(" (method")[0].split()
    form = re.search(r"\(method \S+, (adaptive )?K (?:<= )?(\d+)", line)
    k = int(form.group(2))
    assert (len(per) <= k if form.group(1) else len(per) == k), line
    assert per and all(0 <= float(a) <= 1 for a in per), line
    assert "acceptance per position" not in plain
