"""SIGKILL mid-run, then ``--resume``, for the methods with a round-0 style phase (FISC, CCST)
and FPL's server-side prototypes: the styles the server sent once live in the server's state and
in every client's persistent state, FPL's cluster prototypes in the server's. A resumed run
skips round 0, so it must find all of them in the checkpoint and reproduce the uninterrupted
run exactly."""

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
BASE = {
    "seed": 5,
    "rounds": ROUNDS,
    "dataset": {"name": "digits_embedded", "resolution": 16},
    "split": {"scheme": "lodo", "targets": ["grey"]},
    "partition": {"n_clients": 3, "d": 1},
    "model": {"name": "lenet5"},
    "train": {"batch_size": 64, "optimizer": "adam", "lr": 0.001, "augment": {"hflip": True}},
    "eval": {"every": 2},
    "checkpoint": {"every": 1},
    "threads": 1,
}


def _check_state(method: str, state: dict) -> None:
    """The checkpoint holds the state under test."""
    server = state["server"]
    if method == "fpl":
        assert server["protos"].shape[0] >= 1 and len(server["labels"]) == server["protos"].shape[0]
        return
    assert sorted(server["styles"]) == [0, 1, 2]
    for cid, (arrays, _) in enumerate(state["states"]):
        assert torch.equal(arrays["style/style_mean"], server["styles"][cid]["style_mean"])


@pytest.mark.parametrize("method", ["fisc", "ccst", "fpl"])
def test_sigkill_then_resume_matches_the_uninterrupted_run(method, tmp_path):
    """Catches: the broadcast style (server and client copies) or FPL's prototypes lost across
    a SIGKILL and --resume, or a resumed run that redoes the style phase with other draws."""
    config = tmp_path / f"{method}.yaml"
    write_config(config, {**BASE, "name": f"resume-{method}", "algorithm": method})
    run_to_end(config, tmp_path / "reference")
    out = tmp_path / "killed"
    state = kill_after_checkpoint(config, out, min_round=2)
    assert state["round"] < ROUNDS
    _check_state(method, state)

    resume(out)
    assert_resumed_equals(out, tmp_path / "reference")
    assert [r["round"] for r in metrics_of(out)] == [2, 4, 6]
