"""Experiment tracking: TensorBoard event files and a local MLflow store, read back with the
libraries' own readers; a failing tracking server never costs the run."""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from pathlib import Path

import pytest

import feddomain
from feddomain.api import run_experiment
from feddomain.federation.simulation import Simulation

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")

PROJECT = Path(__file__).resolve().parents[1]
DEMO = PROJECT / "configs" / "demo.yaml"
CHEAP = ["split.targets=[grey]", "model.name=lenet5", "model.options={}", "rounds=2",
         "eval.every=1"]  # fmt: skip


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Every scalar in a TensorBoard run folder: tag -> {step: value}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def hparams(folder: Path) -> dict[str, object]:
    """The hyper-parameters of a TensorBoard run (the HParams plugin's session start)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    acc = EventAccumulator(str(folder))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = HParamsPluginData.FromString(content).session_start_info
    return {
        k: v.number_value if v.HasField("number_value") else v.string_value
        for k, v in start.hparams.items()
    }


def test_tensorboard_holds_every_round_the_config_and_the_summary(tmp_path: Path) -> None:
    """Catches rounds, metrics or the summary missing from (or differing in) the event file:
    read back with TensorBoard's EventAccumulator, every value equals the run's own files."""
    board = tmp_path / "tb"
    cfg = feddomain.load_config(DEMO, *CHEAP, "train.lr=0.002", tracking={"tensorboard": board})
    (run,) = feddomain.run(cfg, out=tmp_path / "run", quiet=True)
    folder = board / "demo" / "fedavg" / "seed0" / "lodo-grey"
    logged = scalars(folder)
    rounds = read_jsonl(tmp_path / "run" / "rounds.jsonl")
    for record in run.records:  # evaluated rounds: accuracy, calibration, per-domain scores
        rnd = record["round"]
        for key in ("id_acc", "ood_acc", "ood_ece", "ood_nll"):
            assert logged[key][rnd] == pytest.approx(record[key], rel=1e-6)
        assert logged["per_domain/grey"][rnd] == pytest.approx(record["per_domain"]["grey"])
    for record in rounds:  # every round: bytes by kind, phase times, losses
        rnd = record["round"]
        assert logged["ledger/up/model"][rnd] == record["ledger"]["up"]["model"]
        assert logged["ledger/down/scalars"][rnd] == record["ledger"]["down"]["scalars"]
        assert logged["time/train"][rnd] == pytest.approx(record["time"]["train"], rel=1e-6)
        losses = record["client_loss"].values()
        assert logged["train_loss"][rnd] == pytest.approx(sum(losses) / len(losses), rel=1e-6)
    selected = run.selected_round
    assert logged["summary/ood_acc"] == {selected: pytest.approx(run.summary["ood_acc"])}
    params = hparams(folder)
    assert params["train.lr"] == pytest.approx(0.002) and params["algorithm.name"] == "fedavg"
    assert params["tracking.tensorboard"] == str(board)


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """MLflow's SQLite store keeps artifacts in ./mlruns: the test's own folder."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_mlflow_holds_the_config_every_round_and_the_summary(in_tmp: Path) -> None:
    """Catches parameters, per-round metrics, the summary or the run's name and status
    missing from a local MLflow store (SQLite), read back with MLflow's own client."""
    from mlflow import MlflowClient

    tmp_path = in_tmp
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking = {"mlflow": {"tracking_uri": uri, "experiment": "api-test"}}
    cfg = feddomain.load_config(DEMO, *CHEAP, "algorithm.name=fedprox", tracking=tracking)
    (run,) = feddomain.run(cfg, out=tmp_path / "run", quiet=True)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("api-test")
    (logged,) = client.search_runs([experiment.experiment_id])
    assert logged.info.run_name == "demo/fedprox/seed0/lodo-grey"
    assert logged.info.status == "FINISHED"
    assert logged.data.params["algorithm.name"] == "fedprox"
    assert logged.data.params["algorithm.mu"] == "0.01"  # FedProx's default, not in the YAML
    assert logged.data.params["train.lr"] == str(cfg.train.lr)
    history = client.get_metric_history(logged.info.run_id, "ood_acc")
    assert {m.step: m.value for m in history} == {r["round"]: r["ood_acc"] for r in run.records}
    rounds = read_jsonl(tmp_path / "run" / "rounds.jsonl")
    up = client.get_metric_history(logged.info.run_id, "ledger/up/model")
    assert {m.step: m.value for m in up} == {r["round"]: r["ledger"]["up"]["model"] for r in rounds}
    assert logged.data.metrics["summary/ood_acc"] == run.summary["ood_acc"]
    artifacts = {a.path for a in client.list_artifacts(logged.info.run_id)}
    assert artifacts == {"config.yaml", "summary.json"}


