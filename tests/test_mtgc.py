"""MTGC (Fang et al., NeurIPS 2024): the reduction to +Avg, one corrected step and the two
correction updates by hand, what its clients may send, bad configurations, SIGKILL resume and
Flower parity."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import feddomain.algorithms.mtgc as mtgc
from feddomain.algorithms.base import ClientContext, StationContext
from feddomain.errors import ConfigError
from feddomain.federation.data import ClientData
from feddomain.federation.messages import Message
from feddomain.federation.privacy import PrivacyViolation, UploadCheck
from feddomain.federation.training import get_arrays
from tests.engine_helpers import run_sim
from tests.resume_helpers import (
    assert_resumed_equals,
    kill_after_checkpoint,
    resume,
    run_to_end,
    station_resume_config,
    write_config,
)
from tests.test_flower import (
    assert_same_run,
    demo_config,
    deploy_loopback,
    simulate,
    task_identity,  # noqa: F401 - a fixture the Flower test uses
)
from tests.test_hfedatm import assert_same_arrays, hierarchical

LR = 0.1


def linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(2, 3).double()


def context(model: nn.Module, data: ClientData, state: Message, rnd: int, r: int, batch: int):
    return ClientContext(
        cid=0,
        rnd=rnd,
        model=model,
        train=data,
        val=data,
        state=state,
        generator=torch.Generator().manual_seed(rnd * 10 + r),
        local_epochs=1,
        batch_size=batch,
        make_optimizer=lambda params, lr: torch.optim.SGD(params, lr=lr),
        station_round=r,
        station_rounds=3,
        lr=LR,
    )


def flat(arrays: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([arrays["weight"].reshape(-1), arrays["bias"]])


def gradient(model: nn.Module, at: torch.Tensor, data: ClientData) -> torch.Tensor:
    """∇F_i at ``at`` over the whole client set (one full batch), by autograd on a copy."""
    probe = nn.Linear(2, 3).double()
    probe.weight.data, probe.bias.data = at[:6].view(3, 2).clone(), at[6:].clone()
    loss = nn.functional.cross_entropy(probe(data.inputs), data.labels)
    loss.backward()
    return torch.cat([probe.weight.grad.reshape(-1), probe.bias.grad])


def test_reduction_without_corrections_is_plus_avg_bit_for_bit(tmp_path):
    """Catches: MTGC's aggregation drifting from +Avg (another station or server weighting, an
    extra or lost update, another seed stream) — with β_z = β_y = 0 both corrections stay 0 and
    the run must equal hfedavg exactly, on clients of unequal size (36 and 18 per station); and
    corrections that never act: with the paper's β = 1 the model differs and y_j ≠ 0."""
    plus_avg = run_sim(hierarchical({"name": "hfedavg"}), tmp_path / "avg")
    off = {"name": "mtgc", "client_correction": 0.0, "station_correction": 0.0}
    reduced = run_sim(hierarchical(off), tmp_path / "off")
    assert [len(plus_avg.data.train[c]) for c in range(4)] == [36, 18, 36, 18]
    assert_same_arrays(reduced.server.global_arrays, plus_avg.server.global_arrays)
    full = run_sim(hierarchical({"name": "mtgc"}), tmp_path / "on")
    key = "classifier.weight"
    assert not torch.equal(full.server.global_arrays[key], plus_avg.server.global_arrays[key])
    assert all(bool(s.inner.y.abs().max() > 0) for s in full.stations)


