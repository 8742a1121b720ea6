"""FedDG-GA (feddomain/algorithms/feddg_ga.py): d₀ = 0 is FedAvg, the GA weights of three unequal
clients over two adjustments by hand (float64), the two losses each client reports, and the
settings it refuses. Expected values are written out by hand, come from a float64 reference
computed here, or from a FedAvg run — never read back from the implementation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from feddomain.algorithms.base import ServerContext
from feddomain.algorithms.feddg_ga import FedDGGAHparams, FedDGGAServer
from feddomain.config import load_config
from feddomain.errors import ConfigError
from feddomain.federation.messages import Message
from feddomain.federation.simulation import Simulation
from feddomain.models import build_model
from tests.engine_helpers import tiny_config
from tests.test_evidence_engine import TRAIN_SIZES, uneven_federation


def _sim(tmp_path, algorithm, rounds: int = 3, **overrides) -> Simulation:
    cfg = tiny_config(rounds=rounds, train__lr=0.1, algorithm=algorithm, **overrides)
    tmp_path.mkdir(parents=True)
    return Simulation(cfg, uneven_federation(cfg), tmp_path)


def _strip(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("time", "diagnostics")} for r in records]


def test_d0_zero_is_fedavg_bit_for_bit(tmp_path):
    """Catches weights that move at d₀ = 0, initial weights other than FedAvg's sample counts,
    or a client's training changed by the loss measurements (an augmented or train-mode pass).

    Exact: the extra passes are evaluation-mode forwards that draw nothing from any RNG, and
    with no adjustment the server aggregates with the sample counts through FedAvg's code."""
    ga = _sim(tmp_path / "ga", {"name": "feddg_ga", "d0": 0.0}, train__augment__hflip=True)
    ga.run()
    avg = _sim(tmp_path / "avg", "fedavg", train__augment__hflip=True)
    avg.run()
    for k, v in avg.server.global_arrays.items():
        assert torch.equal(ga.server.global_arrays[k], v), k
    # FedDG-GA sends two more scalars: only the byte counts differ
    for r in ga.records + avg.records:
        for key in ("ledger", "bytes_up", "bytes_down"):
            r.pop(key)
    assert _strip(ga.records) == _strip(avg.records)
    # the gaps were real: a positive d₀ would have moved the weights
    assert any(abs(g) > 1e-4 for g in ga.records[-1]["diagnostics"]["ga"]["gaps"])


def _server(rounds: int, **hp) -> FedDGGAServer:
    ctx = ServerContext(lambda: nn.Linear(1, 1, bias=False), n_clients=3, seed=0, rounds=rounds)
    return FedDGGAServer(ctx, FedDGGAHparams(**hp))


def _reply(n: int, value: float, global_loss: float, local_loss: float) -> Message:
    return Message(
        "fit",
        {"weight": torch.tensor([[value]], dtype=torch.float32)},
        {"num_examples": n, "loss": 0.0, "global_loss": global_loss, "local_loss": local_loss},
    )


def _round(server, rnd, rows) -> float:
    replies = [(cid, _reply(*row)) for cid, row in enumerate(rows)]
    server.aggregate(rnd, iter(replies))
    return float(server.global_arrays["weight"])


