"""The engine contract the methods build on: model hooks, training controls (schedule, drop_last,
persistent optimiser state, parameter subsets and a second optimiser, per-batch losses, what a
client knows), per-round pre-tasks, a one-time broadcast and composed methods. Each capability
is exercised by a small method defined here."""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from feddomain.algorithms import METHODS, register
from feddomain.algorithms.base import Hparams, MethodSpec
from feddomain.algorithms.fedavg import FedAvgClient, FedAvgHparams, FedAvgServer
from feddomain.algorithms.registry import resolve_method
from feddomain.errors import ConfigError
from feddomain.federation.messages import Message
from feddomain.federation.privacy import PrivacyViolation, Uploads
from feddomain.federation.simulation import Simulation
from feddomain.federation.topology import CLIENT_TRAIN, INIT, derive_seed
from feddomain.federation.training import get_arrays
from feddomain.models import build_model
from tests.engine_helpers import run_sim, temporary_method, tiny_config, tiny_federation


@pytest.fixture(autouse=True, scope="module")
def test_methods():
    """The methods defined below, registered while this module's tests run."""
    specs = (COUNTING, ADAPTER, RECORDER, LABEL_MEAN)
    for spec in specs:
        register(spec)
    yield
    for spec in specs:
        del METHODS[spec.name]


# ------------------------------------------------------------------ model hook


def add_step_counter(model: nn.Module, hp: Hparams) -> nn.Module:
    """The hook of ``_counting``: a buffer counting optimiser steps, and a trainable scale."""
    model.register_buffer("steps_taken", torch.zeros((), dtype=torch.float32))
    model.logit_scale = nn.Parameter(torch.ones(()))
    return model


class CountingClient(FedAvgClient):
    """FedAvg whose loss uses the added parameter and whose steps tick the added buffer."""

    def run(self, msg: Message, ctx) -> Message:
        model = ctx.model

        def loss(m, x, y):
            return F.cross_entropy(m(x) * m.logit_scale, y)

        def tick(step: int, batch_loss: torch.Tensor) -> None:
            model.steps_taken += 1

        stats = ctx.fit(msg.arrays, loss_fn=loss, on_step=tick)
        scalars = {"num_examples": len(ctx.train), "loss": stats.mean_loss}
        return Message("fit", get_arrays(model), scalars)


COUNTING = MethodSpec(
    "_counting", FedAvgServer, CountingClient, FedAvgHparams, model_hook=add_step_counter
)


def test_a_model_hook_reaches_every_model_the_runner_builds(tmp_path):
    """Catches: a hook applied to the client model but not the server's factory or evaluation
    (strict loading would fail), or added buffers not averaged like any other array."""
    cfg = tiny_config(rounds=2, algorithm="_counting", train__batch_size=7)
    sim = run_sim(cfg, tmp_path / "run")
    fed = tiny_federation(cfg)
    sizes = [len(d) for d in fed.train]
    steps = [math.ceil(n / 7) for n in sizes]  # one local epoch per round
    # round 1: every client starts at 0; round 2 from the sample-weighted mean of round 1
    after_one = sum(n * s for n, s in zip(sizes, steps, strict=True)) / sum(sizes)
    expected = after_one + after_one  # each client adds its own steps again, then averaged
    assert sim.server.global_arrays["steps_taken"].item() == pytest.approx(expected, rel=1e-6)
    assert "logit_scale" in sim.server.global_arrays
    assert sim.server.global_arrays["logit_scale"].item() != 1.0  # trained
    fresh = sim.server.ctx.model_factory()
    assert {"steps_taken", "logit_scale"} <= set(fresh.state_dict())
    assert sim.records[-1]["id_acc"] is not None  # evaluation loaded the arrays strictly


# ---------------------------------------------------------- a second optimiser


def add_adapter(model: nn.Module, hp: Hparams) -> nn.Module:
    model.adapter = nn.Linear(3, 3)
    return model


