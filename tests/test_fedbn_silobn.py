"""FedBN and SiloBN: what is averaged, what stays on each client, which model each evaluation
uses, and which configs are refused. Expected values come from hand-listed array names, float64
reference means and an independent replay of a client step, never from the code's own output."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
import torch

from feddomain.algorithms.fedavg import FedAvgHparams, FedAvgServer
from feddomain.config import load_config
from feddomain.errors import ConfigError
from feddomain.federation.layout import load_local
from feddomain.federation.simulation import Simulation
from feddomain.federation.topology import CLIENT_TRAIN, derive_seed, generator
from feddomain.federation.training import get_arrays, train_epochs
from feddomain.models import build_model
from tests.engine_helpers import run_sim, tiny_config, tiny_dataset, tiny_federation
from tests.test_evidence_engine import (
    TRAIN_SIZES,
    _logits,
    _max_gap,
    _model,
    _spy_aggregate,
    _weighted64,
    uneven_federation,
)
from tests.test_flower import (
    assert_same_run,
    demo_config,
    deploy_loopback,
    simulate,
    task_identity,  # noqa: F401 - a fixture
)

BN = [f"featurizer.{i}.1" for i in range(3)]  # small_cnn's BatchNorm layers, one per conv block
STATS = ("running_mean", "running_var", "num_batches_tracked")
LOCAL = {
    "fedbn": {f"{b}.{leaf}" for b in BN for leaf in ("weight", "bias", *STATS)},
    "silobn": {f"{b}.{leaf}" for b in BN for leaf in STATS},
}
REL = 2**-23  # a float64 mean rounded once to float32: within half an ulp (2**-24 relative)


def bn_config(method: str, **overrides):
    return tiny_config(model={"name": "small_cnn"}, algorithm=method, **overrides)


def _run(method: str, tmp_path, rounds: int = 2):
    cfg = bn_config(method, rounds=rounds, train__lr=0.05)
    fed = uneven_federation(cfg)
    sim = Simulation(cfg, fed, tmp_path)
    seen = _spy_aggregate(sim)
    sim.run()
    return cfg, fed, sim, seen


# ------------------------------------------------------------------ aggregation
@pytest.mark.parametrize("method", ["fedbn", "silobn"])
def test_shared_arrays_are_fedavgs_mean_and_local_ones_stay_each_clients(method, tmp_path):
    """Catches a BatchNorm array averaged when it should stay local (or the reverse), a shared
    mean that is not FedAvg's sample-weighted one over unequal clients, and a server that
    overwrites (or a client that loses) the local BatchNorm arrays a client trained."""
    _, _, sim, seen = _run(method, tmp_path)
    init = get_arrays(sim.server.ctx.model_factory())
    local = LOCAL[method]
    assert local <= init.keys()
    results = [seen[1][1], sim.server.global_arrays]
    gaps = []
    for (rnd, _, replies), result in zip(seen, results, strict=True):
        assert [m.scalars["num_examples"] for _, m in replies] == list(TRAIN_SIZES), rnd
        assert all(m.arrays.keys() == init.keys() for _, m in replies)  # everything goes up
        pairs = [(n, m.arrays) for n, (_, m) in zip(TRAIN_SIZES, replies, strict=True)]
        # FedAvg's server on the same replies: the shared arrays must be its numbers, bit for bit
        fedavg = FedAvgServer(sim.server.ctx, FedAvgHparams())
        fedavg.aggregate(rnd, iter((c, m.copy()) for c, m in replies))
        reference = _weighted64(pairs)
        for k in init.keys() - local:
            assert torch.equal(result[k], fedavg.global_arrays[k]), k
            torch.testing.assert_close(result[k].double(), reference[k], rtol=REL, atol=1e-12)
        for k in local:  # the broadcast keeps the initial values: the clients' never go down
            assert torch.equal(result[k], init[k]), k
        gaps.append(_max_gap(reference, _weighted64([(1, a) for _, a in pairs])))
    assert min(gaps) > 1e-5  # weighted and unweighted means really differ here
    # each client keeps exactly what it trained last, not the server's or another client's
    last = dict(seen[-1][2])
    for cid in range(3):
        kept = load_local(sim.states[cid])
        assert kept.keys() == local
        assert all(torch.equal(kept[k], last[cid].arrays[k]) for k in local)
    mean = sim.server.local_mean
    for k in (f"{BN[0]}.running_mean", f"{BN[2]}.running_var"):
        assert not torch.equal(load_local(sim.states[0])[k], load_local(sim.states[1])[k])
        assert not torch.equal(load_local(sim.states[0])[k], mean[k])


@pytest.mark.parametrize("method", ["fedbn", "silobn"])
def test_a_client_trains_from_its_own_local_arrays_and_the_servers_shared_ones(method, tmp_path):
    """Catches a client that starts a round from the server's BatchNorm values (or the initial
    ones) instead of its own: client 1's round-2 reply is replayed independently from
    (round-2 broadcast, shared arrays) + (its round-1 reply, local arrays)."""
    cfg, fed, _, seen = _run(method, tmp_path)
    (_, _, first), (_, broadcast, second) = seen
    cid = 1
    start = {
        k: (dict(first)[cid].arrays[k] if k in LOCAL[method] else v) for k, v in broadcast.items()
    }
    model = build_model("small_cnn", 3).to(memory_format=torch.channels_last)  # the CPU layout
    model.load_state_dict(start)
    keys = (CLIENT_TRAIN, 2, cid, 0)
    torch.manual_seed(derive_seed(cfg.seed, *keys))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.train.lr)
    train_epochs(
        model,
        fed.train[cid],
        optimizer,
        epochs=1,
        batch_size=cfg.train.batch_size,
        generator=generator(cfg.seed, *keys),
    )
    replayed, reply = get_arrays(model), dict(second)[cid].arrays
    assert all(torch.equal(replayed[k], reply[k]) for k in reply)
    # starting from the broadcast's BatchNorm values instead gives another reply
    assert not all(torch.equal(broadcast[k], start[k]) for k in LOCAL[method])


# ------------------------------------------------------------------ evaluation
def _acc(model, data) -> Fraction:
    pred = _logits(model, data).argmax(dim=1)
    return Fraction(int((pred == data.labels).sum()), len(data))


@pytest.mark.parametrize("method", ["fedbn", "silobn"])
def test_id_scores_each_clients_own_model_and_ood_the_averaged_local_arrays(method, tmp_path):
    """Catches id accuracy scored with the server's (initial or averaged) BatchNorm instead of
    the client's own, an unseen-domain model whose local arrays are not the sample-weighted
    mean of the clients' (plain mean, or stale), and run-level ood not scoring that model."""
    cfg, fed, sim, seen = _run(method, tmp_path, rounds=1)
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    replies = dict(seen[-1][2])
    shared = {k: v for k, v in sim.server.global_arrays.items() if k not in LOCAL[method]}
    # the unseen-domain model: shared arrays + the float64 sample-weighted mean of local ones
    unseen = sim.server.eval_arrays(None)
    pairs = [(n, replies[c].arrays) for c, n in enumerate(TRAIN_SIZES)]
    reference = _weighted64(pairs)
    for k in LOCAL[method]:
        if k.endswith("num_batches_tracked"):  # integer counts: the rounded mean
            assert int(unseen[k]) == round(float(reference[k])), k
        else:
            torch.testing.assert_close(unseen[k].double(), reference[k], rtol=REL, atol=1e-12)
    assert all(torch.equal(unseen[k], v) for k, v in shared.items())
    plain = _weighted64([(1, a) for _, a in pairs])
    assert max(_max_gap({k: reference[k]}, {k: plain[k]}) for k in LOCAL[method]) > 1e-4
    # id: each client's own model on its validation split
    own = []
    for cid in range(3):
        arrays = {**shared, **{k: replies[cid].arrays[k] for k in LOCAL[method]}}
        own.append(_model(cfg, arrays))
        loaded = sim.load_eval_model(cid, sim.server.eval_arrays(cid))  # the runner's path
        assert loaded.keys() == arrays.keys()
        assert all(torch.equal(loaded[k], arrays[k]) for k in arrays)
        assert record["per_client"]["id_acc"][cid] == float(_acc(own[cid], fed.val[cid]))
    # ood: the unseen-domain model, mean over target domains (d0: 40 images, d1: 25)
    unseen_model = _model(cfg, unseen)
    expected = [_acc(unseen_model, fed.targets[d]) for d in ("d0", "d1")]
    assert record["per_domain"] == {"d0": float(expected[0]), "d1": float(expected[1])}
    assert record["ood_acc"] == pytest.approx(float(sum(expected) / 2), abs=1e-12)
    # the clients' own models on the targets stay a diagnostic
    per_client = [float(sum(_acc(m, fed.targets[d]) for d in ("d0", "d1")) / 2) for m in own]
    assert record["per_client"]["ood_acc"] == pytest.approx(per_client, abs=1e-12)
    assert record["client_ood_acc"] == pytest.approx(sum(per_client) / 3, abs=1e-12)


