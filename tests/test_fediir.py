"""FedIIR (feddomain/algorithms/fediir.py): its reduction to FedAvg, ḡ against a float64 EMA of
gradients computed here with autograd, the penalty on a hand-made model, the double-backprop
gradient, the station variant, SIGKILL resume and its hyper-parameter checks. Expected values
never come from the code under test.

Tolerances: the clients compute gradients in float32, the references here in float64; a batch
gradient is a mean of at most 16 products of O(1) numbers, so each entry is within ~1e-6
relative of the reference, and ``rtol=1e-5`` is still far below any planted fault.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from feddomain.algorithms.fediir import (
    GRAD_MEAN,
    GRAD_TASK,
    FedIIRHparams,
    _require_split,
    fediir_loss,
)
from feddomain.errors import ConfigError, FeddomainError
from feddomain.federation.simulation import Simulation
from feddomain.federation.topology import CLIENT_PRE_ROUND, generator
from feddomain.models import build_model
from feddomain.models.base import FeatureClassifier
from tests.engine_helpers import run_sim, tiny_config, tiny_federation
from tests.resume_helpers import (
    assert_resumed_equals,
    kill_after_checkpoint,
    resume,
    run_to_end,
    write_config,
)
from tests.test_evidence_engine import uneven_federation

BETA = 0.95


def _scores(record: dict) -> dict:
    """A metrics record without what FedIIR adds by design (ḡ's bytes, its norm) or wall time."""
    extra = ("time", "diagnostics", "ledger", "bytes_up", "bytes_down")
    return {k: v for k, v in record.items() if k not in extra}


def _flat(grads) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def _spy_execute(sim: Simulation) -> list[tuple]:
    """Record every task a client runs: (cid, round, station round, task, arrays)."""
    seen: list[tuple] = []
    execute = sim.execute

    def spy(cid, rnd, msg, station_round=0, purpose=0):
        seen.append(
            (cid, rnd, station_round, msg.task, {k: v.clone() for k, v in msg.arrays.items()})
        )
        return execute(cid, rnd, msg, station_round, purpose)

    sim.execute = spy
    return seen


# ------------------------------------------------------------------------------ reductions
def test_with_gamma_zero_fediir_is_fedavg_exactly(tmp_path):
    """Catches: the pre-task or ḡ's broadcast perturbing training (model, RNG streams), or a
    penalty that is not zero at γ = 0 (unequal clients, several rounds, Adam)."""
    runs = {}
    for name, algorithm in [("fedavg", "fedavg"), ("fediir", {"name": "fediir", "gamma": 0.0})]:
        cfg = tiny_config(rounds=3, algorithm=algorithm, train__optimizer="adam")
        runs[name] = run_sim(cfg, tmp_path / name, uneven_federation(cfg))
    assert runs["fediir"].server.grad_ema is not None  # the pre-task ran
    for k, v in runs["fedavg"].server.global_arrays.items():
        assert torch.equal(runs["fediir"].server.global_arrays[k], v), k
    records = [[_scores(r) for r in runs[n].records] for n in ("fedavg", "fediir")]
    assert records[0] == records[1]


@pytest.mark.parametrize("mean", ["batches", "clients"])
def test_grad_mean_is_the_ema_of_the_clients_mean_classifier_gradients(mean, tmp_path):
    """Catches: ḡ averaged with the wrong weights (per batch vs per client), an EMA with β on
    the new value, a missing or reset EMA state, gradients taken at another model than the
    current global one, and clients receiving anything but ḡ (clients of 36,
    18 and 9 samples in batches of 16: 6 batches, 3 of them ragged)."""
    cfg = tiny_config(
        rounds=3,
        algorithm={"name": "fediir", "gamma": 0.5, "grad_mean": mean},
        train__batch_size=16,
    )
    fed = uneven_federation(cfg)
    sim = Simulation(cfg, fed, tmp_path)
    tasks = _spy_execute(sim)
    emas, globals_at_start = [], []
    on_pre_round, pre_round = sim.server.on_pre_round, sim.server.pre_round

    def at_start(rnd, clients):  # the server's global model when the round begins
        globals_at_start.append({k: v.clone() for k, v in sim.server.global_arrays.items()})
        return pre_round(rnd, clients)

    def spy(rnd, replies):
        on_pre_round(rnd, replies)
        emas.append(sim.server.grad_ema.clone())

    sim.server.on_pre_round, sim.server.pre_round = spy, at_start
    sim.run()

    expected = torch.zeros(3 * 84 + 3, dtype=torch.float64)
    for rnd in (1, 2, 3):
        model = build_model("lenet5", 3).double()
        model.load_state_dict({k: v.double() for k, v in globals_at_start[rnd - 1].items()})
        model.train()
        per_client = []
        for cid in range(3):
            batches = fed.train[cid].batches(16, generator(cfg.seed, CLIENT_PRE_ROUND, rnd, cid, 0))
            grads = []
            for x, y in batches:
                loss = F.cross_entropy(model(x.double()), y)
                grads.append(_flat(torch.autograd.grad(loss, list(model.classifier.parameters()))))
            per_client.append(grads)
        by_batch = torch.stack([g for grads in per_client for g in grads]).mean(0)
        by_client = torch.stack([torch.stack(g).mean(0) for g in per_client]).mean(0)
        assert not torch.allclose(by_batch, by_client, rtol=1e-3)  # the choice matters here
        expected = BETA * expected + (1 - BETA) * (by_batch if mean == "batches" else by_client)
        torch.testing.assert_close(emas[rnd - 1], expected, rtol=1e-5, atol=1e-9)
        for _cid, r, _, task, arrays in tasks:
            if r == rnd and task == "fit":
                assert torch.equal(arrays[GRAD_MEAN], emas[rnd - 1].float())


def test_the_pre_task_model_is_the_global_model_of_that_round(tmp_path):
    """Catches: ḡ computed on a stale model (the previous round's) instead of the one the
    round's clients then train from."""
    cfg = tiny_config(rounds=2, algorithm={"name": "fediir", "gamma": 0.5})
    sim = Simulation(cfg, tiny_federation(cfg), tmp_path)
    tasks = _spy_execute(sim)
    sim.run()
    for cid, rnd, _, task, arrays in tasks:
        if task == GRAD_TASK:
            fit = next(a for c, r, _, t, a in tasks if (c, r, t) == (cid, rnd, "fit"))
            assert set(fit) == {*arrays, GRAD_MEAN}
            for k, v in arrays.items():
                assert torch.equal(fit[k], v), k
    assert {t for *_, t, _ in tasks} == {GRAD_TASK, "fit"}


# ------------------------------------------------------------------------------ the penalty
def test_the_penalty_on_a_hand_made_model():
    """Catches: a wrong penalty (mean instead of sum, missing bias, ḡ not subtracted, γ not
    applied) — by hand: x = (1, 2), y = 0, W = 0, b = 0 give p = (½, ½), ∇W = [[-½, -1], [½, 1]],
    ∇b = (-½, ½); with ḡ = (W: [[1, 0], [0, 0]], b: (0, -1)) the penalty is 4.5 + 2.5 = 7."""
    classifier = nn.Linear(2, 2).double()
    with torch.no_grad():
        classifier.weight.zero_()
        classifier.bias.zero_()
    model = FeatureClassifier(nn.Identity(), classifier, 2)
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    y = torch.tensor([0])
    grad_mean = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, -1.0])
    gamma = 0.3
    loss = fediir_loss(gamma, grad_mean)(model, x, y)
    assert float(loss.detach()) == pytest.approx(math.log(2) + gamma * 7.0, rel=1e-14)