def test_ga_weights_of_three_unequal_clients_by_hand():
    """Catches gaps with the wrong sign or from the wrong round, no normalisation by max |G|, a
    step that does not decay as (1 − (r − 1)/R)·d₀, weights not clipped to [0, 1] or not
    renormalised, initial weights other than the sample counts, or weights not carried over.

    By hand, R = 4, d₀ = 2/3, clients of 6, 3 and 1 samples; models θ = 10, 20, 40:
      round 1: no gaps yet, FedAvg's weights p = (0.6, 0.3, 0.1): θ = 6 + 6 + 4 = 16.
               local losses L^l = (0.5, 0.8, 0.3).
      round 2: global losses L^g = (0.9, 0.4, 0.5), G = (0.4, −0.4, 0.2), max |G| = 0.4,
               d = (1 − 1/4)·2/3 = 0.5: p + d·G/0.4 = (1.1, −0.2, 0.35) → clip (1, 0, 0.35),
               / 1.35: p = (20/27, 0, 7/27); θ = (200 + 280)/27 = 480/27.
               local losses L^l = (0.2, 0.6, 0.1).
      round 3: L^g = (0.3, 0.6, 0.4), G = (0.1, 0, 0.3), d = (1 − 2/4)·2/3 = 1/3:
               p + d·G/0.3 = (20/27 + 1/9, 0, 7/27 + 1/3) = (23/27, 0, 16/27), / (39/27):
               p = (23/39, 0, 16/39); θ = (230 + 640)/39 = 870/39."""
    server = _server(rounds=4, d0=2 / 3)
    sizes, models = (6, 3, 1), (10.0, 20.0, 40.0)
    losses = [
        [(0.7, 0.5), (0.7, 0.8), (0.7, 0.3)],  # round 1: (L^g, L^l); L^g unused without L^l
        [(0.9, 0.2), (0.4, 0.6), (0.5, 0.1)],
        [(0.3, 0.0), (0.6, 0.0), (0.4, 0.0)],
    ]
    expected_weights = [(0.6, 0.3, 0.1), (20 / 27, 0.0, 7 / 27), (23 / 39, 0.0, 16 / 39)]
    expected_models = [16.0, 480 / 27, 870 / 39]
    for rnd, (rows, weights, model) in enumerate(
        zip(losses, expected_weights, expected_models, strict=True), start=1
    ):
        got = _round(
            server, rnd, [(n, m, g, ll) for n, m, (g, ll) in zip(sizes, models, rows, strict=True)]
        )
        diag = server.diagnostics()["ga"]
        assert diag["weights"] == pytest.approx(list(weights), abs=1e-12), rnd
        # float32 model: the float64 weighted mean rounded once (|θ| < 32: ulp 2**-19)
        assert got == pytest.approx(model, abs=2**-19), rnd
    assert diag["gaps"] == pytest.approx([0.1, 0.0, 0.3], abs=1e-12)
    assert diag["step"] == pytest.approx(1 / 3, abs=1e-15)


def test_step_is_the_official_schedule_two_rounds_later():
    """Catches a decay schedule other than the documented one: the official script refines the
    weights after its 0-based round i with step·(1 − (i − 1)/R) and aggregates round i + 1 with
    them, so its aggregation of 0-based round j steps by step·(1 − (j − 2)/R); our 1-based round
    r (j = r − 1) takes the official step of j + 2 (fisc.md §6's shift), down to d₀/R at r = R."""
    rounds, d0 = 10, 0.2

    def official(j: int) -> float:
        i = j - 1  # the round after which the official script refined the weights
        return d0 - (i - 1) * (d0 / rounds)  # args.step_size - (i-1)*step_size_decay

    server = _server(rounds=rounds, d0=d0)
    for rnd in range(1, rounds + 1):
        losses = (1.0 + 0.1 * rnd, 0.5), (0.7, 0.6 - 0.01 * rnd), (0.9, 0.2)
        _round(server, rnd, [(n, 1.0, g, ll) for n, (g, ll) in zip((6, 3, 1), losses, strict=True)])
        if rnd >= 2:
            step = server.diagnostics()["ga"]["step"]
            assert step == pytest.approx(official(rnd - 1 + 2), abs=1e-15), rnd
    assert step == pytest.approx(d0 / rounds, abs=1e-15)


def test_uniform_initial_weights_are_the_official_one_over_k():
    """Catches ``initial_weights: uniform`` still weighting by samples."""
    server = _server(rounds=4, d0=1 / 3, initial_weights="uniform")
    got = _round(server, 1, [(6, 10.0, 0.7, 0.5), (3, 20.0, 0.7, 0.8), (1, 40.0, 0.7, 0.3)])
    assert got == pytest.approx(70 / 3, abs=2**-19)


def test_a_client_new_to_the_round_has_no_gap_and_the_others_still_move():
    """Catches a gap computed against a local loss the client never reported (a client seen for
    the first time), which would also change max |G| for the others."""
    server = _server(rounds=4, d0=2 / 3)
    _round(server, 1, [(6, 10.0, 0.7, 0.5), (3, 20.0, 0.7, 0.8)])  # client 2 absent
    server.aggregate(
        2,
        iter(
            [
                (0, _reply(6, 10.0, 0.9, 0.2)),
                (1, _reply(3, 20.0, 0.4, 0.6)),
                (2, _reply(1, 40.0, 5.0, 0.1)),  # a large L^g, but no previous L^l
            ]
        ),
    )
    diag = server.diagnostics()["ga"]
    assert diag["gaps"] == pytest.approx([0.4, -0.4, 0.0], abs=1e-12)
    # p = (0.6, 0.3, 0.1) + 0.5·(1, −1, 0) → clip (1, 0, 0.1), / 1.1
    assert diag["weights"] == pytest.approx([1 / 1.1, 0.0, 0.1 / 1.1], abs=1e-12)


