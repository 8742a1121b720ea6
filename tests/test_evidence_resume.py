"""SIGKILL mid-run, then ``--resume``, for a method with per-client state (Local-only keeps each
client's model in its state): the resumed run must reproduce the uninterrupted run exactly."""

from __future__ import annotations

import torch

from tests.resume_helpers import (
    assert_resumed_equals,
    kill_after_checkpoint,
    metrics_of,
    resume,
    run_to_end,
    write_config,
)

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


def test_local_only_sigkill_then_resume_matches_uninterrupted_run(tmp_path):
    """Catches per-client state (Local-only's models) lost across a SIGKILL and --resume."""
    config = write_config(tmp_path / "local.yaml", LOCAL)
    run_to_end(config, tmp_path / "reference")
    out = tmp_path / "killed"
    state = kill_after_checkpoint(config, out)
    assert state["round"] < ROUNDS
    # the checkpoint carries one trained model per client: the per-client state under test
    assert len(state["states"]) == 3 and all(arrays for arrays, _ in state["states"])
    first = [arrays["classifier.weight"] for arrays, _ in state["states"]]
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])

    resume(out)  # in-process: one interpreter start saved
    assert_resumed_equals(out, tmp_path / "reference")
    assert [r["round"] for r in metrics_of(out)] == [2, 4, 6, 8]
