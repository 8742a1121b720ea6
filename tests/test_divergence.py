"""A run whose model diverges (non-finite outputs): a clear message naming the round; a run that
had evaluated before finishes on those evaluations and says where it diverged; one that had not
leaves ``diverged.json``, which a sweep does not rerun and a tune scores as its worst trial."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from feddomain.errors import DivergedError
from feddomain.federation.simulation import Simulation
from feddomain.sweep import found
from feddomain.tune import Objective, trial_value
from tests.engine_helpers import tiny_config, tiny_federation


def _poison_after(sim: Simulation, rnd: int) -> None:
    """From round ``rnd`` on, the server offers a model with one NaN weight (a stand-in for a
    server step that blew up, as pFedHN's did at its paper's lr_s on pacs-hfedf-cnn)."""
    aggregate = sim.server.aggregate

    def poisoned(r, replies):
        aggregate(r, replies)
        if r >= rnd:
            first = next(iter(sim.server.global_arrays))
            sim.server.global_arrays = {**sim.server.global_arrays}
            sim.server.global_arrays[first] = torch.full_like(
                sim.server.global_arrays[first], float("nan")
            )

    sim.server.aggregate = poisoned


def test_a_run_that_diverges_after_evaluating_keeps_its_evaluations(tmp_path: Path):
    """Catches a diverged model scored as if it were finite (a misleading calibration error,
    or accuracy of NaN logits' argmax), a run lost although it had valid evaluations, and a
    summary that does not say where it diverged."""
    cfg = tiny_config(rounds=5, train__max_steps=2)
    sim = Simulation(cfg, tiny_federation(cfg), tmp_path)
    _poison_after(sim, 3)
    summary = sim.run()
    assert summary["diverged"]["round"] == 3
    assert "round 3: the model to evaluate gives non-finite outputs" in summary["diverged"][
        "message"
    ]
    assert [r["round"] for r in sim.records] == [1, 2]
    assert summary["selected_round"] in (1, 2)
    assert found(tmp_path) == "finished"


def test_a_run_that_diverges_before_any_evaluation_is_recorded_not_rerun_and_scores_0(
    tmp_path: Path,
):
    """Catches a diverged run with nothing scored being left as an ordinary failure (a tune
    would retry the same diverging point forever and never select), and a message that does
    not name the round."""
    cfg = tiny_config(rounds=3, train__max_steps=2)
    (tmp_path / "lodo-d0").mkdir()
    sim = Simulation(cfg, tiny_federation(cfg), tmp_path / "lodo-d0")
    _poison_after(sim, 1)
    with pytest.raises(DivergedError, match=r"round 1: the model to evaluate gives non-finite"):
        sim.run()
    record = json.loads((tmp_path / "lodo-d0" / "diverged.json").read_text())
    assert record["round"] == 1
    assert found(tmp_path / "lodo-d0") == "diverged"
    assert trial_value([tmp_path / "lodo-d0"], Objective.of(cfg, oracle=False)) == {"d0": 0.0}
