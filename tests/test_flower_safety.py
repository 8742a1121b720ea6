"""`feddomain flower run` is safe by default (issue 17, item 1): it submits only to a federation
the user named, never lets `flwr run` start Flower's local runtime (which installs the App's
dependencies into ~/.flwr and leaves a SuperLink and Ray behind), refuses a used --out before
submitting, and leaves no process behind when interrupted."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from feddomain.cli import main
from feddomain.federation.flower import commands
from tests.resume_helpers import default_sigint

PROJECT = Path(__file__).resolve().parents[1]
DEMO = str(PROJECT / "configs" / "demo.yaml")


@pytest.fixture
def launched(monkeypatch, tmp_path):
    """Records every process the command would start (none is started) and gives it a fresh
    home without FLWR_HOME, as on a new user's machine."""
    calls: list[list[str]] = []

    def record(cmd, *args, **kwargs):
        calls.append(cmd)
        raise AssertionError(f"started {cmd}")

    monkeypatch.setattr(commands.subprocess, "Popen", record)
    monkeypatch.setattr(commands.subprocess, "run", record)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FLWR_HOME", raising=False)
    return calls


def _flwr_home(tmp_path: Path, connection: str) -> Path:
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "x"\n\n[superlink.x]\n{connection}')
    return home


def test_without_a_named_federation_nothing_is_started_or_installed(tmp_path, capsys, launched):
    """Catches the README's `feddomain flower run CONFIG --out DIR` falling back to Flower's
    default local runtime: `uv sync` of the App into ~/.flwr and a SuperLink left running."""
    out = tmp_path / "out"
    assert main(["flower", "run", DEMO, "--out", str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "no federation named" in err and "feddomain flower local" in err
    assert launched == [] and not out.exists()
    assert not (tmp_path / "home" / ".flwr").exists()


def test_a_connection_without_an_address_is_refused(tmp_path, capsys, launched):
    """Catches a Flower config whose connection is Flower's local simulation (no address):
    `flwr run` would start that runtime and install packages."""
    home = _flwr_home(tmp_path, "options.num-supernodes = 10\n")
    argv = ["flower", "run", DEMO, "--out", str(tmp_path / "out"), "--flwr-home", str(home)]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "connection 'x'" in err and "has no address" in err and launched == []


def test_a_used_out_is_refused_before_anything_is_submitted(tmp_path, capsys, launched):
    """Catches a run submitted (and its ServerApp failing on the SuperLink) for an --out that
    already holds results, instead of a refusal here."""
    home = _flwr_home(tmp_path, 'address = "127.0.0.1:9"\ninsecure = true\n')
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    assert main(["flower", "run", DEMO, "--out", str(out), "--flwr-home", str(home)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "already holds files" in err and f"--resume {out}" in err and launched == []


def test_resume_takes_the_run_directory_as_run_does(tmp_path, capsys, launched):
    """Catches `flower run --resume` needing another syntax than `run --resume DIR`."""
    assert main(["flower", "run", "--resume", str(tmp_path / "r"), DEMO]) == 2
    assert "omit CONFIG" in capsys.readouterr().err
    assert main(["flower", "run", "--resume", str(tmp_path / "r")]) == 2  # reaches the check
    assert "no federation named" in capsys.readouterr().err


def _children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _flwr_children(pid: int) -> list[int]:
    """Children of ``pid`` that run ``flwr``."""
    found = []
    for child in _children(pid):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(Path(arg.decode(errors="replace")).name == "flwr" for arg in argv[:2]):
            found.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_flower_run_leaves_no_process_behind(tmp_path, sig):
    """Catches `flwr run` (the process `feddomain flower run` starts) surviving a Ctrl-C or a
    `kill` of the command. The SuperLink here is a socket that accepts and never answers, so
    `flwr run` is still waiting when the signal comes."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        home = _flwr_home(tmp_path, f'address = "127.0.0.1:{silent.getsockname()[1]}"\n')
        (home / "config.toml").write_text((home / "config.toml").read_text() + "insecure = true\n")
        argv = ["flower", "run", DEMO, "rounds=1", "--out", str(tmp_path / "out")]
        proc = subprocess.Popen(
            [sys.executable, "-m", "feddomain.cli", *argv, "--flwr-home", str(home)],
            cwd=PROJECT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, "HOME": str(tmp_path / "home")},
            preexec_fn=default_sigint,
        )
        deadline = time.time() + 180
        # wait for `flwr run` itself: imports start short-lived children too (e.g. `uname`)
        while not (flwr := _flwr_children(proc.pid)) and proc.poll() is None:
            assert time.time() < deadline, "flwr run never started"
            time.sleep(0.05)
        assert flwr and proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    time.sleep(0.5)
    assert [pid for pid in flwr if _alive(pid)] == []
    assert not (tmp_path / "home" / ".flwr").exists()
