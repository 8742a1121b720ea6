"""Fairness over clients, logged for every method (fedvr.md §5.3): each round's clients'
training losses and their variance across clients in rounds.jsonl, and the report's optional
tables over them (the worst client's id accuracy, its spread, the loss variance)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from feddomain.algorithms.fedavg import FedAvgClient, FedAvgServer
from feddomain.evaluation.report import build_report
from feddomain.evaluation.trailing import TRAILING_METRICS
from feddomain.federation.messages import Message
from tests.engine_helpers import run_sim, temporary_method, tiny_config
from tests.test_report import _add_record_values, table, write_runs

# a loss each client reports, chosen so that population and sample variance differ
REPORTED = {0: 0.5, 1: 2.0, 2: 3.5, 3: 1.0}


class FixedLossClient(FedAvgClient):
    """FedAvg that reports a known loss per client instead of its training loss."""

    def run(self, msg: Message, ctx) -> Message:
        reply = super().run(msg, ctx)
        return Message(reply.task, reply.arrays, {**reply.scalars, "loss": REPORTED[ctx.cid]})


def rounds_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


def test_each_round_logs_its_participants_losses_and_their_population_variance(tmp_path):
    """Catches: the variance with ddof 1 (all four clients: 1.3125 instead of 0.984375), losses
    of clients that did not take part this round (sampling 2 of 4 each round), a previous
    round's losses carried over, and the pre-round or evaluation replies counted as training."""
    with temporary_method("_fixed_loss", FedAvgServer, FixedLossClient):
        cfg = tiny_config(
            algorithm="_fixed_loss", rounds=3, partition__n_clients=4, topology__sample_fraction=0.5
        )
        run_sim(cfg, tmp_path)
    rounds = rounds_of(tmp_path)
    assert len(rounds) == 3
    for record in rounds:
        cids = sorted(int(c) for c in record["client_loss"])
        assert len(cids) == record["participants"] == 2
        assert record["client_loss"] == {str(c): REPORTED[c] for c in cids}
        a, b = (REPORTED[c] for c in cids)
        assert record["client_loss_var"] == pytest.approx(((a - b) / 2) ** 2, abs=1e-15)
    assert len({tuple(sorted(r["client_loss"])) for r in rounds}) > 1  # sampling varied

    full = tmp_path / "full"
    with temporary_method("_fixed_loss", FedAvgServer, FixedLossClient):
        run_sim(tiny_config(algorithm="_fixed_loss", rounds=1, partition__n_clients=4), full)
    # losses 0.5, 2, 3.5, 1: mean 1.75; squared deviations 1.5625, 0.0625, 3.0625, 0.5625
    assert rounds_of(full)[0]["client_loss_var"] == pytest.approx(5.25 / 4, abs=1e-15)


def test_the_summary_keeps_each_trailing_mean_its_run_is_long_enough_for(tmp_path, monkeypatch):
    """Catches the run-level trailing means (fedvr.md B2's L_var over the last rounds) left out
    of summary.json, averaged over the wrong rounds, or given for a window longer than the run:
    over 3 rounds with 2 of 4 clients sampled, the last-2 mean is that of rounds 2 and 3, each
    ((a - b) / 2)^2 of the two reported losses; a 9-round window has no value."""
    monkeypatch.setitem(TRAILING_METRICS, "loss_var_last2", ("client_loss_var", 2))
    monkeypatch.setitem(TRAILING_METRICS, "loss_var_last9", ("client_loss_var", 9))
    with temporary_method("_fixed_loss", FedAvgServer, FixedLossClient):
        cfg = tiny_config(
            algorithm="_fixed_loss", rounds=3, partition__n_clients=4, topology__sample_fraction=0.5
        )
        run_sim(cfg, tmp_path)
    variances = []
    for record in rounds_of(tmp_path)[1:]:
        a, b = (REPORTED[int(c)] for c in record["client_loss"])
        variances.append(((a - b) / 2) ** 2)
    trailing = json.loads((tmp_path / "summary.json").read_text())["trailing"]
    assert trailing["loss_var_last2"] == pytest.approx(sum(variances) / 2, abs=1e-15)
    assert "loss_var_last9" not in trailing


