"""SCAFFOLD (feddomain/algorithms/scaffold.py): the first round is FedAvg, the corrected local steps
and the option II control variate by hand (one client, two steps, float64), the server's c by
hand, and the settings it refuses. Expected values are written out by hand (or come from a
FedAvg run), never read back from the implementation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from feddomain.algorithms.base import ClientContext, ServerContext
from feddomain.algorithms.scaffold import (
    CLIENT_C,
    DELTA_C,
    SERVER_C,
    ScaffoldClient,
    ScaffoldHparams,
    ScaffoldServer,
)
from feddomain.config import load_config
from feddomain.errors import ConfigError
from feddomain.federation.data import ClientData
from feddomain.federation.messages import Message
from feddomain.federation.simulation import Simulation
from tests.engine_helpers import tiny_config
from tests.test_evidence_engine import uneven_federation


def _run(tmp_path, algorithm, rounds: int) -> Simulation:
    cfg = tiny_config(rounds=rounds, train__lr=0.1, algorithm=algorithm)
    tmp_path.mkdir(parents=True)
    sim = Simulation(cfg, uneven_federation(cfg), tmp_path)
    sim.run()
    return sim


def test_the_first_round_with_zero_control_variates_is_fedavg_bit_for_bit(tmp_path):
    """Catches non-zero initial control variates, a correction applied when c = c_i = 0 that
    changes the gradient, or a server step other than FedAvg's sample-weighted one.

    Exact: with c = c_i = 0 the hook adds zeros to each gradient (g + 0 = g), and the server
    step is FedAvg's own code on the same replies."""
    step = 0.5
    scaffold = _run(tmp_path / "scaffold", {"name": "scaffold", "server_lr": step}, rounds=1)
    fedavg = _run(tmp_path / "fedavg", {"name": "fedavg", "server_lr": step}, rounds=1)
    for k, v in fedavg.server.global_arrays.items():
        assert torch.equal(scaffold.server.global_arrays[k], v), k
    strip = lambda rs: [{k: v for k, v in r.items() if k != "time"} for r in rs]  # noqa: E731
    records = strip(scaffold.records)
    for r in records:  # SCAFFOLD also sends Δc_i: only the byte counts differ
        for key in ("ledger", "bytes_up", "bytes_down"):
            r.pop(key)
    expected = strip(fedavg.records)
    for r in expected:
        for key in ("ledger", "bytes_up", "bytes_down"):
            r.pop(key)
    assert records == expected
    # after round 1 the control variates are non-zero, so round 2 departs from FedAvg
    assert float(scaffold.server.control.abs().max()) > 0
    assert all(float(s.arrays[CLIENT_C].abs().max()) > 0 for s in scaffold.states)
    two = _run(tmp_path / "scaffold2", {"name": "scaffold", "server_lr": step}, rounds=2)
    avg2 = _run(tmp_path / "fedavg2", {"name": "fedavg", "server_lr": step}, rounds=2)
    key = "classifier.weight"
    gap = two.server.global_arrays[key] - avg2.server.global_arrays[key]
    assert float(gap.abs().max()) > 1e-6


# The hand example: a bias-free Linear(2 -> 2) in float64, one sample x = (1, 2) of class 0,
# batch 1, two local epochs (K = 2 steps), lr = 0.5, from x_server = W0 = 0.
LR = 0.5
X = (1.0, 2.0)
C = [[0.1, 0.0], [0.0, -0.2]]  # server control variate c
C_I = [[0.0, 0.3], [0.1, 0.0]]  # the client's c_i from an earlier round


def _softmax_grad(w: list[list[float]]) -> list[list[float]]:
    """∂CE/∂W for logits W·x and class 0, written out: (softmax(Wx) − e_0) xᵀ."""
    logits = [w[0][0] * X[0] + w[0][1] * X[1], w[1][0] * X[0] + w[1][1] * X[1]]
    top = max(logits)
    e = [math.exp(v - top) for v in logits]
    s = [v / sum(e) for v in e]
    return [[(s[0] - 1) * X[0], (s[0] - 1) * X[1]], [s[1] * X[0], s[1] * X[1]]]


def _step(w: list[list[float]]) -> list[list[float]]:
    """y ← y − lr·(g − c_i + c)."""
    g = _softmax_grad(w)
    return [[w[r][k] - LR * (g[r][k] - C_I[r][k] + C[r][k]) for k in range(2)] for r in range(2)]