class AdapterClient(FedAvgClient):
    """Trains the backbone with the configured optimiser and its adapter with its own Adam; one
    backward of CE(adapter(logits)) reaches both parameter sets."""

    def run(self, msg: Message, ctx) -> Message:
        model = ctx.model
        model.load_state_dict(msg.arrays)
        adapter = list(model.adapter.parameters())
        own = {id(p) for p in adapter}
        backbone = [p for p in model.parameters() if id(p) not in own]
        adapter_opt = torch.optim.Adam(adapter, lr=0.01)
        ctx.fit(
            msg.arrays,
            loss_fn=adapter_loss,
            params=backbone,
            extra_optimizers=[adapter_opt],
        )
        return Message("fit", get_arrays(model), {"num_examples": len(ctx.train), "loss": 0.0})


def adapter_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model.adapter(model(x)), y)


ADAPTER = MethodSpec("_adapter", FedAvgServer, AdapterClient, FedAvgHparams, model_hook=add_adapter)


def test_a_two_optimiser_client_steps_each_set_with_its_own_optimiser(tmp_path):
    """Catches: the shared loop stepping only the first optimiser, zeroing one set's gradients
    too late, or optimising the adapter with the configured optimiser (reference: a hand loop
    with SGD on the backbone and Adam on the adapter)."""
    cfg = tiny_config(
        rounds=1, algorithm="_adapter", partition__n_clients=1, partition__d=3,
        train__optimizer="sgd", train__lr=0.05, train__momentum=0.9,
    )  # fmt: skip
    fed = tiny_federation(cfg)
    sim = run_sim(cfg, tmp_path / "run", fed)
    torch.manual_seed(derive_seed(cfg.seed, INIT))
    model = add_adapter(build_model("lenet5", 3), Hparams())
    backbone = [p for n, p in model.named_parameters() if not n.startswith("adapter.")]
    sgd = torch.optim.SGD(backbone, lr=0.05, momentum=0.9)
    adam = torch.optim.Adam(model.adapter.parameters(), lr=0.01)
    torch.manual_seed(derive_seed(cfg.seed, CLIENT_TRAIN, 1, 0, 0))
    gen = torch.Generator().manual_seed(derive_seed(cfg.seed, CLIENT_TRAIN, 1, 0, 0))
    model.train()
    for x, y in fed.train[0].batches(cfg.train.batch_size, gen):
        loss = adapter_loss(model, x, y)
        sgd.zero_grad()
        adam.zero_grad()
        loss.backward()
        sgd.step()
        adam.step()
    for name, value in model.state_dict().items():
        got = sim.server.global_arrays[name]
        assert torch.allclose(got, value, atol=1e-6, rtol=0), name


# ------------------------------------------------------------- training controls


class Recorder(FedAvgClient):
    """FedAvg that records what its context says and what the loop reports."""

    seen: ClassVar[list[dict]] = []

    def run(self, msg: Message, ctx) -> Message:
        optimizer_lr = ctx.optimizer(list(ctx.model.parameters())).param_groups[0]["lr"]
        stats = ctx.fit(msg.arrays)
        Recorder.seen.append(
            {
                "cid": ctx.cid,
                "rnd": ctx.rnd,
                "rounds": ctx.rounds,
                "station_round": ctx.station_round,
                "station_rounds": ctx.station_rounds,
                "lr": ctx.lr,
                "optimizer_lr": optimizer_lr,
                "normalization": ctx.normalization,
                "n": len(ctx.train),
                "steps": stats.steps,
                "examples": stats.examples,
                "batch_losses": stats.batch_losses.clone(),
                "mean_loss": stats.mean_loss,
            }
        )
        return Message("fit", get_arrays(ctx.model), {"num_examples": len(ctx.train)})

    def uploads(self, n_clients: int) -> Uploads:
        return Uploads(model=("*",))


RECORDER = MethodSpec("_recorder", FedAvgServer, Recorder, FedAvgHparams)


