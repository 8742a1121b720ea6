"""Stations as participants: one station part per station, with its own downlink and uplink, a
pre-round task for its clients, state checkpointed with the run, bytes counted per link, and the
same behaviour on Flower (stations in the ServerApp, their tasks on the nodes)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from flwr.supercore.task_identity import TaskIdentity

from feddomain.algorithms import METHODS, register
from feddomain.algorithms.base import (
    ClientContext,
    Hparams,
    MethodSpec,
    Plan,
    ServerContext,
    StationAlgorithm,
    StationContext,
)
from feddomain.algorithms.fedavg import FedAvgClient, FedAvgHparams, FedAvgServer
from feddomain.config import ExperimentConfig
from feddomain.evaluation.report import build_report
from feddomain.federation import checkpoint
from feddomain.federation.flower.records import load_state
from feddomain.federation.messages import Message
from feddomain.federation.privacy import PrivacyViolation, Uploads
from feddomain.federation.simulation import Simulation
from feddomain.federation.topology import CLIENT_PRE_ROUND, generator
from tests.engine_helpers import run_sim, tiny_config, tiny_federation
from tests.resume_helpers import (
    assert_resumed_equals,
    kill_after_checkpoint,
    metrics_of,
    resume,
    run_to_end,
    write_config,
)
from tests.test_flower import assert_same_run, demo_config, deploy_loopback, simulate

PROJECT = Path(__file__).resolve().parents[1]
PROBE = "_station_probe"
R = 2  # station rounds per server round


def stat_of(n_train: int, cid: int, rnd: int, r: int, gen: torch.Generator) -> float:
    """The statistic client ``cid`` reports before station round ``r`` of round ``rnd``: its
    sample count, its place, and an integer drawn from the task's generator (so the task's seed
    shows); integers, so that sums and means are exact in float64."""
    draw = int(torch.randint(0, 2**20, (1,), generator=gen))
    return float(n_train + 10 * cid + 1000 * rnd + 100 * r + 10_000 * draw)


class ProbeClient(FedAvgClient):
    """FedAvg's client that answers its station's "report" task with one statistic, and keeps in
    its state every station mean it was sent and the names of everything it ever received."""

    def run(self, msg: Message, ctx: ClientContext) -> Message:
        if msg.task == "report":
            r = int(msg.scalars["r"])
            value = stat_of(len(ctx.train), ctx.cid, ctx.rnd, r, ctx.generator)
            return Message("report", {"stat": torch.tensor([value], dtype=torch.float64)})
        state = ctx.state.scalars
        state["heard"] = [*state.get("heard", []), float(msg.scalars.get("mean", -1.0))]
        state["seen"] = sorted({*state.get("seen", []), *msg.scalars, *msg.arrays})
        return super().run(msg, ctx)

    def uploads(self, n_clients: int) -> Uploads:
        return Uploads(("*",), {"stat": (1,)}, ("num_examples", "loss"))


class ProbeStation(StationAlgorithm):
    """Asks its clients for a statistic before every station round and sends them its mean with
    the model; uploads the model plus what its clients never see: a 'count' statistic and its
    running state (station rounds so far, an EMA of the means), which it checkpoints."""

    def __init__(self, ctx: StationContext, hp: Hparams) -> None:
        super().__init__(ctx, hp)
        self.steps, self.ema, self.mean = 0, 0.0, 0.0
        self.sent: list[Message] = []  # its uplinks, as it made them

    def pre_round(self, rnd: int, r: int, clients: list[int]) -> Plan:
        return {c: Message("report", scalars={"r": r}) for c in clients}

    def on_pre_round(self, rnd: int, r: int, replies: dict[int, Message]) -> None:
        self.mean = float(torch.cat([m.arrays["stat"] for m in replies.values()]).mean())
        self.ema = 0.5 * self.ema + 0.5 * self.mean

    def downlink(self, rnd: int, r: int) -> Message:
        model = super().downlink(rnd, r)
        return Message(model.task, model.arrays, {**model.scalars, "mean": self.mean})

    def aggregate(self, rnd: int, r: int, replies: Iterator[tuple[int, Message]]) -> None:
        super().aggregate(rnd, r, replies)
        self.steps += 1

    def uplink(self, rnd: int) -> Message:
        model = self.current
        count = torch.tensor([len(self.ctx.clients), self.steps], dtype=torch.float64)
        scalars = {**model.scalars, "steps": self.steps, "ema": self.ema}
        self.sent.append(Message("fit", {**model.arrays, "count": count}, scalars))
        return self.sent[-1]

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "ema": self.ema}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.ema = state["steps"], state["ema"]


class ProbeServer(FedAvgServer):
    """FedAvg over the stations' models that keeps every uplink as it arrived and logs the
    stations' counters and EMAs with each evaluated round (so metrics.jsonl depends on them)."""

    def __init__(self, ctx: ServerContext, hp: Hparams) -> None:
        super().__init__(ctx, hp)
        self.heard: list[dict[int, dict[str, Any]]] = []

    def aggregate(self, rnd: int, replies: Iterator[tuple[int, Message]]) -> None:
        got = dict(replies)
        self.heard.append({s: {"arrays": m.arrays, "scalars": m.scalars} for s, m in got.items()})
        models = {
            s: Message("fit", {k: v for k, v in m.arrays.items() if k != "count"}, m.scalars)
            for s, m in got.items()
        }
        super().aggregate(rnd, iter(models.items()))

    def diagnostics(self) -> dict[str, Any]:
        last = self.heard[-1]
        return {k: [last[s]["scalars"].get(k) for s in sorted(last)] for k in ("steps", "ema")}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "heard": self.heard}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.heard = state["heard"]