def test_the_summary_totals_every_phase_of_every_round_and_one_time_task(tmp_path):
    """Catches the summary's phase totals (what a report of a run without its per-round log
    reads, e.g. HFedATM's merge against its round) missing a round, the one-time statistics
    task (FedFD's warm-up, round 0) or a phase only some rounds have (evaluate)."""
    cfg = tiny_config(model={"name": "small_cnn"}, algorithm={"name": "fedfd", "warmup": True},
                      rounds=3, eval={"every": 2})  # fmt: skip
    run_sim(cfg, tmp_path)
    rounds = rounds_of(tmp_path)
    assert rounds[0]["task"] == "collect" and len(rounds) == 4
    totals = json.loads((tmp_path / "summary.json").read_text())["phase_seconds"]
    assert set(totals) == {"train", "aggregate", "evaluate"}
    for phase, total in totals.items():
        assert total == pytest.approx(sum(r["time"][phase] for r in rounds), abs=2e-3)


@pytest.fixture
def runs_root(tmp_path: Path) -> Path:
    return write_runs(tmp_path / "runs")


def _set_fairness(run: Path, by_round: dict[int, tuple[float, float, float]]) -> None:
    """Give every record of ``run`` an id spread (min, std) and a loss variance."""
    values = {
        rnd: {"id_spread": {"mean": 0.5, "std": std, "min": worst, "max": 0.9},
              "client_loss_var": var}
        for rnd, (worst, std, var) in by_round.items()
    }  # fmt: skip
    _add_record_values(run, values)


def test_fairness_tables_read_the_selected_rounds_nested_spread(runs_root: Path):
    """Catches: the worst client's accuracy read from another round than the selected one
    (source_val picks round 10), the spread's max or mean taken for its min, the loss variance
    printed as a percentage. fedavg/photo seeds: worst 0.40 and 0.50 at round 10 -> 45.0 ± 7.1."""
    for seed, worst in ((0, 0.40), (1, 0.50)):
        _set_fairness(
            runs_root / f"fedavg_photo_s{seed}",
            {5: (0.9, 0.3, 9.0), 10: (worst, 0.1, 0.02 + seed / 100), 15: (0.8, 0.3, 7.0)},
        )
    for run in runs_root.iterdir():
        if not run.name.startswith("fedavg_photo"):
            _set_fairness(run, dict.fromkeys((5, 10, 15), (0.25, 0.05, 0.5)))
    extra = ("worst_client_acc", "client_acc_std", "client_loss_var")
    md = build_report([runs_root], extra_metrics=extra).to_markdown()
    worst = table(md, "## pacs — worst client's id accuracy (%)")
    assert worst["fedavg"][0] == "45.0 ± 7.1" and worst["hfedf"][0] == "25.0 ± 0.0"
    assert table(md, "## pacs — std of id accuracy over clients (%)")["fedavg"][0] == "10.0 ± 0.0"
    loss_var = table(md, "## pacs — variance of the clients' training losses")
    assert loss_var["fedavg"][0] == "0.025 ± 0.007"
    assert loss_var["hfedf"][0] == "0.500 ± 0.000"


def test_a_variance_below_0_01_is_printed_in_scientific_notation(runs_root: Path):
    """Catches a small loss variance printed as 0.000 ± 0.000 (FedAvg's on frozen features
    is ~1e-6: three decimals would show FedVR's 0.018 against a seeming zero), and the spread
    printed in another notation than its mean. fedavg/photo: 2e-6 and 4e-6 -> 3.00e-06 ±
    1.41e-06 (sample std of the two)."""
    for seed, var in ((0, 2e-6), (1, 4e-6)):
        _set_fairness(
            runs_root / f"fedavg_photo_s{seed}", dict.fromkeys((5, 10, 15), (0.4, 0.1, var))
        )
    for run in runs_root.iterdir():
        if not run.name.startswith("fedavg_photo"):
            _set_fairness(run, dict.fromkeys((5, 10, 15), (0.25, 0.05, 0.5)))
    md = build_report([runs_root], extra_metrics=("client_loss_var",)).to_markdown()
    loss_var = table(md, "## pacs — variance of the clients' training losses")
    assert loss_var["fedavg"][0] == "3.00e-06 ± 1.41e-06"