def recorded(tmp_path, **overrides) -> list[dict]:
    Recorder.seen = []
    run_sim(tiny_config(algorithm="_recorder", **overrides), tmp_path)
    return Recorder.seen


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ({"schedule": "constant"}, [0.1, 0.1, 0.1, 0.1]),
        # ½·0.1·(1 + cos(π·k/4)), k = 0..3
        ({"schedule": "cosine"}, [0.1, 0.0853553390593, 0.05, 0.0146446609407]),
        # 0.02 + ½·0.08·(1 + cos(π·k/4))
        ({"schedule": "cosine", "min_lr": 0.02}, [0.1, 0.0882842712475, 0.06, 0.0317157287525]),
        ({"schedule": "step", "step_at": 0.5, "step_gamma": 0.1}, [0.1, 0.1, 0.01, 0.01]),
    ],
    ids=["constant", "cosine", "cosine-floor", "step"],
)
def test_the_round_learning_rate_follows_the_schedule_and_reaches_the_optimiser(
    schedule, expected, tmp_path
):
    """Catches: a schedule off by one round, a wrong cosine or step rule, or ctx.lr not being
    what the optimiser uses (values computed by hand)."""
    seen = recorded(tmp_path, rounds=4, train__optimizer="sgd", train__lr=0.1, **{
        f"train__{k}": v for k, v in schedule.items()
    })  # fmt: skip
    by_round = {r["rnd"]: r for r in seen if r["cid"] == 0}
    assert [by_round[r]["lr"] for r in (1, 2, 3, 4)] == pytest.approx(expected, abs=1e-12)
    assert all(r["optimizer_lr"] == r["lr"] for r in seen)


def test_a_client_knows_the_round_count_station_rounds_and_normalisation(tmp_path):
    """Catches: context fields left at their defaults instead of the run's values."""
    seen = recorded(
        tmp_path, rounds=2, partition__n_clients=4, partition__name="lambda",
        partition__lam=0.5, topology__stations=2, topology__station_rounds=3,
        train__mean=[0.5, 0.4, 0.3], train__std=[0.2, 0.2, 0.2],
    )  # fmt: skip
    assert len(seen) == 2 * 4 * 3  # rounds x clients x station rounds
    assert sorted({(r["rnd"], r["station_round"]) for r in seen}) == [
        (rnd, s) for rnd in (1, 2) for s in (0, 1, 2)
    ]
    assert {(r["rounds"], r["station_rounds"]) for r in seen} == {(2, 3)}
    assert {r["normalization"] for r in seen} == {((0.5, 0.4, 0.3), (0.2, 0.2, 0.2))}


@pytest.mark.parametrize("drop_last", [False, True])
def test_drop_last_and_per_batch_losses(drop_last, tmp_path):
    """Catches: drop_last ignored (or dropping a full batch), and per-batch losses that do not
    belong to the steps taken (count, and their mean is the reported mean loss)."""
    seen = recorded(
        tmp_path, rounds=1, train__batch_size=7, train__local_epochs=2, train__drop_last=drop_last
    )
    for r in seen:
        per_epoch = r["n"] // 7 if drop_last else math.ceil(r["n"] / 7)
        assert r["n"] % 7 != 0  # a partial batch exists, so the two settings differ
        assert r["steps"] == 2 * per_epoch == r["batch_losses"].numel()
        assert r["examples"] == (2 * per_epoch * 7 if drop_last else 2 * r["n"])
        mean = float(r["batch_losses"].double().mean())
        assert mean == pytest.approx(r["mean_loss"], rel=1e-5)  # float32 running sum vs float64


def test_max_steps_stops_each_client_after_that_many_steps_of_the_same_batches(tmp_path):
    """Catches: train.max_steps ignored, counted per epoch instead of per round (8 of 2 x 6
    steps: the cap falls in the second epoch), applied to a client with fewer steps than the
    cap, or changing which batches the first steps see (their losses must be bit-identical to
    the uncapped run's first 8)."""
    common = {"rounds": 1, "train__batch_size": 7, "train__local_epochs": 2}
    full = recorded(tmp_path / "full", **common)
    capped = recorded(tmp_path / "capped", **common, train__max_steps=8)
    above = recorded(tmp_path / "above", **common, train__max_steps=1000)
    for f, c, a in zip(full, capped, above, strict=True):
        assert f["steps"] == 2 * math.ceil(f["n"] / 7) == 12
        assert c["steps"] == 8 == c["batch_losses"].numel()
        assert torch.equal(c["batch_losses"], f["batch_losses"][:8])
        assert c["examples"] == f["n"] + 2 * 7  # one whole epoch (6 steps), then 2 full batches
        assert a["steps"] == f["steps"] and torch.equal(a["batch_losses"], f["batch_losses"])
    with pytest.raises(ConfigError, match="max_steps"):
        tiny_config(train__max_steps=0)


