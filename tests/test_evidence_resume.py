"""SIGKILL mid-run, then ``--resume``, for a method with per-client state (Local-only keeps each
client's model in its state): the resumed run must reproduce the uninterrupted run exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from feddomain.cli import main

ROUNDS = 8
LOCAL = {
    "name": "resume-local",
    "seed": 5,
    "rounds": ROUNDS,
    "dataset": {"name": "digits_embedded", "resolution": 16},
    "split": {"scheme": "lodo", "targets": ["grey"]},
    "partition": {"n_clients": 3, "d": 1},
    "model": {"name": "lenet5"},
    "algorithm": "local",
    "train": {"batch_size": 64, "optimizer": "adam", "lr": 0.002},
    "eval": {"every": 2},
    "checkpoint": {"every": 1},
    "threads": 1,
}


def _summary(run_dir: Path) -> dict:
    s = json.loads((run_dir / "summary.json").read_text())
    s.pop("wall_time_s")
    return s


def _metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k != "time"} for x in lines]


def test_local_only_sigkill_then_resume_matches_uninterrupted_run(tmp_path):
    """Catches per-client state (Local-only's models) lost across a SIGKILL and --resume."""
    config = tmp_path / "local.yaml"
    config.write_text(yaml.safe_dump(LOCAL))
    reference = tmp_path / "reference"
    assert main(["run", str(config), "--out", str(reference), "--quiet"]) == 0

    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "feddomain.cli", "run", str(config), "--out", str(out), "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    ckpt = out / "checkpoint.pt"
    deadline = time.time() + 120
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert ckpt.exists(), "no checkpoint appeared before the run ended"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL  # it really died by SIGKILL, mid-run
    assert not (out / "summary.json").exists()

    state = torch.load(ckpt, weights_only=False)
    assert state["round"] < ROUNDS
    # the checkpoint carries one trained model per client: the per-client state under test
    assert len(state["states"]) == 3 and all(arrays for arrays, _ in state["states"])
    first = [arrays["classifier.weight"] for arrays, _ in state["states"]]
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])

    assert main(["run", "--resume", str(out), "--quiet"]) == 0  # in-process: one start saved
    assert _summary(out) == _summary(reference)
    assert _metrics(out) == _metrics(reference)
    assert [r["round"] for r in _metrics(out)] == [2, 4, 6, 8]
    assert not ckpt.exists()