def test_the_double_backprop_gradient_equals_finite_differences():
    """Catches: a penalty cut from the graph (no double backprop: the featurizer would not feel
    it) or a wrong gradient of it — every parameter's gradient of CE + γ·penalty, float64,
    against central finite differences of the loss's value."""
    torch.manual_seed(0)
    featurizer = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
    model = FeatureClassifier(featurizer, nn.Linear(4, 3), 4).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 1, 0])
    grad_mean = torch.randn(4 * 3 + 3, dtype=torch.float64) * 0.1
    loss_fn = fediir_loss(2.0, grad_mean)
    params = list(model.parameters())
    analytic = torch.autograd.grad(loss_fn(model, x, y), params)
    h = 1e-6

    def loss_at(p: nn.Parameter, i: int, step: float) -> float:
        with torch.no_grad():
            p.view(-1)[i] += step
        value = float(loss_fn(model, x, y).detach())  # needs autograd: not under no_grad
        with torch.no_grad():
            p.view(-1)[i] -= step
        return value

    for p, grad in zip(params, analytic, strict=True):
        numeric = torch.tensor(
            [(loss_at(p, i, h) - loss_at(p, i, -h)) / (2 * h) for i in range(p.numel())],
            dtype=torch.float64,
        )
        torch.testing.assert_close(grad, numeric.view_as(p), rtol=1e-6, atol=1e-8)
    without_penalty = torch.autograd.grad(F.cross_entropy(model(x), y), params)
    assert not torch.allclose(analytic[0], without_penalty[0])  # the penalty reaches layer 1


