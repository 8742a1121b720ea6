"""SIGKILL mid-run, then ``--resume``, for FedBN and SiloBN: each client's local BatchNorm arrays
are per-client state (and the server keeps their mean), so the resumed run must reproduce the
uninterrupted run exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from feddomain.cli import main
from tests.test_evidence_resume import _metrics, _summary

ROUNDS = 6


def _config(method: str) -> dict:
    return {
        "name": f"resume-{method}",
        "seed": 5,
        "rounds": ROUNDS,
        "dataset": {"name": "digits_embedded", "resolution": 16},
        "split": {"scheme": "lodo", "targets": ["grey"]},
        "partition": {"n_clients": 3, "d": 1},
        "model": {"name": "small_cnn", "options": {"widths": [8, 16]}},  # BatchNorm, and small
        "algorithm": method,
        "train": {"batch_size": 64, "optimizer": "adam", "lr": 0.002},
        "eval": {"every": 2},
        "checkpoint": {"every": 1},
        "threads": 1,
    }


@pytest.mark.parametrize("method", ["fedbn", "silobn"])
def test_sigkill_then_resume_matches_the_uninterrupted_run(method, tmp_path):
    """Catches local BatchNorm arrays (per-client state) or the server's mean of them lost
    across a SIGKILL and --resume: summary and metrics differ from the uninterrupted run."""
    config = tmp_path / f"{method}.yaml"
    config.write_text(yaml.safe_dump(_config(method)))
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
    # the checkpoint carries each client's own BatchNorm statistics: the state under test
    key = "local/featurizer.0.1.running_mean"
    kept = [arrays[key] for arrays, _ in state["states"]]
    assert len(kept) == 3 and not torch.equal(kept[0], kept[1])
    assert "featurizer.0.1.running_mean" in state["server"]["local_mean"]

    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    assert _summary(out) == _summary(reference)
    assert _metrics(out) == _metrics(reference)
    assert [r["round"] for r in _metrics(out)] == [2, 4, 6]
    assert not ckpt.exists()
