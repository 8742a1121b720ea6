"""The federated engine: reductions that must hold exactly, the message contract, NaN rejection,
stations, determinism."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from feddomain.algorithms.base import ClientAlgorithm
from feddomain.algorithms.fedavg import FedAvgServer
from feddomain.errors import ConfigError
from feddomain.federation.messages import Message, weighted_mean
from feddomain.federation.privacy import Uploads
from feddomain.federation.simulation import Simulation
from feddomain.federation.topology import CLIENT_TRAIN, INIT, derive_seed, sampling_stream
from feddomain.models import build_model
from tests.engine_helpers import (
    run_sim,
    temporary_method,
    tiny_config,
    tiny_dataset,
    tiny_federation,
)


def test_weighted_mean_matches_hand_computed_example():
    a = Message("fit", {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(4)}, {"num_examples": 1})
    b = Message("fit", {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(8)}, {"num_examples": 3})
    mean, total = weighted_mean([a, b])
    # (1*1 + 3*3)/4 = 2.5 ; (1*2 + 3*6)/4 = 5.0 ; integer buffer (4 + 24)/4 = 7
    assert total == 4
    assert torch.equal(mean["w"], torch.tensor([2.5, 5.0]))
    assert mean["n"].dtype == torch.int64 and int(mean["n"]) == 7


def test_weighted_mean_of_identical_updates_is_that_update():
    w = {"w": torch.randn(1000, generator=torch.Generator().manual_seed(1))}
    msgs = [Message("fit", w, {"num_examples": n}) for n in (3, 17, 250)]
    mean, _ = weighted_mean(msgs)
    assert torch.equal(mean["w"], w["w"])


def test_fedavg_with_one_client_equals_plain_local_training(tmp_path):
    cfg = tiny_config(
        partition__n_clients=1,
        partition__d=3,
        rounds=3,
        train__optimizer="adam",
        train__lr=0.003,
        train__local_epochs=2,
    )
    fed = tiny_federation(cfg)
    sim = run_sim(cfg, tmp_path / "run", fed)

    # Independent plain loop: same init, same batches; FedAvg clients start a fresh Adam each round.
    torch.manual_seed(derive_seed(cfg.seed, INIT))
    model = build_model("lenet5", 3).to(memory_format=torch.channels_last)  # the CPU layout
    data = fed.train[0]
    for rnd in range(1, cfg.rounds + 1):
        gen = torch.Generator().manual_seed(derive_seed(cfg.seed, CLIENT_TRAIN, rnd, 0, 0))
        opt = torch.optim.Adam(model.parameters(), lr=0.003)
        model.train()
        for _ in range(2):
            order = torch.randperm(len(data), generator=gen)
            for start in range(0, len(data), cfg.train.batch_size):
                idx = order[start : start + cfg.train.batch_size]
                x = data.inputs[idx].float() / 255.0
                loss = F.cross_entropy(model(x), data.labels[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
    for name, value in model.state_dict().items():
        assert torch.allclose(sim.server.global_arrays[name], value, atol=1e-6, rtol=0), name


def test_fedavg_over_identical_clients_equals_one_clients_update(tmp_path):
    # Full-batch training makes every client's update independent of its batch order.
    cfg = tiny_config(rounds=1, train__batch_size=10_000)
    one = tiny_federation(
        tiny_config(rounds=1, train__batch_size=10_000, partition__n_clients=1, partition__d=3)
    )
    fed = tiny_federation(cfg)
    fed.train = [one.train[0]] * 3
    fed.val = [one.val[0]] * 3
    many = run_sim(cfg, tmp_path / "many", fed)
    single = run_sim(
        tiny_config(rounds=1, train__batch_size=10_000, partition__n_clients=1, partition__d=3),
        tmp_path / "one",
        one,
    )
    # The clients differ from the single one only in sample order, so their full-batch gradients
    # sum the same 108 per-sample terms in other orders (float32: relative error ≤ 108·eps32 ≈
    # 6e-6 of Σ|terms| in the worst case); one SGD step of lr 0.01 turns that into ≲ 1e-7 in
    # the weights, plus ≤ 1 ulp (≤ 1.5e-8 for |w| < 0.25) when the step is applied; the mean of
    # identical updates is exact (weighted_mean accumulates in float64). Measured 7e-9 under
    # every ATEN_CPU_CAPABILITY. 1e-6 stays far below what training on other data changes.
    for name, value in single.server.global_arrays.items():
        assert torch.allclose(many.server.global_arrays[name], value, atol=1e-6, rtol=0), name


def test_fedprox_with_mu_zero_equals_fedavg(tmp_path):
    avg = run_sim(tiny_config(), tmp_path / "avg")
    prox = run_sim(tiny_config(algorithm={"name": "fedprox", "mu": 0.0}), tmp_path / "prox")
    for name, value in avg.server.global_arrays.items():
        assert torch.equal(prox.server.global_arrays[name], value), name


def test_fedprox_with_positive_mu_differs_and_stays_closer_to_global(tmp_path):
    avg = run_sim(tiny_config(rounds=1), tmp_path / "avg")
    prox = run_sim(tiny_config(rounds=1, algorithm={"name": "fedprox", "mu": 10.0}), tmp_path / "p")
    init = avg.server.ctx.model_factory().state_dict()
    dist = lambda arrays: sum(float((arrays[k] - init[k]).pow(2).sum()) for k in init)  # noqa: E731
    assert dist(prox.server.global_arrays) < dist(avg.server.global_arrays)


class _EchoAndTamper(ClientAlgorithm):
    """Replies with what it received, then scribbles over the received tensors in place; client 1
    sends NaN. If messages were not copied, the scribbles would land in the server's model."""

    def run(self, msg, ctx):
        reply = Message("fit", {k: v.clone() for k, v in msg.arrays.items()}, {"num_examples": 1})
        for t in msg.arrays.values():
            t.add_(1000)
        msg.arrays["injected"] = torch.zeros(1)
        if ctx.cid == 1:
            reply.arrays["classifier.weight"][0, 0] = float("nan")
        return reply

    def uploads(self, n_clients):
        return Uploads(model=("*",))


