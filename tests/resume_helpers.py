"""The SIGKILL-then-resume harness every resume test shares: a real `feddomain run` process is
killed once a checkpoint exists, and the resumed run must equal an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from feddomain.cli import main


def default_sigint() -> None:
    """``preexec_fn`` for a child that must see Ctrl-C: a shell started in the background (a
    CI runner's ``&``, ``nohup``) ignores SIGINT, the child inherits that, and Python then
    leaves it ignored, so a test sending SIGINT would wait for a run that never stops."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def run_to_end(config: Path, out: Path) -> None:
    """The uninterrupted reference run (in-process: one interpreter start saved)."""
    assert main(["run", str(config), "--out", str(out), "--quiet"]) == 0


PROJECT = Path(__file__).resolve().parents[1]
FEDDOMAIN = [sys.executable, "-m", "feddomain.cli"]


def kill_after_checkpoint(
    config: Path,
    out: Path,
    min_round: int = 1,
    timeout: float = 120,
    launcher: list[str] = FEDDOMAIN,
) -> dict[str, Any]:
    """Run `feddomain run CONFIG --out OUT` as a process (``launcher``: how to start the CLI,
    e.g. with a test-defined method registered first) and SIGKILL it as soon as a checkpoint of
    round >= ``min_round`` exists; assert it died by the signal before finishing; return the
    checkpoint it left."""
    proc = subprocess.Popen(
        [*launcher, "run", str(config), "--out", str(out), "--quiet"],
        cwd=PROJECT,  # imports this checkout's feddomain and tests
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    ckpt = out / "checkpoint.pt"
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        if ckpt.exists() and torch.load(ckpt, weights_only=False)["round"] >= min_round:
            break
        time.sleep(0.005)
    assert ckpt.exists(), "no checkpoint appeared before the run ended"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL  # it really died by SIGKILL, mid-run
    assert not (out / "summary.json").exists()
    return torch.load(ckpt, weights_only=False)


def resume(out: Path) -> None:
    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    assert not (out / "checkpoint.pt").exists()


def summary_of(run_dir: Path) -> dict[str, Any]:
    """summary.json without the wall time and its phases (which a resumed run cannot share)."""
    s = json.loads((run_dir / "summary.json").read_text())
    s.pop("wall_time_s"), s.pop("phase_seconds")
    return s


def metrics_of(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl without the phase times."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k != "time"} for x in lines]


def assert_resumed_equals(resumed: Path, reference: Path) -> None:
    assert summary_of(resumed) == summary_of(reference)
    assert metrics_of(resumed) == metrics_of(reference)


def station_resume_config(name: str, algorithm: dict, rounds: int, eval_every: int) -> dict:
    """A small hierarchical run (4 clients in 2 stations, 2 station rounds a global round,
    checkpoints every round) for the SIGKILL-and-resume tests of the hierarchical methods."""
    return {
        "name": f"resume-{name}",
        "seed": 3,
        "rounds": rounds,
        "dataset": {"name": "digits_embedded", "resolution": 16},
        "split": {"scheme": "lodo", "targets": ["grey"]},
        "partition": {"n_clients": 4, "d": 1},
        "topology": {"stations": 2, "station_rounds": 2},
        "model": {"name": "lenet5"},
        "train": {"batch_size": 64, "optimizer": "sgd", "lr": 0.05},
        "eval": {"every": eval_every},
        "checkpoint": {"every": 1},
        "threads": 1,
        "algorithm": algorithm,
    }
