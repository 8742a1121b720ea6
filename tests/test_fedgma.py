"""FedGMA (feddomain/algorithms/fedgma.py): its reduction to FedAvg, its masks by hand on three
unequal clients, and the refusal of bad hyper-parameters. Expected values are written out by
hand (or come from a FedAvg run), never read back from the implementation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from feddomain.algorithms.base import ServerContext
from feddomain.algorithms.fedgma import FedGMAHparams, FedGMAServer
from feddomain.config import load_config
from feddomain.errors import ConfigError
from feddomain.federation.messages import Message
from feddomain.federation.simulation import Simulation
from tests.engine_helpers import tiny_config
from tests.test_evidence_engine import uneven_federation

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "baselines"


def _run(tmp_path, algorithm) -> Simulation:
    cfg = tiny_config(rounds=2, train__lr=0.1, algorithm=algorithm)
    tmp_path.mkdir(parents=True)
    sim = Simulation(cfg, uneven_federation(cfg), tmp_path)
    sim.run()
    return sim


def _without_diagnostics(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("diagnostics", "time")} for r in records]


@pytest.mark.parametrize("step", [1.0, 0.3])
def test_tau_zero_is_fedavg_with_the_same_server_step_bit_for_bit(tmp_path, step):
    """Catches a mask that is not 1 everywhere at τ = 0 (A ≥ 0 always), a server step that
    differs from FedAvg's server_lr, or unequal clients weighted differently from FedAvg.

    Exact, not approximate: where m = 1 the new value is computed by FedAvg's own expression on
    the same sample-weighted mean, so the same float operations run in the same order."""
    gma = _run(tmp_path / "gma", {"name": "fedgma", "tau": 0.0, "server_lr": step})
    avg = _run(tmp_path / "avg", {"name": "fedavg", "server_lr": step})
    assert gma.server.global_arrays.keys() == avg.server.global_arrays.keys()
    for k, v in avg.server.global_arrays.items():
        assert torch.equal(gma.server.global_arrays[k], v), k
    assert _without_diagnostics(gma.records) == _without_diagnostics(avg.records)
    assert gma.records[-1]["diagnostics"]["gma"]["masked_fraction"] == 0.0
    # the clients moved the model in different directions, so a positive τ would mask something
    tau = _run(tmp_path / "tau", {"name": "fedgma", "tau": 0.7, "server_lr": step})
    assert tau.records[-1]["diagnostics"]["gma"]["masked_fraction"] > 0.1


def _server(tau: float, step: float) -> FedGMAServer:
    ctx = ServerContext(lambda: nn.Linear(2, 2), n_clients=3, seed=0, rounds=1)
    server = FedGMAServer(ctx, FedGMAHparams(tau=tau, server_lr=step))
    # six coordinates: weight (2x2, row-major) then bias (2)
    server.global_arrays = {
        "weight": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        "bias": torch.tensor([5.0, 6.0]),
    }
    return server


def _reply(n: int, deltas: list[float]) -> Message:
    w = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) + torch.tensor(deltas)
    return Message("fit", {"weight": w[:4].view(2, 2), "bias": w[4:]}, {"num_examples": n})


# Client updates Δ_k per coordinate, for clients of 2, 1 and 1 samples (p = 1/2, 1/4, 1/4):
#   coordinate     c0    c1    c2    c3    c4    c5
#   Δ_1 (n = 2)    +1    +2    +2    +1    -2     0
#   Δ_2 (n = 1)    +1    -1    +4    -1    -2     0
#   Δ_3 (n = 1)    +1    -1     0     0    +4     0
#   Σ sign         3     -1     2     0    -1     0
#   A = |Σ|/3      1     1/3   2/3    0    1/3    0
#   Σ p_k Δ_k      1     1/2    2    1/4  -1/2    0
# (a sample-weighted sign agreement would give c1 |1/2 - 1/4 - 1/4| = 0, not 1/3; an unweighted
# mean update c1 0, not 1/2)
DELTAS = [
    (2, [1.0, 2.0, 2.0, 1.0, -2.0, 0.0]),
    (1, [1.0, -1.0, 4.0, -1.0, -2.0, 0.0]),
    (1, [1.0, -1.0, 0.0, 0.0, 4.0, 0.0]),
]


@pytest.mark.parametrize(
    ("tau", "masks"),
    [
        # τ = 0.5: c0 (A = 1) and c2 (A = 2/3) are kept whole, the others scaled by A
        (0.5, [1.0, 1 / 3, 1.0, 0.0, 1 / 3, 0.0]),
        # τ = 1/3: A = 1/3 reaches the threshold (A ≥ τ, not A > τ): m = 1 there too
        (1 / 3, [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]),
    ],
)
def test_masks_by_hand_on_three_unequal_clients(tau, masks):
    """Catches a sign agreement weighted by samples, a strict threshold, the released code's
    mask (1 − A where A ≥ τ), an unweighted mean update, or the step size left out."""
    step = 0.5
    server = _server(tau, step)
    server.aggregate(1, iter([(i, _reply(n, d)) for i, (n, d) in enumerate(DELTAS)]))
    mean_update = [1.0, 0.5, 2.0, 0.25, -0.5, 0.0]  # Σ p_k Δ_k, from the table
    start = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    expected = [w + step * m * u for w, m, u in zip(start, masks, mean_update, strict=True)]
    got = torch.cat([server.global_arrays["weight"].reshape(-1), server.global_arrays["bias"]])
    # float32 result of a float64 computation rounded once: within half a float32 ulp of the
    # exact value (|w| < 8: 2**-22 / 2); 1e-6 is well below the smallest masked-update
    # difference tested (1/12 vs 1/4)
    torch.testing.assert_close(got.double(), torch.tensor(expected).double(), rtol=0, atol=1e-6)
    below_one = sum(m < 1 for m in masks) / 6
    assert server.diagnostics()["gma"]["masked_fraction"] == pytest.approx(below_one, abs=1e-15)


def test_no_accepted_reply_keeps_the_model():
    """Catches a division by a zero client count (NaN model) when every reply was rejected."""
    server = _server(0.4, 1.0)
    before = {k: v.clone() for k, v in server.global_arrays.items()}
    server.aggregate(1, iter([]))
    assert all(torch.equal(server.global_arrays[k], v) for k, v in before.items())


@pytest.mark.parametrize(
    ("key", "value"),
    [("tau", 1.5), ("tau", -0.1), ("server_lr", 0.0), ("server_lr", -1.0)],
)
def test_bad_hyper_parameters_are_refused_naming_the_key(key, value):
    """Catches τ outside [0, 1] or a non-positive server step accepted at config time."""
    with pytest.raises(ConfigError, match=rf"'algorithm\.{key}'"):
        tiny_config(algorithm={"name": "fedgma", key: value})


def test_the_baseline_config_holds_hfedf_table_10_pacs_values():
    """Catches the shipped example drifting from hFedF Table 10 (PACS: τ 0.7, η_s 1, client lr
    1e-3, weight decay 1e-4) or from the pacs-lenet32 profile."""
    cfg = load_config(CONFIGS / "fedgma.yaml")
    assert cfg.algorithm.name == "fedgma"
    assert cfg.algorithm.hparams == {"tau": 0.7, "server_lr": 1.0}
    assert (cfg.train.lr, cfg.train.weight_decay) == (1e-3, 1e-4)
    assert (cfg.dataset.name, cfg.dataset.resolution, cfg.model.name) == ("pacs", 32, "lenet5")
    assert (cfg.rounds, cfg.train.local_epochs, cfg.train.batch_size) == (100, 1, 32)