def test_client_cannot_touch_server_state_and_nan_update_is_rejected(tmp_path):
    with temporary_method("_tamper", FedAvgServer, _EchoAndTamper):
        sim = run_sim(tiny_config(rounds=2, algorithm="_tamper"), tmp_path / "t")
    initial = sim.server.ctx.model_factory().state_dict()
    assert set(sim.server.global_arrays) == set(initial)
    for name, value in initial.items():
        assert torch.equal(sim.server.global_arrays[name], value), name
    assert [(r["round"], r["client"]) for r in sim.rejected] == [(1, 1), (2, 1)]
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert summary["rejected_updates"][0]["arrays"] == ["classifier.weight"]


def test_stations_with_one_round_equal_flat_fedavg(tmp_path):
    cfg_flat = tiny_config(
        rounds=2, partition__n_clients=4, partition__name="lambda", partition__lam=0.5
    )
    cfg_tier = tiny_config(
        rounds=2,
        partition__n_clients=4,
        partition__name="lambda",
        partition__lam=0.5,
        topology__stations=2,
    )
    flat = run_sim(cfg_flat, tmp_path / "flat")
    tier = run_sim(cfg_tier, tmp_path / "tier")
    # The tier rounds each station's mean to float32 before the server's mean: ≤ 1 ulp of |w|
    # (|w| < 0.25: ≤ 1.5e-8) per round, carried through round 2's few SGD steps of lr 0.01
    # almost unchanged; measured 1.5e-8 (1 ulp) under every ATEN_CPU_CAPABILITY. A real
    # difference is far larger: two station rounds instead of one move the weights by 1.6e-3.
    for name, value in flat.server.global_arrays.items():
        assert torch.allclose(tier.server.global_arrays[name], value, atol=1e-6, rtol=0), name


def test_same_seed_gives_identical_summary_and_other_seed_differs(tmp_path):
    def summary(name, seed):
        run_sim(tiny_config(seed=seed), tmp_path / name)
        s = json.loads((tmp_path / name / "summary.json").read_text())
        s.pop("wall_time_s"), s.pop("phase_seconds")
        return s

    a, b, c = summary("a", 0), summary("b", 0), summary("c", 1)
    assert a == b
    assert a != c