SPEC = MethodSpec(PROBE, ProbeServer, ProbeClient, FedAvgHparams, station=ProbeStation)


@pytest.fixture
def probe() -> Iterator[None]:
    """The probe method, registered while the test runs."""
    register(SPEC)
    try:
        yield
    finally:
        del METHODS[PROBE]


def probe_config(**overrides: object) -> ExperimentConfig:
    """5 clients in stations [0, 1, 2] and [3, 4] (60 and 49 training samples)."""
    return tiny_config(
        **{
            "rounds": 2,
            "algorithm": PROBE,
            "partition__n_clients": 5,
            "partition__name": "lambda",
            "partition__lam": 0.5,
            "topology__stations": 2,
            "topology__station_rounds": R,
            **overrides,
        }
    )


def station_means(sim: Simulation, rounds: int) -> dict[tuple[int, int, int], float]:
    """(station, round, station round) -> the mean its clients' statistics must have, by hand."""
    sizes = [len(t) for t in sim.data.train]
    members = [[int(c) for c in s] for s in sim.data.stations or []]

    def stat(c: int, rnd: int, r: int) -> float:
        return stat_of(sizes[c], c, rnd, r, generator(sim.cfg.seed, CLIENT_PRE_ROUND, rnd, c, r))

    return {
        (sid, rnd, r): sum(stat(c, rnd, r) for c in clients) / len(clients)
        for sid, clients in enumerate(members)
        for rnd in range(1, rounds + 1)
        for r in range(R)
    }


def expected_ema(means: dict[tuple[int, int, int], float], sid: int, rounds: int) -> float:
    ema = 0.0
    for rnd in range(1, rounds + 1):
        for r in range(R):
            ema = 0.5 * ema + 0.5 * means[sid, rnd, r]
    return ema


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


# --------------------------------------------------------------------------- the contract
def test_the_server_receives_the_uplink_and_the_clients_the_downlink(probe, tmp_path):
    """Catches: a runner that sends the server what the clients get (the station's aggregate)
    instead of its uplink, or leaks the uplink's extras to the clients."""
    sim = run_sim(probe_config(), tmp_path / "run")
    sizes = [len(t) for t in sim.data.train]
    assert [list(s) for s in sim.data.stations] == [[0, 1, 2], [3, 4]]
    for rnd, heard in enumerate(sim.server.heard, start=1):
        assert sorted(heard) == [0, 1]
        for sid, station in enumerate(sim.stations):
            got, sent = heard[sid], station.sent[rnd - 1]
            assert_same_tensors(got["arrays"], sent.arrays)
            assert got["scalars"] == sent.scalars
            clients = station.ctx.clients
            assert got["scalars"]["num_examples"] == sum(sizes[c] for c in clients)
            assert got["scalars"]["steps"] == R * rnd
            count = torch.tensor([len(clients), R * rnd], dtype=torch.float64)
            assert torch.equal(got["arrays"]["count"], count)
    # the server's model: the sample-weighted mean of the two (unequal) stations' uplinked models
    last = sim.server.heard[-1].values()
    total = sum(h["scalars"]["num_examples"] for h in last)
    for name, value in sim.server.global_arrays.items():
        mean = sum(h["scalars"]["num_examples"] * h["arrays"][name].double() for h in last) / total
        assert torch.allclose(value.double(), mean, atol=1e-6, rtol=0), name
    # the clients got the model and the station's mean, never the uplink's count, steps or EMA
    model_names = set(sim.model.state_dict())
    for state in sim.states:
        assert state.scalars["seen"] == sorted(model_names | {"mean", "num_examples"})


