"""SIGKILL mid-run, then ``--resume``, for FedBN and SiloBN: each client's local BatchNorm arrays
are per-client state (and the server keeps their mean), so the resumed run must reproduce the
uninterrupted run exactly."""

from __future__ import annotations

import pytest
import torch

from tests.resume_helpers import (
    assert_resumed_equals,
    kill_after_checkpoint,
    metrics_of,
    resume,
    run_to_end,
    write_config,
)

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
    config = write_config(tmp_path / f"{method}.yaml", _config(method))
    run_to_end(config, tmp_path / "reference")
    out = tmp_path / "killed"
    state = kill_after_checkpoint(config, out)
    assert state["round"] < ROUNDS
    # the checkpoint carries each client's own BatchNorm statistics: the state under test
    key = "local/featurizer.0.1.running_mean"
    kept = [arrays[key] for arrays, _ in state["states"]]
    assert len(kept) == 3 and not torch.equal(kept[0], kept[1])
    assert "featurizer.0.1.running_mean" in state["server"]["local_mean"]

    resume(out)
    assert_resumed_equals(out, tmp_path / "reference")
    assert [r["round"] for r in metrics_of(out)] == [2, 4, 6]


@pytest.mark.parametrize("method", ["fedfd", "fedfd_a"])
def test_fedfd_sigkill_then_resume_matches_the_uninterrupted_run(method, tmp_path):
    """Catches FedFD's per-client state lost across a SIGKILL and --resume: the running
    statistics, the persistent main optimiser's and (FedFD-A) the adapter optimiser's momentum,
    the server's global statistics and its mean of the local arrays; and random u draws that
    are not reproduced after a resume (summary and metrics must equal the uninterrupted run)."""
    config = _config(method)
    config["train"] = {
        "batch_size": 64,
        "optimizer": "sgd",
        "lr": 0.02,
        "momentum": 0.9,
        "persistent_optimizer": True,
    }
    config = write_config(tmp_path / f"{method}.yaml", config)
    run_to_end(config, tmp_path / "reference")
    out = tmp_path / "killed"
    state = kill_after_checkpoint(config, out)
    assert state["round"] < ROUNDS
    kept = [arrays for arrays, _ in state["states"]]
    key = "local/featurizer.0.1.running_mean"
    assert not torch.equal(kept[0][key], kept[1][key])
    assert any(k.startswith("optimizer/") for k in kept[0])
    assert any(k.startswith("adapter_optimizer/") for k in kept[0]) == (method == "fedfd_a")
    assert "featurizer.0.1.global_mean" in state["server"]["global"]

    resume(out)
    assert_resumed_equals(out, tmp_path / "reference")
    assert [r["round"] for r in metrics_of(out)] == [2, 4, 6]