def test_sampling_stream_is_seeded_and_sized():
    s1 = sampling_stream(100, 0.2, 50, seed=3)
    assert s1 == sampling_stream(100, 0.2, 50, seed=3)
    assert s1 != sampling_stream(100, 0.2, 50, seed=4)
    assert all(len(r) == 20 and len(set(r)) == 20 for r in s1)
    assert sampling_stream(3, 1.0, 2, seed=0) == [[0, 1, 2], [0, 1, 2]]
    assert all(len(r) == 1 for r in sampling_stream(3, 0.01, 5, seed=0))


def test_local_only_clients_keep_separate_models(tmp_path):
    sim = run_sim(tiny_config(rounds=2, algorithm="local"), tmp_path / "l")
    a, b = sim.states[0].arrays, sim.states[1].arrays
    assert not torch.equal(a["classifier.weight"], b["classifier.weight"])
    summary = json.loads((tmp_path / "l" / "summary.json").read_text())
    assert len(set(summary["per_client"]["ood_acc"])) >= 1
    assert sim.records[-1]["distinct_models"] == 3


class _SequentialServer(FedAvgServer):
    """Builds each client's message only after the previous client's reply was aggregated."""

    def __init__(self, ctx, hp):
        super().__init__(ctx, hp)
        self.seen: list[tuple[int, int]] = []
        self.folded = 0

    def configure(self, rnd, clients):
        for cid in clients:
            yield cid, Message("fit", {}, {"folded": self.folded})

    def aggregate(self, rnd, replies):
        for cid, reply in replies:
            self.seen.append((cid, int(reply.scalars["folded"])))
            self.folded += 1


class _Echo(ClientAlgorithm):
    def run(self, msg, ctx):
        return Message("fit", {}, dict(msg.scalars))

    def uploads(self, n_clients):
        return Uploads(scalars=("folded",))


def test_lazy_plan_interleaves_configure_and_aggregate(tmp_path):
    with temporary_method("_sequential", _SequentialServer, _Echo):
        cfg = tiny_config(rounds=2, algorithm="_sequential")
        sim = Simulation(cfg, tiny_federation(cfg), tmp_path)
        sim._round(1)
        sim._round(2)
    assert sim.server.seen == [(0, 0), (1, 1), (2, 2), (0, 3), (1, 4), (2, 5)]


def test_frozen_backbone_mode_trains_a_head_on_cached_features(tmp_path):
    cfg = tiny_config(rounds=2, model__frozen=True, dataset__cache_dir=str(tmp_path / "cache"))
    fed = tiny_federation(cfg)
    # the clients hold the backbone's features of their images, computed with the run's init
    dataset = tiny_dataset()
    torch.manual_seed(derive_seed(cfg.seed, INIT))
    backbone = build_model("lenet5", 3)
    backbone.eval()
    with torch.no_grad():
        expected = backbone.featurizer(dataset.images.float() / 255.0)
    assert fed.train[0].inputs.shape[1] == backbone.n_features == 84
    target = fed.targets["d0"].inputs  # target d0 is the first 40 samples, in storage order
    assert torch.allclose(target, expected[: len(target)], atol=1e-6)
    sim = run_sim(cfg, tmp_path / "run", fed)
    assert set(sim.server.global_arrays) == {"classifier.weight", "classifier.bias"}
    assert (tmp_path / "cache" / "features").is_dir()


def test_frozen_mode_refuses_augmentation():
    cfg = tiny_config(model__frozen=True, train__augment={"hflip": True})
    with pytest.raises(ConfigError, match="frozen-backbone mode"):
        tiny_federation(cfg)


def test_gradient_clipping_bounds_each_sgd_step(tmp_path):
    # plain SGD with lr 1: one step moves the parameters by exactly the (clipped) gradient
    cfg = tiny_config(rounds=1, train__lr=1.0, train__batch_size=10_000, train__grad_clip=1e-3)
    sim = run_sim(cfg, tmp_path / "clip", tiny_federation(cfg))
    init = sim.server.ctx.model_factory().state_dict()
    moved = torch.sqrt(sum((sim.server.global_arrays[k] - init[k]).pow(2).sum() for k in init))
    # each client's single full-batch step has norm <= 1e-3; their weighted mean too
    assert 0 < float(moved) <= 1e-3 + 1e-7