def test_a_pre_round_task_reaches_the_clients_and_its_mean_comes_back_down(probe, tmp_path):
    """Catches: pre-round replies not reaching ``on_pre_round`` (or from another station's
    clients), the station's broadcast reaching its clients in the wrong station round, or the
    task seeded like the training step after it (its draw must come from its own seed)."""
    sim = run_sim(probe_config(), tmp_path / "run")
    means = station_means(sim, rounds=2)
    for sid, station in enumerate(sim.stations):
        for cid in station.ctx.clients:
            expected = [means[sid, rnd, r] for rnd in (1, 2) for r in range(R)]
            assert sim.states[cid].scalars["heard"] == expected, cid


def test_a_reply_to_a_station_is_held_against_the_privacy_declaration(probe, tmp_path):
    """Catches: replies to a station's task bypassing the privacy check that server tasks get."""

    class Undeclared(ProbeClient):
        def uploads(self, n_clients: int) -> Uploads:
            return Uploads(("*",), {}, ("num_examples", "loss"))

    METHODS[PROBE] = replace(SPEC, client=Undeclared)
    with pytest.raises(PrivacyViolation, match=r"client 0 sent array 'stat' \[1\] \(report task"):
        run_sim(probe_config(), tmp_path / "run")


def test_a_non_finite_station_uplink_is_rejected_and_the_round_goes_on(probe, tmp_path):
    """Catches: a station's NaN reaching the server's average (only clients' were checked)."""

    class NanStation1(ProbeStation):
        def uplink(self, rnd: int) -> Message:
            up = super().uplink(rnd)
            if self.ctx.sid == 1:
                up.scalars["ema"] = float("nan")
            return up

    METHODS[PROBE] = replace(SPEC, station=NanStation1)
    sim = run_sim(probe_config(), tmp_path / "run")
    assert sim.rejected == [
        {"round": 1, "station": 1, "arrays": ["ema"]},
        {"round": 2, "station": 1, "arrays": ["ema"]},
    ]
    assert [sorted(h) for h in sim.server.heard] == [[0], [0]]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["rejected_updates"] == sim.rejected


# ---------------------------------------------------------------------- state and resume
class _Crash(Exception):
    pass


class CrashesInRound3(Simulation):
    def _round(self, rnd: int) -> dict[str, Any]:
        if rnd == 3:
            raise _Crash
        return super()._round(rnd)


def test_station_state_survives_a_checkpoint_and_resume(probe, tmp_path):
    """Catches: station state left out of the checkpoint or not loaded back (resumed stations
    would count station rounds and average means from zero again)."""
    cfg = probe_config(rounds=3, checkpoint__every=1)
    fed = tiny_federation(cfg)
    whole = run_sim(cfg, tmp_path / "whole", fed)
    out = tmp_path / "resumed"
    out.mkdir()
    with pytest.raises(_Crash):
        CrashesInRound3(cfg, fed, out).run()
    saved = checkpoint.load(out)
    assert saved is not None and saved["round"] == 2
    assert [s["steps"] for s in saved["stations"]] == [2 * R, 2 * R]
    resumed = Simulation(cfg, fed, out)
    resumed.run()
    means = station_means(whole, rounds=3)
    for sid, station in enumerate(resumed.stations):
        assert station.state_dict() == {"steps": 3 * R, "ema": expected_ema(means, sid, 3)}
    assert [h[s]["scalars"] for h in resumed.server.heard for s in h] == [
        h[s]["scalars"] for h in whole.server.heard for s in h
    ]
    for name, value in whole.server.global_arrays.items():
        assert torch.equal(resumed.server.global_arrays[name], value), name
    assert metrics_of(out) == metrics_of(tmp_path / "whole")


CLI_CONFIG = {
    "name": "stations-resume-test",
    "seed": 3,
    "rounds": 4,
    "dataset": {"name": "digits_embedded", "resolution": 32},
    "split": {"scheme": "lodo", "targets": ["grey"]},
    "partition": {"name": "lambda", "n_clients": 5, "lam": 0.5},
    "topology": {"stations": 2, "station_rounds": R},
    "model": {"name": "lenet5"},
    "train": {"batch_size": 64, "optimizer": "adam", "lr": 0.002},
    "eval": {"every": 2},
    "checkpoint": {"every": 1},
    "algorithm": {"name": PROBE},
    "threads": 1,
}
# `feddomain run` in a process of its own, with the probe method registered first
CLI = (
    "import sys; from feddomain.algorithms import register; from feddomain.cli import main; "
    "from tests.test_stations import SPEC; register(SPEC); sys.exit(main(sys.argv[1:]))"
)