@pytest.mark.parametrize(("method", "layers"), [("fedbn", 5), ("silobn", 3)])
def test_efficientnet_lite0_with_its_pretrained_batchnorm_works(method, layers, tmp_path):
    """Catches BatchNorm layers of EfficientNet-Lite0 (49, found by type) not kept local, or
    its pretrained statistics lost: a client that never trained would start from them."""
    cfg = tiny_config(
        rounds=1,
        algorithm=method,
        model={"name": "efficientnet_lite0"},
        train={"batch_size": 8, "lr": 0.01, "optimizer": "sgd"},
    )
    sim = run_sim(cfg, tmp_path / method, tiny_federation(cfg, tiny_dataset(n_per_domain=8)))
    assert len(sim.server.local_mean) == 49 * layers
    pretrained = build_model("efficientnet_lite0", 3).state_dict()
    stem = "featurizer._bn0.running_var"  # ImageNet statistics, far from a fresh layer's ones
    assert not torch.equal(pretrained[stem], torch.ones_like(pretrained[stem]))
    assert torch.equal(sim.server.global_arrays[stem], pretrained[stem])
    kept = [load_local(s)[stem] for s in sim.states]
    assert not torch.equal(kept[0], kept[1]) and not torch.equal(kept[0], pretrained[stem])