def test_a_persistent_optimizer_carries_momentum_across_rounds(tmp_path):
    """Catches: momentum reset every round despite train.persistent_optimizer, or state restored
    into the wrong parameters (reference: one SGD-with-momentum run over all rounds' batches;
    FedAvg over one client is that client's training)."""
    overrides = dict(
        rounds=3, partition__n_clients=1, partition__d=3, train__optimizer="sgd",
        train__lr=0.05, train__momentum=0.9,
    )  # fmt: skip
    cfg = tiny_config(train__persistent_optimizer=True, **overrides)
    fed = tiny_federation(cfg)
    sim = run_sim(cfg, tmp_path / "kept", fed)
    fresh = run_sim(tiny_config(**overrides), tmp_path / "fresh", fed)
    torch.manual_seed(derive_seed(cfg.seed, INIT))
    model = build_model("lenet5", 3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for rnd in (1, 2, 3):
        gen = torch.Generator().manual_seed(derive_seed(cfg.seed, CLIENT_TRAIN, rnd, 0, 0))
        for x, y in fed.train[0].batches(cfg.train.batch_size, gen):
            loss = F.cross_entropy(model(x), y)
            sgd.zero_grad()
            loss.backward()
            sgd.step()
    diff_fresh = 0.0
    for name, value in model.state_dict().items():
        assert torch.allclose(sim.server.global_arrays[name], value, atol=1e-5, rtol=0), name
        diff_fresh += float((fresh.server.global_arrays[name] - value).abs().max())
    assert diff_fresh > 1e-3  # a fresh optimiser per round ends elsewhere
    assert any(k.startswith("optimizer/") for k in sim.states[0].arrays)


def test_local_only_keeps_its_model_and_optimizer_state_apart(tmp_path):
    """Catches: optimiser entries leaking into the model Local-only evaluates or trains from."""
    cfg = tiny_config(
        rounds=2, algorithm="local", train__optimizer="adam", train__persistent_optimizer=True
    )
    sim = run_sim(cfg, tmp_path / "run")
    state = sim.states[0]
    model_keys = set(sim.model.state_dict())
    assert model_keys < set(state.arrays)
    assert {k.split(".", 1)[1] for k in state.arrays if k.startswith("optimizer/")} >= {
        "exp_avg", "exp_avg_sq", "step",
    }  # fmt: skip
    assert sim.records[-1]["id_acc"] is not None


# -------------------------------------------------------------- pre-round tasks


class LabelMeanServer(FedAvgServer):
    """Asks this round's participants for their mean label before configuring the round, and
    broadcasts the sample-weighted mean of those answers."""

    def __init__(self, ctx, hp):
        super().__init__(ctx, hp)
        self.asked: list[tuple[int, list[int]]] = []
        self.means: dict[int, float] = {}
        self.draws: dict[int, dict[int, float]] = {}  # each client's seeded draw per round

    def pre_round(self, rnd, clients):
        self.asked.append((rnd, list(clients)))
        return dict.fromkeys(clients, Message("label_mean"))

    def on_pre_round(self, rnd, replies):
        self.draws[rnd] = {c: r.scalars["draw"] for c, r in replies.items()}
        n = {c: float(r.scalars["num_examples"]) for c, r in replies.items()}
        total = sum(n.values())
        self.means[rnd] = sum(n[c] * float(r.scalars["label_mean"]) for c, r in replies.items())
        self.means[rnd] /= total

    def configure(self, rnd, clients):
        return dict.fromkeys(clients, Message("fit", self.global_arrays, {"mean": self.means[rnd]}))

    def state_dict(self):
        return {**super().state_dict(), "means": self.means, "draws": self.draws}


class LabelMeanClient(FedAvgClient):
    draws: ClassVar[list[tuple[str, int, int, float]]] = []

    def run(self, msg, ctx):
        LabelMeanClient.draws.append((msg.task, ctx.rnd, ctx.cid, float(torch.rand(()))))
        if msg.task == "label_mean":
            labels = ctx.train.labels.double()
            draw = float(torch.rand((), generator=ctx.generator))
            scalars = {"label_mean": float(labels.mean()), "num_examples": len(labels)}
            return Message("label_mean", {}, {**scalars, "draw": draw})
        return super().run(msg, ctx)

    def uploads(self, n_clients):
        return Uploads(model=("*",), scalars=("num_examples", "loss", "label_mean", "draw"))


LABEL_MEAN = MethodSpec("_label_mean", LabelMeanServer, LabelMeanClient, FedAvgHparams)


def test_a_pre_round_task_reaches_the_participants_before_configure(tmp_path):
    """Catches: a pre-round task sent to every client instead of the sampled ones, run after
    configure, or seeded like the round's training (its random draws would repeat the fit's)."""
    LabelMeanClient.draws = []
    cfg = tiny_config(rounds=3, algorithm="_label_mean", topology__sample_fraction=0.67)
    fed = tiny_federation(cfg)
    sim = run_sim(cfg, tmp_path / "run", fed)
    assert [c for _, c in sim.server.asked] == sim.schedule
    for rnd, clients in sim.server.asked:
        labels = [fed.train[c].labels.double() for c in clients]
        expected = float(torch.cat(labels).mean())  # weighted mean of means = pooled mean
        assert sim.server.means[rnd] == pytest.approx(expected, abs=1e-12)
    tasks = [(t, r, c) for t, r, c, _ in LabelMeanClient.draws]
    assert tasks[:4] == [
        ("label_mean", 1, sim.schedule[0][0]), ("label_mean", 1, sim.schedule[0][1]),
        ("fit", 1, sim.schedule[0][0]), ("fit", 1, sim.schedule[0][1]),
    ]  # fmt: skip
    pre = {(r, c): u for t, r, c, u in LabelMeanClient.draws if t == "label_mean"}
    fit = {(r, c): u for t, r, c, u in LabelMeanClient.draws if t == "fit"}
    assert all(pre[k] != fit[k] for k in pre)


# ---------------------------------------------------------------- composition


def test_an_aggregator_composed_with_another_methods_client_is_that_method(tmp_path):
    """Catches: the client's hyper-parameters not reaching the client part, the aggregator's not
    reaching the server (server_lr), or a composed run differing from the named method."""
    composed = run_sim(
        tiny_config(
            rounds=2,
            algorithm={"name": "fedavg", "server_lr": 0.5, "client": {"name": "fedprox", "mu": 2}},
        ),
        tmp_path / "composed",
    )
    named = run_sim(
        tiny_config(rounds=2, algorithm={"name": "fedprox", "mu": 2, "server_lr": 0.5}),
        tmp_path / "named",
    )
    plain_cfg = tiny_config(rounds=2, algorithm={"name": "fedavg", "server_lr": 0.5})
    plain = run_sim(plain_cfg, tmp_path / "plain")
    assert composed.method.name == "fedavg+fedprox"
    assert composed.client.hp.mu == 2
    for name, value in named.server.global_arrays.items():
        assert torch.equal(composed.server.global_arrays[name], value), name
    assert any(
        not torch.equal(plain.server.global_arrays[k], v)
        for k, v in composed.server.global_arrays.items()
    )


@pytest.mark.parametrize(
    ("algorithm", "message"),
    [
        ({"name": "fedprox", "client": "fedavg"}, r"'algorithm\.client': fedprox has its own"),
        ({"name": "fedavg", "client": {"name": "fedprox", "muu": 1}},
         r"unknown key 'algorithm\.client\.muu'; did you mean 'algorithm\.client\.mu'"),
        ({"name": "fedavg", "client": {"name": "fedprox", "mu": -1}},
         r"'algorithm\.client\.mu': Input should be greater than or equal to 0"),
        ({"name": "fedavg", "client": "central"}, r"central cannot be a client part"),
        ({"name": "fedavg", "client": {"mu": 1}}, r"'algorithm\.client' must be a method name"),
        ({"name": "hfedavg", "client": "hfedatm"}, r"hfedatm cannot be a client part"),
        ({"name": "hfedavg", "client": {"name": "fedavg", "server_lr": 0.5}},
         r"fedavg cannot be a client part"),
    ],
    ids=["not-an-aggregator", "typo", "negative", "pooled", "no-name", "aggregator",
         "aggregator-with-hparams"],
)  # fmt: skip
def test_bad_compositions_are_refused_at_config_time_by_key(algorithm, message):
    """Catches: a composed method's errors surfacing late (at run time) or without the key."""
    with pytest.raises(ConfigError, match=message):
        tiny_config(algorithm=algorithm)


@pytest.mark.parametrize("aggregator", ["fedavg", "hfedavg", "hfedatm"])
def test_fedavg_as_the_client_part_names_the_aggregators_own_plain_clients(aggregator):
    """Catches: `algorithm.client: fedavg` (what a user writes for plain local training under
    an aggregator, e.g. in a sweep over client methods) refused as an aggregator, or resolved to
    something other than the aggregator without a client key (HFedATM's Gram capture lost)."""
    plain = resolve_method(aggregator, {})
    named = resolve_method(aggregator, {"client": "fedavg"})
    assert (named.spec, named.client_spec, named.hp) == (plain.spec, plain.client_spec, plain.hp)
    assert named.client_spec is plain.spec and named.name == aggregator


def test_a_composed_method_declares_its_clients_uploads(tmp_path):
    """Catches: the privacy declaration taken from the aggregator instead of the client part."""
    cfg = tiny_config(algorithm={"name": "fedavg", "client": "local"})
    sim = Simulation(cfg, tiny_federation(cfg), tmp_path)
    assert sim.upload_check.uploads.model == ()


# ------------------------------------------------------------------ one-time broadcast


class TaggingServer(FedAvgServer):
    """Sends every client, once after round 0's collect, a tag of its own (its id + 0.5)."""

    def broadcast(self, clients):
        return {c: Message("tag", {"tag": torch.tensor([c + 0.5])}) for c in clients}


class TaggedClient(FedAvgClient):
    """Keeps the tag; reports it with every fit (so the server sees what the client kept)."""

    def run(self, msg, ctx):
        if msg.task == "tag":
            ctx.state.arrays["tag"] = msg.arrays["tag"]
            return Message("tag", dict(msg.arrays) if ctx.cid == self.leaky else {})
        reply = super().run(msg, ctx)
        reply.scalars["tag"] = float(ctx.state.arrays["tag"])
        return reply

    leaky = -1  # the client that (wrongly) echoes the tag back

    def uploads(self, n_clients):
        return Uploads(model=("*",), scalars=("num_examples", "loss", "tag"))


def test_a_one_time_broadcast_reaches_every_client_and_is_kept(tmp_path):
    """Catches: a broadcast that reaches only the first round's sampled clients, is not kept in
    the client's state, is repeated, or whose replies skip the privacy check (FISC's style)."""
    with temporary_method("_tagging", TaggingServer, TaggedClient):
        cfg = tiny_config(rounds=3, algorithm="_tagging", topology={"sample_fraction": 0.34})
        sim = run_sim(cfg, tmp_path / "ok")
        assert [float(s.arrays["tag"]) for s in sim.states] == [0.5, 1.5, 2.5]
        zero = sim.round_log[0]
        assert zero["round"] == 0 and zero["ledger"]["down"]["statistics"] == 3 * 4
        assert all(r["ledger"]["down"]["statistics"] == 0 for r in sim.round_log[1:])
        TaggedClient.leaky = 1
        try:
            with pytest.raises(PrivacyViolation, match="client 1 sent array 'tag'"):
                run_sim(cfg, tmp_path / "leak")
        finally:
            TaggedClient.leaky = -1
