"""``feddomain rescore``: a finished run scored again from its kept evaluated states under an
evaluation-only setting must be, number for number, the run that trains with that setting, and
anything that would have trained differently is refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import feddomain
from feddomain.cli import main
from feddomain.errors import FeddomainError
from tests.resume_helpers import metrics_of, summary_of

ROUNDS = 4


def _config(algorithm: dict[str, Any], model: str) -> dict[str, Any]:
    return {
        "name": "rescore",
        "seed": 2,
        "rounds": ROUNDS,
        "dataset": {"name": "digits_embedded", "resolution": 16},
        "split": {"scheme": "lodo", "targets": ["grey"]},
        "partition": {"n_clients": 3, "d": 1},
        "model": {"name": "small_cnn", "options": {"widths": [8, 16]}}
        if model == "small_cnn"
        else {"name": model},
        "algorithm": algorithm,
        "train": {"batch_size": 64, "optimizer": "adam", "lr": 0.002},
        "eval": {"every": 2},
        "checkpoint": {"every": 0, "keep_evaluated": True},
        "threads": 1,
    }


def _rounds_of(run_dir: Path) -> list[dict[str, Any]]:
    """rounds.jsonl without the phase times (what training did: losses, bytes, participants)."""
    lines = (run_dir / "rounds.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k != "time"} for x in lines]


def _run(cfg: dict[str, Any], out: Path, *overrides: str) -> Path:
    feddomain.run(feddomain.load_config(None, *overrides, **cfg), out, quiet=True)
    return out


# (method's hparams in the source, model, the evaluation-only override): each changes what is
# scored (the scores differ from the source's), and random/sample draw at evaluation
CASES = {
    "fedfd-random": ({"name": "fedfd"}, "small_cnn", "algorithm.test_mode=random"),
    "fedfd-local": ({"name": "fedfd"}, "small_cnn", "algorithm.test_mode=local"),
    "fedfd_a-fixed": (
        {"name": "fedfd_a"}, "small_cnn", "algorithm.test_mode=fixed", "algorithm.test_alpha=0.3",
    ),
    "hfedf-parameter_average": (
        {"name": "hfedf"}, "lenet5", "algorithm.ood_model=parameter_average",
    ),
    "fedsr-sample": ({"name": "fedsr"}, "lenet5", "algorithm.eval_z=sample"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_rescore_is_the_run_trained_with_the_setting(case, tmp_path):
    """Catches a rescore that differs from training with the setting: a state kept at the wrong
    moment or not loaded (the source's scores come back), an evaluation whose random draws
    (FedFD's random mix, FedSR's sampled z) depend on what training drew before it, training
    that depends on the test-time setting, or a summary left with the source's selection."""
    algorithm, model, *change = CASES[case]
    cfg = _config(algorithm, model)
    source = _run(cfg, tmp_path / "source")
    trained = _run(cfg, tmp_path / "trained", *change)
    rescored = tmp_path / "rescored"
    assert main(["rescore", str(source), *change, "--out", str(rescored)]) == 0

    summary = summary_of(rescored)
    assert summary.pop("rescored_from")["run"] == str(source)
    assert summary == summary_of(trained)
    assert metrics_of(rescored) == metrics_of(trained)
    assert _rounds_of(rescored) == _rounds_of(trained) == _rounds_of(source)
    assert [r["round"] for r in metrics_of(rescored)] == [2, 4]
    # the setting changed what was scored: the source's numbers did not come back
    assert metrics_of(rescored) != metrics_of(source)
    saved = feddomain.load_config(rescored / "config.yaml")
    assert saved.to_dict() == feddomain.load_config(trained / "config.yaml").to_dict()


def test_a_change_that_trains_differently_is_refused_by_name(tmp_path):
    """Catches a rescore that accepts a setting training reads (the learning rate) or one that
    changes what each evaluation scores (its batch size, with per-sample random draws), which
    would be reported as a run that was never trained; nothing is written."""
    source = _run(_config({"name": "fedfd"}, "small_cnn"), tmp_path / "source")
    out = tmp_path / "out"
    with pytest.raises(FeddomainError) as err:
        feddomain.rescore(source, out, "train.lr=0.1", "eval.batch_size=7",
                          "algorithm.test_mode=fixed")  # fmt: skip
    message = str(err.value)
    assert "eval.batch_size, train.lr would change training" in message
    assert "algorithm.test_mode" in message  # what it may change instead
    assert not out.exists()


def test_a_run_without_kept_states_or_logs_is_refused_before_anything_is_written(tmp_path):
    """Catches a rescore of a run that kept no evaluated states, or lost one or its logs (a
    copy of it), failing half-way (an unhelpful crash, a half-written output the campaign
    then skips) instead of naming what is missing before writing anything."""
    cfg = _config({"name": "fedfd"}, "small_cnn")
    cfg["checkpoint"] = {"every": 0}
    plain = _run(cfg, tmp_path / "plain")
    out = tmp_path / "out"
    with pytest.raises(FeddomainError, match=r"kept no evaluated states.*keep_evaluated=true"):
        feddomain.rescore(plain, out, "algorithm.test_mode=instance")
    assert not out.exists()
    source = _run(_config({"name": "fedfd"}, "small_cnn"), tmp_path / "source")
    (source / "evaluated" / "round_00004.pt").unlink()
    with pytest.raises(FeddomainError, match=r"evaluated rounds \[4\] are missing"):
        feddomain.rescore(source, out, "algorithm.test_mode=instance")
    (source / "rounds.jsonl").unlink()
    with pytest.raises(FeddomainError, match=r"rounds\.jsonl missing"):
        feddomain.rescore(source, out, "algorithm.test_mode=instance")
    assert not out.exists()


def test_a_setting_under_which_the_model_diverges_is_refused(tmp_path, monkeypatch):
    """Catches a rescore that, when its evaluation of round 4 diverges, keeps the source's
    later rounds (bytes, rejected updates, round log) where the run trained with the setting
    would have stopped: it must refuse, name the round, and leave nothing behind."""
    from feddomain.errors import DivergedError
    from feddomain.federation.simulation import Simulation

    source = _run(_config({"name": "fedfd"}, "small_cnn"), tmp_path / "source")
    evaluate = Simulation.evaluate

    def diverging(self):
        if self.records:  # the second evaluation (round 4)
            raise DivergedError("the model to evaluate gives non-finite outputs")
        return evaluate(self)

    monkeypatch.setattr(Simulation, "evaluate", diverging)
    out = tmp_path / "out"
    with pytest.raises(FeddomainError, match=r"round 4: the model .* stops there"):
        feddomain.rescore(source, out, "algorithm.test_mode=instance")
    assert not out.exists()


def test_an_unfinished_diverged_or_rescored_source_is_refused(tmp_path):
    """Catches a rescore standing for a run whose training did not run to its end (one never
    finished, or one stopped when its model diverged: a run under another test-time setting
    would have trained on), and a rescore of a rescore failing on states it never kept
    instead of naming the run that holds them."""
    source = _run(_config({"name": "fedfd"}, "small_cnn"), tmp_path / "source")
    once = tmp_path / "once"
    feddomain.rescore(source, once, "algorithm.test_mode=fixed")
    with pytest.raises(FeddomainError, match=f"a rescore of {source}, which holds the states"):
        feddomain.rescore(once, tmp_path / "twice", "algorithm.test_mode=random")
    longer = feddomain.load_config(once / "config.yaml", f"rounds={ROUNDS + 2}")
    with pytest.raises(FeddomainError, match=f"is a rescore of {source}"):
        feddomain.run(longer, once, resume=True)
    summary = json.loads((source / "summary.json").read_text())
    (source / "summary.json").write_text(
        json.dumps({**summary, "diverged": {"round": 4, "message": "round 4: non-finite"}})
    )
    with pytest.raises(FeddomainError, match=r"diverged \(round 4: non-finite"):
        feddomain.rescore(source, tmp_path / "a", "algorithm.test_mode=instance")
    (source / "summary.json").unlink()
    with pytest.raises(FeddomainError, match="has not finished"):
        feddomain.rescore(source, tmp_path / "b", "algorithm.test_mode=instance")
    (source / "diverged.json").write_text("{}")
    with pytest.raises(FeddomainError, match="diverged before its first evaluation"):
        feddomain.rescore(source, tmp_path / "c", "algorithm.test_mode=instance")
