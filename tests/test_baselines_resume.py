"""SIGKILL mid-run, then ``--resume``, for the stateful server-side baselines: SCAFFOLD (each
client's control variate c_i is per-client state, the server's c is server state) and FedDG-GA
(the aggregation weights and each client's previous local loss are server state). The resumed
run must reproduce the uninterrupted run exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from feddomain.algorithms.scaffold import CLIENT_C
from feddomain.cli import main
from tests.test_evidence_resume import _metrics, _summary

ROUNDS = 6
BASE = {
    "seed": 3,
    "rounds": ROUNDS,
    "dataset": {"name": "digits_embedded", "resolution": 16},
    "split": {"scheme": "lodo", "targets": ["grey"]},
    "partition": {"n_clients": 3, "d": 1},
    "model": {"name": "lenet5"},
    "train": {"batch_size": 64, "optimizer": "sgd", "lr": 0.05},
    "eval": {"every": 2},
    "checkpoint": {"every": 1},
    "threads": 1,
}


def _check_state(method: str, state: dict) -> None:
    """The checkpoint holds the state under test, already away from its initial value."""
    if method == "scaffold":
        assert float(state["server"]["control"].abs().max()) > 0
        c_i = [arrays[CLIENT_C] for arrays, _ in state["states"]]
        assert len(c_i) == 3 and not torch.equal(c_i[0], c_i[1])
    else:
        server = state["server"]
        assert sorted(server["weights"]) == sorted(server["local_loss"]) == [0, 1, 2]
        # the weights were adjusted at least once (round 2 on): real gaps, a positive step
        assert server["last"]["step"] > 0 and max(abs(g) for g in server["last"]["gaps"]) > 0


@pytest.mark.parametrize("method", ["scaffold", "feddg_ga"])
def test_sigkill_then_resume_matches_the_uninterrupted_run(method, tmp_path):
    """Catches SCAFFOLD's control variates (client c_i, server c) or FedDG-GA's weights and
    previous losses lost or stale across a SIGKILL and --resume."""
    config = tmp_path / f"{method}.yaml"
    config.write_text(yaml.safe_dump({**BASE, "name": f"resume-{method}", "algorithm": method}))
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
    while proc.poll() is None and time.time() < deadline:
        if ckpt.exists() and torch.load(ckpt, weights_only=False)["round"] >= 2:
            break
        time.sleep(0.005)
    assert ckpt.exists(), "no checkpoint appeared before the run ended"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL  # it really died by SIGKILL, mid-run
    assert not (out / "summary.json").exists()

    state = torch.load(ckpt, weights_only=False)
    assert state["round"] < ROUNDS
    _check_state(method, state)

    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    assert _summary(out) == _summary(reference)
    assert _metrics(out) == _metrics(reference)
    assert [r["round"] for r in _metrics(out)] == [2, 4, 6]
    assert not ckpt.exists()