def test_two_corrected_steps_and_the_option_ii_control_variate_by_hand():
    """Catches a correction of the wrong sign (g + c_i − c), one left out, c_i not read from the
    client's state, K or lr missing from c_i⁺ = c_i − c + (x − y)/(K·lr), or a wrong Δc_i."""
    # step 1 from W0 = 0 (uniform softmax): g = [[-0.5, -1], [0.5, 1]], so g − c_i + c =
    # [[-0.4, -1.3], [0.4, 0.8]] and y1 = [[0.2, 0.65], [-0.2, -0.4]]
    y1 = _step([[0.0, 0.0], [0.0, 0.0]])
    assert [*y1[0], *y1[1]] == pytest.approx([0.2, 0.65, -0.2, -0.4], abs=1e-15)
    y2 = _step(y1)  # logits y1·x = (1.5, -1.0)
    # option II with K = 2, lr = 0.5: c_i⁺ = c_i − c + (0 − y2)/(2·0.5)
    c_new = [[C_I[r][k] - C[r][k] - y2[r][k] for k in range(2)] for r in range(2)]

    model = nn.Linear(2, 2, bias=False).double()
    state = Message("state", {CLIENT_C: torch.tensor(C_I, dtype=torch.float64).reshape(-1)})
    ctx = ClientContext(
        cid=0,
        rnd=2,
        model=model,
        train=ClientData(torch.tensor([X], dtype=torch.float64), torch.tensor([0])),
        val=ClientData(torch.zeros(0, 2, dtype=torch.float64), torch.zeros(0, dtype=torch.long)),
        state=state,
        generator=torch.Generator().manual_seed(0),
        local_epochs=2,
        batch_size=1,
        make_optimizer=lambda params, lr: torch.optim.SGD(params, lr=lr),
        lr=LR,
    )
    msg = Message(
        "fit",
        {
            "weight": torch.zeros(2, 2, dtype=torch.float64),
            SERVER_C: torch.tensor(C, dtype=torch.float64).reshape(1, -1),
        },
    )
    reply = ScaffoldClient(ScaffoldHparams()).run(msg, ctx)
    as_tensor = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731
    torch.testing.assert_close(reply.arrays["weight"], as_tensor(y2), rtol=0, atol=1e-14)
    torch.testing.assert_close(
        state.arrays[CLIENT_C], as_tensor(c_new).reshape(-1), rtol=0, atol=1e-14
    )
    delta = [[c_new[r][k] - C_I[r][k] for k in range(2)] for r in range(2)]
    torch.testing.assert_close(
        reply.arrays[DELTA_C], as_tensor(delta).reshape(1, -1), rtol=0, atol=1e-14
    )
    assert set(reply.arrays) == {"weight", DELTA_C}
    assert reply.scalars["num_examples"] == 1
    # the hooks are gone: a plain backward on the shared model sees the plain gradient
    model.zero_grad()
    inputs = torch.tensor([X], dtype=torch.float64)
    nn.functional.cross_entropy(model(inputs), torch.tensor([0])).backward()
    torch.testing.assert_close(model.weight.grad, as_tensor(_softmax_grad(y2)), rtol=0, atol=1e-14)


def test_the_server_moves_x_by_the_weighted_mean_and_c_by_the_sum_over_n():
    """Catches c averaged over the participants (|S|) instead of divided by N, c weighted by
    samples, or x moved by an unweighted mean.

    By hand: N = 4 clients, two reply (3 and 1 samples). x = (1, 1, 1, 1, 1, 1), y_1 = x + 4,
    y_2 = x − 4: the weighted mean is x + 2, so with η_g = 0.5 x ← x + 1 = 2. c = 0.2 everywhere,
    Δc_1 = 1, Δc_2 = 3: c ← 0.2 + (1 + 3)/4 = 1.2."""
    ctx = ServerContext(lambda: nn.Linear(2, 2), n_clients=4, seed=0, rounds=1)
    server = ScaffoldServer(ctx, ScaffoldHparams(server_lr=0.5))
    server.global_arrays = {"weight": torch.ones(2, 2), "bias": torch.ones(2)}
    server.control = torch.full((6,), 0.2)
    sent = server.configure(1, [0, 1])[0]
    assert torch.equal(sent.arrays[SERVER_C], torch.full((1, 6), 0.2))

    def reply(shift: float, dc: float, n: int) -> Message:
        arrays = {"weight": torch.full((2, 2), 1 + shift), "bias": torch.full((2,), 1 + shift)}
        return Message("fit", {**arrays, DELTA_C: torch.full((1, 6), dc)}, {"num_examples": n})

    server.aggregate(1, iter([(0, reply(4.0, 1.0, 3)), (1, reply(-4.0, 3.0, 1))]))
    assert torch.equal(server.global_arrays["weight"], torch.full((2, 2), 2.0))
    assert torch.equal(server.global_arrays["bias"], torch.full((2,), 2.0))
    torch.testing.assert_close(server.control, torch.full((6,), 1.2), rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"train__optimizer": "adam"}, "train.optimizer"),
        ({"train__momentum": 0.9}, "train.momentum"),
        (  # as another aggregator's client part, its own check still applies
            {"algorithm": {"name": "fedavg", "client": "scaffold"}, "train__optimizer": "adam"},
            "train.optimizer",
        ),
        ({"topology__stations": 2}, "topology.stations"),
        ({"algorithm": {"name": "scaffold", "server_lr": 0.0}}, "algorithm.server_lr"),
    ],
)
def test_settings_scaffold_cannot_run_with_are_refused_at_config_time(overrides, key):
    """Catches Adam or momentum accepted (option II's c_i assumes y ← y − lr·g), stations, or a
    non-positive global step."""
    overrides = {"algorithm": "scaffold", **overrides}
    with pytest.raises(ConfigError, match=rf"'{key}'"):
        tiny_config(**overrides)


def test_scaffold_as_another_aggregators_client_part_stops_with_a_clear_error(tmp_path):
    """Catches SCAFFOLD's client silently training without a server control variate."""
    cfg = tiny_config(rounds=1, algorithm={"name": "fedavg", "client": {"name": "scaffold"}})
    with pytest.raises(ConfigError, match="needs scaffold's server"):
        Simulation(cfg, uneven_federation(cfg), tmp_path).run()


def test_the_baseline_config_trains_with_plain_sgd():
    """Catches the shipped example set to an optimiser SCAFFOLD refuses."""
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs/baselines/scaffold.yaml")
    assert cfg.algorithm.name == "scaffold"
    assert (cfg.train.optimizer, cfg.train.momentum) == ("sgd", 0.0)
    assert (cfg.dataset.name, cfg.model.name, cfg.rounds) == ("pacs", "lenet5", 100)