def _ce64(arrays: dict, data) -> float:
    """Float64 reference: mean cross-entropy of a LeNet-5 holding ``arrays`` on the
    un-augmented inputs x / 255 of ``data`` (the tiny runs set no mean/std)."""
    model = build_model("lenet5", 3).double()
    model.load_state_dict({k: v.double() for k, v in arrays.items()})
    model.eval()
    with torch.no_grad():
        logits = model(data.inputs.double() / 255)
    return float(F.cross_entropy(logits, data.labels))


@pytest.mark.parametrize("local_loss", ["evaluated", "training"])
def test_each_client_reports_the_global_and_its_local_loss_on_its_own_data(tmp_path, local_loss):
    """Catches a global loss measured after training (or on augmented inputs, or in train
    mode), a local loss of the wrong model, or another client's data."""
    sim = _sim(
        tmp_path / local_loss,
        {"name": "feddg_ga", "local_loss": local_loss},
        rounds=2,
        train__augment__hflip=True,  # flips would change the loss if evaluation used them
    )
    seen = []
    aggregate = sim.server.aggregate

    def spy(rnd, replies):
        before = {k: v.clone() for k, v in sim.server.global_arrays.items()}
        got = [(cid, msg.copy()) for cid, msg in replies]
        seen.append((before, got))
        aggregate(rnd, iter(got))

    sim.server.aggregate = spy
    sim.run()
    for before, replies in seen:
        assert [c for c, _ in replies] == [0, 1, 2]
        for cid, msg in replies:
            data = sim.data.train[cid]
            assert msg.scalars["num_examples"] == TRAIN_SIZES[cid]
            # float32 forward vs float64 reference on |loss| ~ 1: a few 1e-7; 1e-5 is far below
            # the loss changes of one local epoch here (checked below)
            assert msg.scalars["global_loss"] == pytest.approx(_ce64(before, data), abs=1e-5)
            if local_loss == "evaluated":
                assert msg.scalars["local_loss"] == pytest.approx(_ce64(msg.arrays, data), abs=1e-5)
            else:
                assert msg.scalars["local_loss"] == msg.scalars["loss"]
            assert abs(_ce64(before, data) - _ce64(msg.arrays, data)) > 1e-3


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"algorithm": {"name": "feddg_ga", "d0": 1.5}}, "algorithm.d0"),
        ({"algorithm": {"name": "feddg_ga", "d0": -0.1}}, "algorithm.d0"),
        ({"algorithm": {"name": "feddg_ga", "gap_split": "test"}}, "algorithm.gap_split"),
        ({"algorithm": "feddg_ga", "topology__stations": 2}, "topology.stations"),
        (
            {"algorithm": {"name": "feddg_ga", "gap_split": "val"}, "split__val_fraction": 0.0},
            "algorithm.gap_split",
        ),
    ],
)
def test_settings_feddg_ga_cannot_run_with_are_refused_naming_the_key(overrides, key):
    """Catches d₀ outside [0, 1], an unknown gap split, stations, or validation-split gaps
    without validation data accepted at config time."""
    with pytest.raises(ConfigError, match=rf"'{key}'"):
        tiny_config(**overrides)


def test_the_baseline_config_holds_fiscs_settings():
    """Catches the shipped example drifting from fisc.md §6 (d₀ = 1/3, loss gaps on the
    training data) or from the pacs-lenet32 profile."""
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs/baselines/feddg_ga.yaml")
    hp = cfg.algorithm.hparams
    assert cfg.algorithm.name == "feddg_ga" and hp["d0"] == pytest.approx(1 / 3, abs=1e-15)
    assert (hp["initial_weights"], hp["gap_split"]) == ("samples", "train")
    assert (cfg.dataset.name, cfg.model.name, cfg.rounds) == ("pacs", "lenet5", 100)