def test_one_corrected_step_and_the_client_correction_update_by_hand():
    """Catches: the correction missing from the step or entering with the wrong sign, z_i not
    moved by β_z·(x_i − x̄_j)/(H_i·γ) after the station aggregation (another divisor than the
    client's own steps × lr, β_z ignored, the sign flipped), z_i not reset to 0 at the next
    global round, H_i·γ not reported, or z_i kept after the last station round (memory and
    checkpoints). Expected values by the paper's rules, with ∇F_i by autograd on a separate
    copy."""
    client = mtgc.MTGCClient(mtgc.MTGCHparams(client_correction=0.5))
    model = linear()  # parameters: weight [3, 2], bias [3], flat in that order
    data = ClientData(
        torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, -1.0]], dtype=torch.float64),
        torch.tensor([0, 1, 2]),
    )
    state = Message()
    y = torch.tensor([0.3, -0.1, 0.2, 0.0, -0.4, 0.1, 0.05, -0.05, 0.2], dtype=torch.float64)

    def fit(rnd: int, r: int, station: torch.Tensor, batch: int) -> Message:
        arrays = {"weight": station[:6].view(3, 2), "bias": station[6:]}
        msg = Message("fit", {**arrays, mtgc.STATION_Y: y.view(1, -1)})
        return client.run(msg, context(model, data, state, rnd, r, batch))

    x0 = flat(get_arrays(linear()))
    first = fit(1, 0, x0, batch=2)  # H_i = 2 steps (batches of 2 and 1)
    assert first.scalars[mtgc.STEP_LENGTH] == pytest.approx(2 * LR)
    x1 = flat(first.arrays)
    station = x0 + torch.linspace(-0.2, 0.2, 9, dtype=torch.float64)  # x̄_j of station round 1
    second = fit(1, 1, station, batch=3)  # one full batch: one step, checked by hand
    z = 0.5 * (x1 - station) / (2 * LR)
    assert torch.allclose(state.arrays[mtgc.CLIENT_Z], z, atol=1e-12)
    want = station - LR * (gradient(model, station, data) + z + y)
    assert torch.allclose(flat(second.arrays), want, atol=1e-12)
    third = fit(2, 0, station, batch=3)  # a new global round: z_i = 0 again
    want = station - LR * (gradient(model, station, data) + y)
    assert torch.allclose(flat(third.arrays), want, atol=1e-12)
    fit(2, 1, station, batch=3)
    fit(2, 2, station, batch=3)  # the last station round: the client keeps no correction
    assert not state.arrays and not state.scalars


def test_the_station_correction_update_by_hand():
    """Catches: y_j not moved by β_y·(x̄_j − x̄)/(Σ_e Σ_i p_i H_i γ) when the next global model
    arrives (clients weighted equally instead of by samples, one station round's length instead
    of their sum, β_y ignored, the sign flipped), y_j not sent down, and the station model not
    the sample-weighted mean. Two clients of 3 and 1 samples, two station rounds."""
    hp = mtgc.MTGCHparams(station_correction=2.0)
    station = mtgc.MTGCStation(StationContext(0, (0, 1), 2, 0, linear), hp)
    zeros = {k: torch.zeros_like(v) for k, v in get_arrays(linear()).items()}

    def reply(fill: float, n: int, length: float) -> Message:
        arrays = {k: torch.full_like(v, fill) for k, v in zeros.items()}
        return Message("fit", arrays, {"num_examples": n, mtgc.STEP_LENGTH: length})

    station.begin(1, Message("fit", zeros))
    assert torch.equal(station.downlink(1, 0).arrays[mtgc.STATION_Y], torch.zeros(1, 9).double())
    station.aggregate(1, 0, iter([(0, reply(1.0, 3, 0.2)), (1, reply(5.0, 1, 0.1))]))
    assert torch.equal(station.downlink(1, 1).arrays["bias"], torch.full((3,), 2.0).double())
    station.aggregate(1, 1, iter([(0, reply(2.0, 3, 0.4)), (1, reply(6.0, 1, 0.2))]))
    up = station.uplink(1)
    assert torch.equal(up.arrays["weight"], torch.full((3, 2), 3.0).double())  # (3·2 + 6)/4
    global_model = {k: torch.full_like(v, 1.5) for k, v in zeros.items()}
    station.begin(2, Message("fit", global_model))
    length = (3 * 0.2 + 0.1) / 4 + (3 * 0.4 + 0.2) / 4
    want = torch.full((1, 9), 2.0 * (3.0 - 1.5) / length, dtype=torch.float64)
    assert torch.allclose(station.downlink(2, 0).arrays[mtgc.STATION_Y], want, atol=1e-12)


