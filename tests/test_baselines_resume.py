"""SIGKILL mid-run, then ``--resume``, for the stateful server-side baselines: SCAFFOLD (each
client's control variate c_i is per-client state, the server's c is server state) and FedDG-GA
(the aggregation weights and each client's previous local loss are server state). The resumed
run must reproduce the uninterrupted run exactly."""

from __future__ import annotations

import pytest
import torch

from feddomain.algorithms.scaffold import CLIENT_C
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
    write_config(config, {**BASE, "name": f"resume-{method}", "algorithm": method})
    run_to_end(config, tmp_path / "reference")
    out = tmp_path / "killed"
    state = kill_after_checkpoint(config, out, min_round=2)
    assert state["round"] < ROUNDS
    _check_state(method, state)

    resume(out)
    assert_resumed_equals(out, tmp_path / "reference")
    assert [r["round"] for r in metrics_of(out)] == [2, 4, 6]