# ------------------------------------------------------------------------------ stations
def test_each_station_keeps_the_ema_of_its_own_clients_on_its_current_model(tmp_path):
    """Catches: a station EMA over other stations' clients, not updated before every station
    round, computed on the server's model after the first station round, or not sent down
    (2 stations over 3 clients, 2 rounds x 2 station rounds; float64 EMA recomputed here)."""
    cfg = tiny_config(
        rounds=2,
        algorithm={"name": "fediir", "gamma": 0.5},
        topology__stations=2,
        topology__station_rounds=2,
    )
    sim = Simulation(cfg, tiny_federation(cfg), tmp_path)
    tasks = _spy_execute(sim)
    heard: dict[int, list] = {0: [], 1: []}
    for sid, station in enumerate(sim.stations):
        original = station.on_pre_round

        def spy(rnd, r, replies, sid=sid, original=original, station=station):
            heard[sid].append(dict(replies))
            original(rnd, r, replies)
            heard[sid][-1]["ema"] = station.grad_ema.clone()

        station.on_pre_round = spy
    sim.run()
    assert sim.server.grad_ema is None  # the server asked nothing: stations keep ḡ
    for sid, station in enumerate(sim.stations):
        members = set(station.ctx.clients)
        ema = torch.zeros(3 * 84 + 3, dtype=torch.float64)
        assert len(heard[sid]) == 4
        for step, replies in enumerate(heard[sid]):
            got = replies.pop("ema")
            assert set(replies) == members
            total = sum(m.arrays[GRAD_TASK].double().reshape(-1) for m in replies.values())
            n = sum(int(m.scalars["n_batches"]) for m in replies.values())
            ema = BETA * ema + (1 - BETA) * total / n
            # float64 sums in another order: ~1e-16 relative to the largest entry, so a bound of
            # 1e-12 of it (a near-zero entry's own relative error can be large)
            torch.testing.assert_close(got, ema, rtol=1e-12, atol=1e-12 * float(ema.abs().max()))
            rnd, r = 1 + step // 2, step % 2
            for cid, t_rnd, t_r, task, arrays in tasks:
                if (t_rnd, t_r) != (rnd, r) or cid not in members:
                    continue
                if task == "fit":
                    assert torch.equal(arrays[GRAD_MEAN], got.float())
                    pre = next(
                        a for c, x, y, t, a in tasks if (c, x, y, t) == (cid, rnd, r, GRAD_TASK)
                    )
                    assert all(torch.equal(arrays[k], v) for k, v in pre.items())
        scale = 1e-12 * float(ema.abs().max())
        torch.testing.assert_close(station.state_dict()["grad_ema"], ema, rtol=1e-12, atol=scale)