def test_sigkill_then_resume_restores_every_stations_state(probe, tmp_path):
    """Catches: station state missing from what a SIGKILLed `feddomain run` resumes from (the
    stations' counters and EMAs in metrics.jsonl's diagnostics would restart from zero)."""
    config = write_config(tmp_path / "stations.yaml", CLI_CONFIG)
    run_to_end(config, tmp_path / "reference")
    out = tmp_path / "killed"
    saved = kill_after_checkpoint(config, out, launcher=[sys.executable, "-c", CLI])
    assert saved is not None and 1 <= saved["round"] < 4
    assert [s["steps"] for s in saved["stations"]] == [R * saved["round"]] * 2

    resume(out)  # in-process, where the probe method is registered
    assert_resumed_equals(out, tmp_path / "reference")
    assert metrics_of(out)[-1]["diagnostics"]["steps"] == [4 * R, 4 * R]


# ------------------------------------------------------------------------------- bytes
def test_bytes_are_counted_per_link_by_hand(probe, tmp_path):
    """Catches: a link's bytes counted on the other link, in the wrong direction or kind, the
    server's message to a station or a station's uplink not counted, or pre-round tasks
    missing (hand count below: 5 clients in stations of 3 and 2, 2 station rounds)."""
    sim = run_sim(probe_config(), tmp_path / "runs" / "probe")
    model = sum(t.numel() * t.element_size() for t in sim.model.state_dict().values())
    n_stations = 2
    fits = 5 * R  # each of the 5 clients trains once per station round
    client_station = {
        # per station round and client: the task {"r"}, then the model with {"mean"} in station
        # round 0 and {"num_examples", "mean"} (the station's aggregate) in station round 1
        "down": {"model": fits * model, "statistics": 0, "scalars": 8 * fits + 8 * 5 * (1 + 2)},
        # per station round and client: one float64 statistic, then the model, num_examples, loss
        "up": {"model": fits * model, "statistics": 8 * fits, "scalars": 16 * fits},
    }
    station_server = {
        "down": {"model": n_stations * model, "statistics": 0, "scalars": 0},
        # each station: its model, 'count' (2 float64) and num_examples, steps, ema
        "up": {"model": n_stations * model, "statistics": n_stations * 16, "scalars": 2 * 24},
    }
    expected = {"client-station": client_station, "station-server": station_server}
    rounds = [json.loads(x) for x in (tmp_path / "runs" / "probe" / "rounds.jsonl").open()]
    assert [r["round"] for r in rounds] == [1, 2]
    for record in rounds:
        assert record["links"] == expected
        assert record["ledger"] == station_server  # the server's own link
        up = station_server["up"]
        assert (record["bytes_up"], record["bytes_down"]) == (
            up["model"] + up["statistics"],
            n_stations * model,
        )
    summary = json.loads((tmp_path / "runs" / "probe" / "summary.json").read_text())
    twice = {
        link: {d: {k: 2 * n for k, n in kinds.items()} for d, kinds in ledger.items()}
        for link, ledger in expected.items()
    }
    assert summary["links"] == twice
    # the report has one row per link for a run with stations
    (sim.out / "config.yaml").write_text(yaml.safe_dump(sim.cfg.to_dict()))
    text = build_report([tmp_path / "runs"]).to_markdown()
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    for link, ledger in expected.items():
        cells = [float(c) for c in rows[f"| {PROBE} ({link})"].strip(" |").split(" | ")[1:]]
        hand = [ledger[d][k] / 1024 for d in ("down", "up") for k in ledger[d]]
        assert cells == pytest.approx(hand, rel=1e-3), link


# ------------------------------------------------------------------------------ Flower
@pytest.fixture
def task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a ServerApp process knows about itself (set by Flower's runtime there)."""
    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)


def test_the_probe_stations_on_flower_equal_the_simulator(probe, tmp_path, task_identity):
    """Catches: station hooks that work in-process only: pre-round tasks not sent to the nodes,
    or a station's downlink, uplink or state differing in the ServerApp (all compared exactly)."""
    cfg = demo_config(
        f"algorithm.name={PROBE}", "topology.stations=2", f"topology.station_rounds={R}"
    )
    sim = simulate(cfg, tmp_path / "sim")
    assert [list(s) for s in sim.data.stations] == [[0, 1], [2]]
    grid = deploy_loopback(cfg, tmp_path / "flower")
    assert_same_run(tmp_path / "flower", sim, tmp_path / "sim")
    trained = [int(node) - 100 for node, kind, _ in grid.received if kind == "train"]
    assert sorted(trained) == sorted([0, 1, 2] * 2 * R * cfg.rounds)  # pre-round task + fit
    for node, context in grid.contexts.items():
        kept = load_state(context.state, f"feddomain.split0.client{node - 100}")
        assert kept.scalars["heard"] == sim.states[node - 100].scalars["heard"]