# ------------------------------------------------------------------ config-time refusals
@pytest.mark.parametrize("method", ["fedbn", "silobn"])
@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["model.name=lenet5"], "'model.name' = 'lenet5'"),
        (["model.name=small_cnn", "model.options.norm=group"], "'model.name' = 'small_cnn'"),
        (["model.name=hfedf_cnn"], "'model.name' = 'hfedf_cnn'"),
        (["model.name=efficientnet_lite0", "model.frozen=true"], "'model.frozen' = true"),
    ],
    ids=["lenet5", "groupnorm", "hfedf_cnn", "frozen-head"],
)
def test_a_model_without_batchnorm_is_refused_when_the_config_loads(method, overrides, key):
    """Catches a BatchNorm method accepted on a model without BatchNorm (it would silently be
    FedAvg) or refused only after data loading, with a message that does not name the key."""
    with pytest.raises(ConfigError, match=key) as err:
        load_config(None, [f"algorithm.name={method}", *overrides])
    assert "BatchNorm" in str(err.value) and method in str(err.value)


def test_a_composed_batchnorm_client_is_checked_too_and_batchnorm_models_pass():
    """Catches the check skipped for a method used as another aggregator's client part, or a
    model with BatchNorm refused."""
    with pytest.raises(ConfigError, match=r"'model\.name' = 'lenet5'"):
        load_config(None, ["algorithm.name=fedavg", "algorithm.client.name=fedbn"])
    for model in ("small_cnn", "resnet18", "efficientnet_lite0"):
        for method in ("fedbn", "silobn"):
            load_config(None, [f"algorithm.name={method}", f"model.name={model}"])


@pytest.mark.parametrize("method", ["fedbn", "silobn"])
def test_unknown_hyper_parameters_are_refused(method):
    """Catches a typo'd key silently ignored: FedBN and SiloBN take none."""
    with pytest.raises(ConfigError, match=r"unknown key 'algorithm\.server_lr'"):
        load_config(
            None, [f"algorithm.name={method}", "model.name=small_cnn", "algorithm.server_lr=0.5"]
        )


# ------------------------------------------------------------------ stations and Flower
@pytest.mark.usefixtures("task_identity")
def test_fedbn_with_stations_on_flower_equals_the_simulator(tmp_path):
    """Catches a station tier that mixes up local arrays (the server's mean of them must be the
    flat sample-weighted mean of every client's own, kept ones) or a deployed run (nodes keep
    the local arrays, stations run in the ServerApp) that differs from the simulator."""
    cfg = demo_config(
        "algorithm.name=fedbn",
        "model.name=small_cnn",
        "model.options.widths=[8, 16]",
        "topology.stations=2",
        "topology.station_rounds=2",
        "rounds=1",
    )
    sim = simulate(cfg, tmp_path / "sim")
    sizes = [len(t) for t in sim.data.train]
    kept = [load_local(s) for s in sim.states]
    flat = _weighted64([(n, k) for n, k in zip(sizes, kept, strict=True)])
    for k, v in sim.server.local_mean.items():
        if v.is_floating_point():
            # two float64 means (station, server), each rounded to float32 once: each rounding
            # is within half an ulp of a value no larger than the largest input M, so 2**-23 M
            bound = REL * max(float(c[k].abs().max()) for c in kept)
            torch.testing.assert_close(v.double(), flat[k], rtol=0, atol=bound * 1.01)
    deploy_loopback(cfg, tmp_path / "flower")
    assert_same_run(tmp_path / "flower", sim, tmp_path / "sim")