def test_with_hierarchical_server_the_stations_pass_the_servers_grad_mean_on(tmp_path):
    """Catches: the server-level variant's ḡ lost after the first station round (the station's
    aggregate replaces the server's message) or replaced by a station's own."""
    cfg = tiny_config(
        rounds=2,
        algorithm={"name": "fediir", "gamma": 0.5, "hierarchical": "server"},
        topology__stations=2,
        topology__station_rounds=2,
    )
    sim = Simulation(cfg, tiny_federation(cfg), tmp_path)
    tasks = _spy_execute(sim)
    sent = []
    configure = sim.server.configure
    sim.server.configure = lambda rnd, units: sent.append(configure(rnd, units)) or sent[-1]
    sim.run()
    assert all(s.grad_ema is None for s in sim.stations)
    fits = [(rnd, r, a) for _, rnd, r, task, a in tasks if task == "fit"]
    assert {r for _, r, _ in fits} == {0, 1}
    for rnd, _, arrays in fits:
        (server_msg,) = {id(m): m for m in sent[rnd - 1].values()}.values()
        assert torch.equal(arrays[GRAD_MEAN], server_msg.arrays[GRAD_MEAN])
    pre_tasks = [(rnd, r) for _, rnd, r, task, _ in tasks if task == GRAD_TASK]
    assert {r for _, r in pre_tasks} == {0} and len(pre_tasks) == 2 * 3  # once a global round


# ------------------------------------------------------------------------------ refusals
def test_as_another_aggregators_client_part_it_stops_by_name(tmp_path):
    """Catches: FedIIR's clients silently training with ḡ = 0 under an aggregator that never
    computes ḡ."""
    cfg = tiny_config(rounds=1, algorithm={"name": "fedavg", "client": {"name": "fediir"}})
    with pytest.raises(FeddomainError, match="cannot be the client part of another aggregator"):
        run_sim(cfg, tmp_path)


def test_a_model_without_the_split_is_refused_by_name():
    """Catches: FedIIR accepting a model whose classifier it cannot find."""
    with pytest.raises(ConfigError, match="Sequential has no such split"):
        _require_split(nn.Sequential(nn.Linear(2, 2)), FedIIRHparams())


@pytest.mark.parametrize(
    ("algorithm", "key"),
    [
        ({"name": "fediir", "gamma": -1e-3}, "'algorithm.gamma'"),
        ({"name": "fediir", "ema": 1.5}, "'algorithm.ema'"),
        ({"name": "fediir", "ema": -0.1}, "'algorithm.ema'"),
        ({"name": "fediir", "grad_mean": "samples"}, "'algorithm.grad_mean'"),
        ({"name": "fediir", "hierarchical": "client"}, "'algorithm.hierarchical'"),
    ],
)
def test_bad_hyper_parameters_are_refused_at_config_time_by_key(algorithm, key):
    """Catches: a negative penalty or an EMA weight outside [0, 1] accepted (or refused without
    naming the key)."""
    with pytest.raises(ConfigError, match=key):
        tiny_config(algorithm=algorithm)


# ------------------------------------------------------------------------------ resume
RESUME = {
    "seed": 4,
    "rounds": 5,
    "dataset": {"name": "digits_embedded", "resolution": 16},
    "split": {"scheme": "lodo", "targets": ["grey"]},
    "model": {"name": "lenet5"},
    "algorithm": {"name": "fediir", "gamma": 0.1},
    "train": {"batch_size": 64, "optimizer": "adam", "lr": 0.002},
    "eval": {"every": 1},
    "checkpoint": {"every": 1},
    "threads": 1,
}
TOPOLOGIES = {
    "flat": {"partition": {"n_clients": 3, "d": 1}},
    "stations": {
        "partition": {"name": "lambda", "n_clients": 4, "lam": 0.5},
        "topology": {"stations": 2, "station_rounds": 2},
    },
}


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_sigkill_then_resume_matches_the_uninterrupted_run(topology, tmp_path):
    """Catches: ḡ's EMA (server state, or each station's) missing from the checkpoint or not
    restored after a SIGKILLed `feddomain run --resume` (ḡ would restart from 0)."""
    config = tmp_path / "fediir.yaml"
    write_config(config, {"name": f"fediir-resume-{topology}", **RESUME, **TOPOLOGIES[topology]})
    run_to_end(config, tmp_path / "reference")
    out = tmp_path / "killed"
    saved = kill_after_checkpoint(config, out)
    assert 1 <= saved["round"] < RESUME["rounds"]
    if topology == "flat":
        assert saved["server"]["grad_ema"] is not None
    else:
        assert all(s["grad_ema"] is not None for s in saved["stations"])

    resume(out)
    assert_resumed_equals(out, tmp_path / "reference")