def test_an_unreachable_tracking_server_warns_once_and_the_run_is_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Catches a tracking failure stopping the run or losing its files, and a warning per
    round instead of one: MLflow at a closed port (127.0.0.1:9), TensorBoard still written."""
    tracking = {"mlflow": {"tracking_uri": "http://127.0.0.1:9"}, "tensorboard": tmp_path / "tb"}
    cfg = feddomain.load_config(DEMO, *CHEAP, tracking=tracking)
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="feddomain"):
        (run,) = feddomain.run(cfg, out=tmp_path / "run", quiet=True)
    assert time.perf_counter() - start < 60  # MLflow's own retries would take minutes
    warnings = [r.getMessage() for r in caplog.records if "tracking:" in r.getMessage()]
    assert len(warnings) == 1 and "mlflow failed to start" in warnings[0], warnings
    assert str(tmp_path / "run") in warnings[0]
    assert {p.name for p in (tmp_path / "run").iterdir()} >= {
        "summary.json", "metrics.jsonl", "rounds.jsonl", "config.yaml"
    }  # fmt: skip
    assert run.summary["rounds"] == 2
    assert scalars(tmp_path / "tb" / "demo" / "fedavg" / "seed0" / "lodo-grey")["ood_acc"]


def test_a_sweep_tracks_each_run_as_its_own_run(in_tmp: Path) -> None:
    """Catches a sweep's runs written into one TensorBoard run (or one MLflow run): each
    grid point and split is its own, named after the sweep's run directory."""
    from mlflow import MlflowClient

    tmp_path = in_tmp
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    feddomain.sweep(
        DEMO, *CHEAP, "rounds=1", f"tracking.tensorboard={tmp_path / 'tb'}",
        f"tracking.mlflow.tracking_uri={uri}", grid={"seed": [0, 1]}, out=tmp_path / "sw",
    )  # fmt: skip
    for seed in (0, 1):
        folder = tmp_path / "tb" / "demo" / f"seed={seed}" / "lodo-grey"
        summary = json.loads((tmp_path / "sw" / f"seed={seed}/lodo-grey/summary.json").read_text())
        assert scalars(folder)["summary/ood_acc"][1] == pytest.approx(summary["ood_acc"])
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("demo").experiment_id])
    names = sorted(r.info.run_name for r in runs)
    assert names == ["demo/seed=0/lodo-grey", "demo/seed=1/lodo-grey"]
    assert {r.data.params["seed"] for r in runs} == {"0", "1"}


class _Crash(Exception):
    pass


class CrashesInRound3(Simulation):
    def _round(self, rnd: int) -> dict:
        if rnd == 3:
            raise _Crash
        return super()._round(rnd)