def test_clients_send_only_what_they_declare_and_keep_z(tmp_path):
    """Catches: z_i (or anything else undeclared) leaving the client, the declaration missing
    what a reply holds (the privacy contract would stop every run), and a ledger counting other
    than the declared model and scalars on the client-station link, or y_j not counted as
    statistics going down (expected bytes from the model alone: 4 clients x R station rounds)."""
    client = mtgc.MTGCClient(mtgc.MTGCHparams())
    model = linear()
    data = ClientData(torch.randn(4, 2, dtype=torch.float64), torch.tensor([0, 1, 2, 0]))
    arrays = get_arrays(model)
    msg = Message("fit", {**arrays, mtgc.STATION_Y: torch.zeros(1, 9, dtype=torch.float64)})
    reply = client.run(msg, context(model, data, Message(), 1, 0, 2))
    shapes = {k: v.shape for k, v in arrays.items()}
    check = UploadCheck("mtgc", client.uploads(4), shapes)
    check.check(0, reply, len(data))
    assert set(reply.arrays) == set(arrays)
    leaked = Message("fit", {**reply.arrays, mtgc.CLIENT_Z: torch.zeros(1, 9)}, reply.scalars)
    with pytest.raises(PrivacyViolation, match="mtgc_z"):
        check.check(0, leaked, len(data))
    sim = run_sim(hierarchical({"name": "mtgc"}), tmp_path)
    model_bytes = sum(4 * v.numel() for v in sim.model.state_dict().values())
    y_bytes = sum(4 * p.numel() for p in sim.model.parameters())
    rounds = [json.loads(x) for x in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    for record in rounds:
        link = record["links"]["client-station"]
        assert link["up"] == {"model": 8 * model_bytes, "statistics": 0, "scalars": 8 * 3 * 8}
        down = {"model": 8 * model_bytes, "statistics": 8 * y_bytes, "scalars": 4 * 8}
        assert link["down"] == down  # scalars: the station's sample count, in station round 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"topology": {}}, r"'topology.stations'"),
        ({"topology": {"stations": 2, "sample_fraction": 0.5}}, r"'topology.sample_fraction'"),
        ({"train": {"optimizer": "adam", "lr": 0.01}}, r"'train.optimizer' = 'adam'"),
        ({"train": {"optimizer": "sgd", "momentum": 0.9}}, r"'train.momentum' = 0.9"),
        ({"algorithm": {"name": "mtgc", "client_correction": -1}}, "client_correction"),
    ],
)
def test_bad_configurations_are_refused_naming_the_key(overrides, message):
    """Catches: a flat federation, sampled stations, an optimiser other than plain SGD or a
    negative correction step reaching a run instead of a config error naming the key."""
    with pytest.raises(ConfigError, match=message):
        hierarchical(**{"algorithm": {"name": "mtgc"}, **overrides})


def test_sigkill_then_resume_matches_the_uninterrupted_run(tmp_path):
    """Catches: the stations' y_j, the model they last sent up or its step length lost or stale
    across a SIGKILL and --resume (y_j's next update would differ)."""
    config = station_resume_config("mtgc", {"name": "mtgc"}, rounds=3, eval_every=3)
    path = write_config(tmp_path / "mtgc.yaml", config)
    run_to_end(path, tmp_path / "reference")
    out = tmp_path / "killed"
    state = kill_after_checkpoint(path, out, min_round=1)
    assert state["round"] < 3
    assert all(s["sent"] is not None and s["sent_length"] > 0 for s in state["stations"])
    resume(out)
    assert_resumed_equals(out, tmp_path / "reference")


@pytest.mark.usefixtures("task_identity")
def test_on_flower_equals_the_simulator(tmp_path):
    """Catches: y_j or z_i working in-process only (the stations live in the ServerApp, z_i in
    the nodes' state on Flower), or the step lengths lost in transport: final server state,
    metrics and summary equal the simulator's."""
    cfg = demo_config(
        "algorithm.name=mtgc",
        "train.optimizer=sgd",
        "train.lr=0.05",
        "partition.n_clients=4",
        "topology.stations=2",
        "topology.station_rounds=2",
    )
    sim = simulate(cfg, tmp_path / "sim")
    deploy_loopback(cfg, tmp_path / "flower")
    assert_same_run(tmp_path / "flower", sim, tmp_path / "sim")
    assert all(bool(s.inner.y.abs().max() > 0) for s in sim.stations)