def test_a_resumed_run_continues_its_mlflow_run(in_tmp: Path) -> None:
    """Catches a resumed run opening a second MLflow run (or leaving the first unfinished):
    a run that crashed in round 3 (checkpoint after round 2) and was resumed is one FINISHED
    MLflow run whose history holds each of its 4 rounds."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{in_tmp / 'mlflow.db'}"
    cfg = feddomain.load_config(
        DEMO, *CHEAP, "rounds=4", "checkpoint.every=2", tracking={"mlflow": {"tracking_uri": uri}}
    )
    with pytest.raises(_Crash):
        run_experiment(cfg, in_tmp / "run", quiet=True, simulation=CrashesInRound3)
    client = MlflowClient(uri)
    exp_id = client.get_experiment_by_name("demo").experiment_id
    (crashed,) = client.search_runs([exp_id])
    assert crashed.info.status == "FAILED"
    feddomain.run(out=in_tmp / "run", resume=True, quiet=True)
    (logged,) = client.search_runs([exp_id])
    assert logged.info.run_id == crashed.info.run_id and logged.info.status == "FINISHED"
    history = client.get_metric_history(logged.info.run_id, "ood_acc")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]  # eval.every=1; no round twice


def test_a_tracker_whose_package_is_missing_is_refused_when_the_config_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches a run that starts (and trains) although its tracking cannot work: the
    message names the key and the extra to install."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else find_spec(name)
    )
    with pytest.raises(feddomain.ConfigError, match=r"'tracking\.mlflow'.*feddomain\[mlflow\]"):
        feddomain.load_config(DEMO, tracking={"mlflow": {"experiment": "x"}})


def test_a_backend_failing_mid_run_warns_once_and_the_others_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Catches a backend that fails in round 2 (a server gone mid-run) warning every round
    after, being called again, or taking a working backend down with it."""
    from feddomain.tracking import Backend, RunTracker

    class Recording(Backend):
        def __init__(self, name: str, fail_at: int | None) -> None:
            self.name, self.fail_at, self.rounds, self.closed = name, fail_at, [], None

        def log_round(self, rnd: int, metrics: dict) -> None:
            if rnd == self.fail_at:
                raise ConnectionError("server gone")
            self.rounds.append(rnd)

        def log_summary(self, step: int, metrics: dict) -> None:
            self.rounds.append("summary")

        def close(self, status: str) -> None:
            self.closed = status

    flaky, steady = Recording("flaky", fail_at=2), Recording("steady", fail_at=None)
    tracker = RunTracker(tmp_path, [("flaky", lambda: flaky), ("steady", lambda: steady)])
    with caplog.at_level(logging.WARNING, logger="feddomain"):
        for rnd in (1, 2, 3, 4):
            tracker.log_round({"round": rnd, "ood_acc": 0.5})
        tracker.log_summary({"selected_round": 4, "ood_acc": 0.5})
        tracker.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "flaky failed to log round (ConnectionError" in warnings[0]
    assert flaky.rounds == [1] and flaky.closed is None
    assert steady.rounds == [1, 2, 3, 4, "summary"] and steady.closed == "FINISHED"


def test_a_rescore_is_tracked_as_a_run_of_its_own(tmp_path: Path) -> None:
    """Catches a rescore whose tracking settings are accepted and then ignored: its evaluated
    rounds and its summary (at its own selection) reach TensorBoard as a trained run's do."""
    cfg = feddomain.load_config(DEMO, *CHEAP, "train.lr=0.002", "checkpoint.keep_evaluated=true")
    feddomain.run(cfg, out=tmp_path / "run", quiet=True)
    board = tmp_path / "tb"
    (run,) = feddomain.rescore(
        tmp_path / "run", tmp_path / "again", "eval.selection=last", f"tracking.tensorboard={board}"
    )
    logged = scalars(board / "demo" / "fedavg" / "seed0" / "lodo-grey")
    assert logged["ood_acc"] == {r["round"]: pytest.approx(r["ood_acc"]) for r in run.records}
    assert run.selected_round == 2  # the last round, not the source's selection
    assert logged["summary/ood_acc"] == {2: pytest.approx(run.summary["ood_acc"])}
