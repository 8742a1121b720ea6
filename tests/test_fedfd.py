"""FedFD and FedFD-A as federated methods: what the server computes, what each client trains from
and keeps, the losses, the adapter's own optimiser, evaluation, and refused configs
(fedfda.md §8 checks 3, 4, 5, 6 at run level). Expected values come from float64 reference
means, FedAvg's server on the same replies, an independent replay of a client step written out
here, and plain (unconverted) models — never from the code's own output."""

from __future__ import annotations

import copy
import json
import re
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
import torchvision

from feddomain.algorithms.base import ClientContext
from feddomain.algorithms.fedavg import FedAvgHparams, FedAvgServer
from feddomain.algorithms.fedfd import (
    FedFDClient,
    FedFDHparams,
    FedFDServer,
    fedfd_loss,
    frozen_statistics,
)
from feddomain.algorithms.fedfd_a import FedFDAClient, FedFDAHparams, adapter_loss
from feddomain.algorithms.layout import LayoutClient, LayoutServer
from feddomain.config import load_config
from feddomain.errors import ConfigError
from feddomain.federation.data import ClientData
from feddomain.federation.layout import load_local
from feddomain.federation.messages import Message
from feddomain.federation.simulation import Simulation
from feddomain.federation.topology import CLIENT_TRAIN, derive_seed, generator
from feddomain.federation.training import get_arrays, train_epochs
from feddomain.models import build_model
from feddomain.models.fedfd_bn import BNMode, adapter_parameters, convert_batchnorm, set_bn_mode
from tests.engine_helpers import tiny_config
from tests.test_evidence_engine import (
    TRAIN_SIZES,
    _plain,
    _spy_aggregate,
    _weighted64,
    uneven_federation,
)

BN = [f"featurizer.{i}.1" for i in range(3)]  # small_cnn's BatchNorm layers
STATS = ("running_mean", "running_var", "num_batches_tracked")
LOCAL = {f"{b}.{leaf}" for b in BN for leaf in STATS}
GLOBAL = {f"{b}.{leaf}" for b in BN for leaf in ("global_mean", "global_var")}
REL = 2**-23  # a float64 mean rounded once to float32


def fd_config(method: str, **overrides):
    algorithm = overrides.pop("algorithm", {})
    return tiny_config(
        model={"name": "small_cnn"}, algorithm={"name": method, **algorithm}, **overrides
    )


def _run(method: str, tmp_path, rounds: int = 2, **overrides):
    cfg = fd_config(method, rounds=rounds, **overrides)
    fed = uneven_federation(cfg)
    tmp_path.mkdir(parents=True, exist_ok=True)
    sim = Simulation(cfg, fed, tmp_path)
    seen = _spy_aggregate(sim)
    sim.run()
    return cfg, fed, sim, seen


def _acc_of(model: torch.nn.Module, data: ClientData) -> Fraction:
    """Exact accuracy of ``model`` (as it is) on ``data``'s un-augmented inputs."""
    with torch.no_grad():
        pred = model(_plain(data)).argmax(dim=1)
    return Fraction(int((pred == data.labels).sum()), len(data))


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ check 3: the server
@pytest.mark.parametrize("method", ["fedfd", "fedfd_a"])
def test_global_statistics_are_the_sample_weighted_mean_of_the_clients_running_statistics(
    method, tmp_path
):
    """Catches global statistics that are a plain (or stale) mean, or not pushed; shared arrays
    (adapters included) that are not FedAvg's sample-weighted mean; global statistics sent up;
    and a server that overwrites the running statistics each client keeps (§8 check 3)."""
    _, _, sim, seen = _run(method, tmp_path)
    init = get_arrays(sim.server.ctx.model_factory())
    adapters = {k for k in init if ".adapter." in k}
    assert bool(adapters) == (method == "fedfd_a")
    results = [seen[1][1], sim.server.global_arrays]  # after round 1 (= round 2's broadcast), 2
    for (rnd, _, replies), result in zip(seen, results, strict=True):
        assert all(m.arrays.keys() == init.keys() - GLOBAL for _, m in replies)
        pairs = [(n, m.arrays) for n, (_, m) in zip(TRAIN_SIZES, replies, strict=True)]
        reference = _weighted64(pairs)
        for leaf, source in (("global_mean", "running_mean"), ("global_var", "running_var")):
            for b in BN:
                got, want = result[f"{b}.{leaf}"].double(), reference[f"{b}.{source}"]
                torch.testing.assert_close(got, want, rtol=REL, atol=1e-12)
                plain = _weighted64([(1, a) for _, a in pairs])[f"{b}.{source}"]
                assert (plain - want).abs().max() > 1e-5  # weighting by n_k is visible
        fedavg = FedAvgServer(sim.server.ctx, FedAvgHparams())
        fedavg.aggregate(rnd, iter((c, m.copy()) for c, m in replies))
        for k in init.keys() - LOCAL - GLOBAL:
            assert torch.equal(result[k], fedavg.global_arrays[k]), k
        for k in LOCAL:  # running statistics never go down: the initial values stay
            assert torch.equal(result[k], init[k]), k
    last = dict(seen[-1][2])
    for cid in range(3):
        kept = load_local(sim.states[cid])
        assert kept.keys() == LOCAL
        assert all(torch.equal(kept[k], last[cid].arrays[k]) for k in LOCAL)
    a, b = load_local(sim.states[0]), load_local(sim.states[1])
    assert not torch.equal(a[f"{BN[1]}.running_mean"], b[f"{BN[1]}.running_mean"])


def _replay_step(model, x, y, u_mode: BNMode, lambdas=(1.0, 1.0)) -> torch.Tensor:
    """FedFD's loss (§3.4), written out: CE on the batch-mode path, CAFL and CACL on the
    path with every layer in ``u_mode``."""
    set_bn_mode(model, BNMode("batch"))
    f = model.featurizer(x)
    ce = F.cross_entropy(model.classifier(f), y)
    set_bn_mode(model, u_mode)
    f_mix = model.featurizer(x)
    set_bn_mode(model, BNMode("batch"))
    cafl = ((f - f_mix) ** 2).sum(dim=1).mean()
    return ce + lambdas[0] * cafl + lambdas[1] * F.cross_entropy(model.classifier(f_mix), y)


def test_a_client_trains_from_the_pushed_global_statistics_and_its_own_running_ones(tmp_path):
    """Catches a client that starts a round from the server's running statistics (or keeps
    stale global statistics), and a client loss that is not CE + CAFL + CACL: client 1's
    round-2 reply is replayed from (broadcast shared and global arrays) + (its round-1 running
    statistics) with the loss written out above."""
    cfg, fed, _, seen = _run("fedfd", tmp_path)
    (_, _, first), (_, broadcast, second) = seen
    cid = 1
    own = dict(first)[cid].arrays
    start = {k: own[k] if k in LOCAL else v for k, v in broadcast.items()}
    assert not all(torch.equal(broadcast[k], own[k]) for k in LOCAL)
    model = convert_batchnorm(build_model("small_cnn", 3))
    model = model.to(memory_format=torch.channels_last)  # the engine's CPU layout
    model.load_state_dict(start)
    keys = (CLIENT_TRAIN, 2, cid, 0)
    torch.manual_seed(derive_seed(cfg.seed, *keys))
    train_epochs(
        model,
        fed.train[cid],
        torch.optim.SGD(model.parameters(), lr=cfg.train.lr),
        epochs=1,
        batch_size=cfg.train.batch_size,
        generator=generator(cfg.seed, *keys),
        loss_fn=lambda m, x, y: _replay_step(m, x, y, BNMode("random")),
    )
    replayed, reply = get_arrays(model), dict(second)[cid].arrays
    assert all(torch.equal(replayed[k], reply[k]) for k in reply)
    for k in GLOBAL:  # the global statistics did not move during local training
        assert torch.equal(replayed[k], broadcast[k])


# ------------------------------------------------------------------ check 4: the losses
def _small_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = convert_batchnorm(build_model("small_cnn", 3, widths=(4, 8)))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("global_mean"):
                buf.normal_(0, 0.5, generator=g)
            elif name.endswith("global_var"):
                buf.uniform_(0.5, 2.0, generator=g)
    return model.train()


def _batch(n: int = 10, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, 16, 16, generator=g) * torch.rand(n, 3, 1, 1, generator=g) * 3
    return x, torch.arange(n) % 3


def test_the_feature_loss_vanishes_when_both_paths_are_the_same():
    """Catches a diversified path that differs from the ordinary one when it should not
    (local_stats=batch and u = 1 give BatchNorm's own normalisation): CAFL = 0 then, and CACL
    equals the path-1 CE, so the loss is CE (λ_C = 0) or 2·CE (λ_F = 0) (§8 check 4)."""
    model, (x, y) = _small_model(), _batch()
    ce = F.cross_entropy(copy.deepcopy(model)(x), y).item()
    same = dict(local_stats="batch", u=1.0)
    only_feature = fedfd_loss(FedFDHparams(**same, lambda_classifier=0.0))(model, x, y)
    assert abs(only_feature.item() - ce) <= 1e-5 * abs(ce)
    only_classifier = fedfd_loss(FedFDHparams(**same, lambda_feature=0.0))(model, x, y)
    assert abs(only_classifier.item() - 2 * ce) <= 1e-5 * abs(ce)
    differs = fedfd_loss(FedFDHparams(u=1.0, lambda_classifier=0.0))(model, x, y)
    assert differs.item() - ce > 1e-2  # instance statistics: the paths really differ


def test_the_losses_are_hand_computed_ce_cafl_and_cacl_on_the_diversified_path():
    """Catches CAFL as a per-dimension mean (or over the wrong axis), CACL on the wrong logits,
    the λ weights swapped, or ``feature_loss: mean`` not dividing the sum by the width: each
    term against a float64 computation from the two paths' features, obtained here by setting
    the modes by hand (u fixed at 0.3)."""
    model, (x, y) = _small_model(), _batch()
    reference = copy.deepcopy(model)
    set_bn_mode(reference, BNMode("batch"))
    f = reference.featurizer(x).double()
    set_bn_mode(reference, BNMode("fixed", alpha=0.3))
    f_mix = reference.featurizer(x)
    ce = F.cross_entropy(reference.classifier(f.float()).double(), y)
    cacl = F.cross_entropy(reference.classifier(f_mix).double(), y)
    cafl = ((f - f_mix.double()) ** 2).sum(dim=1).mean()
    assert cafl > 4 * ((f - f_mix.double()) ** 2).mean()  # 8 dims: the sum is 8x the mean
    loss = fedfd_loss(FedFDHparams(u=0.3, lambda_feature=0.25, lambda_classifier=4.0))
    got = loss(model, x, y).double()
    want = ce + 0.25 * cafl + 4.0 * cacl
    assert abs(got - want) <= 1e-5 * abs(want)
    per_dimension = FedFDHparams(u=0.3, lambda_feature=0.25, lambda_classifier=4.0,
                                 feature_loss="mean")  # fmt: skip
    got = fedfd_loss(per_dimension)(model, x, y).double()
    want = ce + 0.25 * cafl / 8 + 4.0 * cacl  # F3's fallback: λ_F / d on the sum, d = 8
    assert abs(got - want) <= 1e-5 * abs(want)


def test_fedfd_without_its_losses_is_silobn_number_for_number(tmp_path):
    """Catches FedFD's training or federation differing from its SiloBN base beyond the two
    losses (λ_F = λ_C = 0 and local test statistics must give SiloBN's run exactly)."""
    _, _, fd, _ = _run(
        "fedfd",
        tmp_path / "fedfd",
        algorithm={"lambda_feature": 0.0, "lambda_classifier": 0.0, "test_mode": "local"},
    )
    cfg = tiny_config(model={"name": "small_cnn"}, algorithm="silobn", rounds=2)
    (tmp_path / "silobn").mkdir()
    silo = Simulation(cfg, uneven_federation(cfg), tmp_path / "silobn")
    silo.run()
    for k, v in silo.server.global_arrays.items():
        assert torch.equal(fd.server.global_arrays[k], v), k
    for a, b in zip(fd.states, silo.states, strict=True):
        assert all(torch.equal(load_local(a)[k], v) for k, v in load_local(b).items())
    drop = ("time", "bytes_down", "ledger", "diagnostics")  # FedFD also logs its loss terms
    fd_records, silo_records = _records(tmp_path / "fedfd"), _records(tmp_path / "silobn")
    for a, b in zip(fd_records, silo_records, strict=True):
        assert {k: v for k, v in a.items() if k not in drop} == {
            k: v for k, v in b.items() if k not in drop
        }
        # what FedFD sends beyond SiloBN: each layer's global mean and variance, to 3 clients
        assert a["bytes_down"] - b["bytes_down"] == 3 * 2 * 4 * (32 + 64 + 128)
        up_a, up_b = a["ledger"]["up"], b["ledger"]["up"]
        assert (up_a["model"], up_a["statistics"]) == (up_b["model"], up_b["statistics"])
        assert up_a["scalars"] - up_b["scalars"] == 3 * 8 * 3  # ce, cafl, cacl per client


# ------------------------------------------------------------------ check 6: evaluation
def test_fedfd_scores_the_unseen_domain_with_the_global_statistics_and_training_ignores_test_mode(
    tmp_path,
):
    """Catches FedFD's ood (and id) accuracy read with local or running statistics instead of
    the global ones, and a test mode that changes training: a plain small_cnn whose running
    statistics are the server's global statistics must score exactly the logged accuracies."""
    _, fed, sim, _ = _run("fedfd", tmp_path / "global", rounds=1)
    _, _, tbn, _ = _run("fedfd", tmp_path / "tbn", rounds=1, algorithm={"test_mode": "instance"})
    for k, v in sim.server.global_arrays.items():
        assert torch.equal(tbn.server.global_arrays[k], v), k
    arrays = sim.server.global_arrays
    plain = build_model("small_cnn", 3)
    stats = ("running_mean", "running_var")  # loaded from the global statistics
    plain.load_state_dict(
        {k: arrays[k.replace("running_", "global_") if k.endswith(stats) else k]
         for k in plain.state_dict()}
    )  # fmt: skip
    plain.eval()
    record = _records(tmp_path / "global")[-1]
    expected = {d: float(_acc_of(plain, fed.targets[d])) for d in ("d0", "d1")}
    assert record["per_domain"] == expected
    assert record["per_client"]["id_acc"] == [float(_acc_of(plain, v)) for v in fed.val]
    assert _records(tmp_path / "tbn")[-1]["ood_nll"] != record["ood_nll"]  # its mode is used


@pytest.mark.parametrize(
    ("method", "test_mode", "scorings"),
    [("fedfd", "global", 1), ("fedfd", "instance", 1), ("fedfd_a", "adapter", 1),
     ("fedfd", "random", 1), ("fedfd", "local", 3)],
)  # fmt: skip
def test_the_target_is_scored_once_unless_the_test_mode_reads_each_clients_statistics(
    method, test_mode, scorings, tmp_path, monkeypatch
):
    """Catches every client scoring the target domains with its own running statistics loaded
    when the test mode never reads them (once per client instead of once: ten times the
    evaluation on digits3-bn), ``local`` (SiloBN's) losing its per-client models, and the
    shortcut changing a number: every deterministic mode logs what the per-client evaluation
    (each client's own statistics, the server's mean of them for the unseen domain) logs."""

    def run(out):
        cfg = fd_config(method, rounds=1, algorithm={"test_mode": test_mode})
        out.mkdir()
        sim = Simulation(cfg, uneven_federation(cfg), out)
        calls = []
        score_held_out = sim.score_held_out
        sim.score_held_out = lambda: calls.append(1) or score_held_out()
        sim.run()
        return sim, calls, _records(out)[-1]

    sim, calls, record = run(tmp_path / "once")
    assert len(calls) == scorings
    assert (sim.server.eval_arrays(None) is None) == (test_mode != "local")
    if test_mode == "random":
        return  # one draw of the mixing weights now, one per client before: not comparable
    monkeypatch.setattr(FedFDClient, "eval_arrays", LayoutClient.eval_arrays)
    monkeypatch.setattr(FedFDServer, "eval_arrays", LayoutServer.eval_arrays)
    _, per_client_calls, per_client = run(tmp_path / "per_client")
    assert len(per_client_calls) == 3
    for key in ("id_acc", "ood_acc", "per_domain", "ood_nll", "ood_ece"):  # up to the mean
        assert record[key] == pytest.approx(per_client[key], rel=1e-12), key  # of equal values
    for key, values in per_client["per_client"].items():
        assert record["per_client"][key] == pytest.approx(values, rel=1e-12), key


def test_a_batchnorm_layer_fedfd_does_not_convert_is_refused():
    """Catches a model with a BatchNorm1d accepted: FedFD leaves it as it is, so every test
    mode would read its running statistics, which clients keep local."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                torch.nn.Flatten(), torch.nn.BatchNorm1d(4))  # fmt: skip
    assert "other BatchNorm layers (3)" in frozen_statistics(model, FedFDHparams())
    assert frozen_statistics(model[:2], FedFDHparams()) is None


def test_fedfd_a_scores_the_same_with_evaluation_batches_of_1_and_512(tmp_path):
    """Catches FedFD-A's evaluation depending on the test batch (per-sample inference, §3.6):
    every logged number is the same at eval.batch_size 1 and 512."""
    _run("fedfd_a", tmp_path / "b512", rounds=1)
    _run("fedfd_a", tmp_path / "b1", rounds=1, eval={"every": 1, "batch_size": 1})
    a, b = _records(tmp_path / "b512"), _records(tmp_path / "b1")
    for key in ("id_acc", "ood_acc", "per_domain", "per_client"):
        assert a[-1][key] == b[-1][key], key
    assert b[-1]["ood_nll"] == pytest.approx(a[-1]["ood_nll"], rel=1e-5)
    _run("fedfd_a", tmp_path / "local1", rounds=1, eval={"every": 1, "batch_size": 1},
         algorithm={"test_mode": "local"})  # fmt: skip
    local = _records(tmp_path / "local1")[-1]["ood_nll"]  # batch statistics: a real test
    assert local != pytest.approx(a[-1]["ood_nll"], rel=1e-3)


# ------------------------------------------------------------------ check 5: the adapter step
def _client_context(model, state: Message, lr: float = 0.05) -> ClientContext:
    x, y = _batch(n=12, seed=5)
    data = ClientData(x, y)
    return ClientContext(
        cid=0,
        rnd=1,
        model=model,
        train=data,
        val=data,
        state=state,
        generator=torch.Generator().manual_seed(0),
        local_epochs=1,
        batch_size=12,  # one step
        make_optimizer=lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9, weight_decay=5e-4),
        lr=lr,
        persistent_optimizer=True,
    )


def _fedfd_a_model() -> torch.nn.Module:
    return _with_adapters(_small_model())


def _with_adapters(model: torch.nn.Module) -> torch.nn.Module:
    """``_small_model`` with adapters whose output layer is not zero (a non-zero gradient
    reaches every adapter weight)."""
    torch.manual_seed(1)
    adapted = convert_batchnorm(build_model("small_cnn", 3, widths=(4, 8)), adapter_reduction=2)
    adapted.load_state_dict({**adapted.state_dict(), **model.state_dict()})
    with torch.no_grad():
        for p in adapter_parameters(adapted):
            p.normal_(0, 0.3)
    return adapted.train()


def _names(model, adapters: bool) -> list[str]:
    return [n for n, _ in model.named_parameters() if (".adapter." in n) == adapters]


def test_an_adapter_step_moves_only_the_adapters_by_its_own_sgd(monkeypatch):
    """Catches L_A's gradient reaching the backbone or classifier (an adapter step must leave
    them bit-identical), the adapters on the main optimiser, and an adapter lr that is not
    adapter_lr_mult × the round's lr: one SGD step is −lr·mult·∂L_A/∂θ_A (§8 check 5)."""
    hp = FedFDAHparams(adapter_lr_mult=10.0)
    model = _fedfd_a_model()
    ctx = _client_context(model, Message("state"))
    reference = copy.deepcopy(model)
    x, y = next(ctx.train.batches(12, torch.Generator().manual_seed(0)))
    grads = torch.autograd.grad(adapter_loss(reference, x, y), list(adapter_parameters(reference)))
    before = {k: v.clone() for k, v in model.named_parameters()}
    client = FedFDAClient(hp)
    monkeypatch.setattr(client, "loss_fn", lambda msg, ctx: adapter_loss)
    client.train(get_arrays(model), Message("fit"), ctx)
    after = dict(model.named_parameters())
    for k in _names(model, adapters=False):
        assert torch.equal(after[k], before[k]), k
    adapter_names = _names(model, adapters=True)
    for k, g in zip(adapter_names, grads, strict=True):
        torch.testing.assert_close(after[k] - before[k], -0.5 * g, rtol=1e-4, atol=1e-7)
    assert any(g.abs().max() > 1e-4 for g in grads)
    # both optimisers' states persist, each under its own prefix
    assert sum(k.startswith("adapter_optimizer/") for k in ctx.state.arrays) == len(grads)
    assert sum(k.startswith("optimizer/") for k in ctx.state.arrays) == 0  # no main gradient


def test_a_main_step_leaves_the_adapters_and_the_sum_splits_by_parameter_set(monkeypatch):
    """Catches FedFD's loss reaching the adapters (a main step must leave them unchanged), and
    FedFD-A's summed loss mixing the two gradients: on the main parameters it is FedFD's
    gradient, on the adapters L_A's, exactly."""
    hp = FedFDAHparams()
    model = _fedfd_a_model()
    ctx = _client_context(model, Message("state"))
    x, y = next(ctx.train.batches(12, torch.Generator().manual_seed(0)))
    params = dict(model.named_parameters())
    main, adapters = _names(model, False), _names(model, True)
    torch.manual_seed(7)
    g_fd = torch.autograd.grad(fedfd_loss(hp)(model, x, y), [params[k] for k in main])
    g_a = torch.autograd.grad(adapter_loss(model, x, y), [params[k] for k in adapters])
    torch.manual_seed(7)
    client = FedFDAClient(hp)
    total = client.loss_fn(Message("fit"), ctx)(model, x, y)
    g_total = torch.autograd.grad(total, [params[k] for k in main + adapters])
    for a, b in zip(g_total, (*g_fd, *g_a), strict=True):
        assert torch.equal(a, b)
    before = {k: v.clone() for k, v in params.items()}
    monkeypatch.setattr(client, "loss_fn", lambda msg, ctx: fedfd_loss(hp))
    client.train(get_arrays(model), Message("fit"), ctx)
    for k in adapters:
        assert torch.equal(params[k], before[k]), k
    assert not torch.equal(params[main[0]], before[main[0]])


def test_persistent_optimisers_keep_the_adapters_momentum_across_rounds(tmp_path):
    """Catches the adapter optimiser's state lost between a client's rounds (or written over
    the main optimiser's) under train.persistent_optimizer."""
    _, _, sim, _ = _run(
        "fedfd_a",
        tmp_path,
        train={"optimizer": "sgd", "momentum": 0.9, "lr": 0.05, "persistent_optimizer": True},
    )
    names = _names(sim.model, adapters=True)
    for state in sim.states:
        adapter = {k for k in state.arrays if k.startswith("adapter_optimizer/")}
        main = {k for k in state.arrays if k.startswith("optimizer/")}
        assert adapter == {f"adapter_optimizer/{i}.momentum_buffer" for i in range(len(names))}
        assert len(main) == len(_names(sim.model, adapters=False))


# ------------------------------------------------------------------ warm-up
def test_the_warm_up_pass_sets_global_statistics_from_every_clients_data(tmp_path):
    """Catches a warm-up that leaves the fresh (0, 1) statistics, averages unweighted, or is
    not one pass of each client's data at the initial weights: the global statistics before
    round 1 against plain small_cnns run over each client's data (one batch each here)."""
    cfg = fd_config("fedfd", rounds=1, algorithm={"warmup": True}, train__batch_size=64)
    fed = uneven_federation(cfg)
    sim = Simulation(cfg, fed, tmp_path)
    seen = _spy_aggregate(sim)
    sim.run()
    broadcast = seen[0][1]
    init = get_arrays(sim.server.ctx.model_factory())
    pairs = []
    for data in fed.train:
        plain = build_model("small_cnn", 3).to(memory_format=torch.channels_last)  # CPU layout
        plain.load_state_dict({k: init[k] for k in plain.state_dict()})
        plain.train()
        with torch.no_grad():
            for m in plain.modules():
                if isinstance(m, torch.nn.BatchNorm2d):
                    m.momentum = 1.0  # the statistics of this one batch
            plain(_plain(data))
        pairs.append((len(data), get_arrays(plain)))
    reference = _weighted64(pairs)
    for b in BN:
        for leaf, source in (("global_mean", "running_mean"), ("global_var", "running_var")):
            got, want = broadcast[f"{b}.{leaf}"].double(), reference[f"{b}.{source}"]
            # float32 moments of 16k values per channel, summed in another order by FedFD's
            # layer than by nn.BatchNorm2d: ~1e-4 relative (a wrong pass is off by > 1e-2)
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
    assert not torch.equal(broadcast[f"{BN[0]}.global_var"], torch.ones(32))
    rounds = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert rounds[0]["round"] == 0 and rounds[0]["task"] == "collect"


# ------------------------------------------------------------------ config-time refusals
@pytest.mark.parametrize("method", ["fedfd", "fedfd_a"])
@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["model.name=lenet5"], r"'model\.name' = 'lenet5'.*BatchNorm"),
        (["model.name=small_cnn", "model.options.norm=group"], r"'model\.name' = 'small_cnn'"),
        (["model.name=efficientnet_lite0", "model.frozen=true"], r"'model\.frozen' = true"),
        (["model.name=small_cnn", "model.options.freeze_bn_stats=true"], r"freeze_bn_stats"),
        (["model.name=small_cnn", "algorithm.u=1.5"], r"'algorithm\.u': .*less than or equal to 1"),
        (["model.name=small_cnn", "algorithm.u=-0.1"], r"'algorithm\.u': .*greater than or equal"),
        (["model.name=small_cnn", "algorithm.test_alpha=1.2"], r"'algorithm\.test_alpha'"),
        (["model.name=small_cnn", "algorithm.u=0.5", "algorithm.u_per_sample=true"],
         r"'algorithm\.u_per_sample'"),
        (["model.name=small_cnn", "algorithm.lambda_feature=-1"], r"'algorithm\.lambda_feature'"),
        (["model.name=small_cnn", "algorithm.lamda_feature=1"], r"unknown key 'algorithm\.lamda_"),
    ],
    ids=["lenet5", "groupnorm", "frozen-head", "frozen-stats", "u>1", "u<0", "alpha>1",
         "per-sample-fixed-u", "negative-lambda", "typo"],
)  # fmt: skip
def test_bad_input_is_refused_when_the_config_loads_naming_the_key(method, overrides, key):
    """Catches FedFD accepted on a model it cannot train (no or frozen BatchNorm statistics: it
    would silently be FedAvg), or u/α outside [0, 1], with a message that names the key."""
    with pytest.raises(ConfigError, match=key):
        load_config(None, [f"algorithm.name={method}", *overrides])


def test_adapter_settings_are_fedfd_a_only_and_checked():
    """Catches FedFD accepting FedFD-A's adapter test mode (it has no adapters) or a zero
    reduction for the adapters."""
    with pytest.raises(ConfigError, match=r"'algorithm\.test_mode'"):
        load_config(
            None, ["algorithm.name=fedfd", "model.name=small_cnn", "algorithm.test_mode=adapter"]
        )
    with pytest.raises(ConfigError, match=r"'algorithm\.adapter_reduction'"):
        load_config(
            None,
            ["algorithm.name=fedfd_a", "model.name=small_cnn", "algorithm.adapter_reduction=0"],
        )
    load_config(
        None, ["algorithm.name=fedfd_a", "model.name=resnet18", "algorithm.test_mode=fixed"]
    )


def test_a_weights_file_that_is_missing_or_does_not_fit_is_refused_when_the_config_loads(tmp_path):
    """Catches a bad pretrained-weights path found only when the run builds its model (after
    data loading), or reported without the key: missing, another network's, a wrong shape."""
    base = ["algorithm.name=fedfd", "model.name=resnet18"]
    missing = tmp_path / "nope.pt"
    with pytest.raises(
        ConfigError, match=rf"'model\.options\.weights_path'.*not found: {re.escape(str(missing))}"
    ):
        load_config(None, [*base, f"model.options.weights_path={missing}"])
    other = tmp_path / "small.pt"
    torch.save(build_model("small_cnn", 3).state_dict(), other)
    with pytest.raises(
        ConfigError, match=r"'model\.options\.weights_path'.*does not match resnet18: missing keys"
    ):
        load_config(None, [*base, f"model.options.weights_path={other}"])
    state = torchvision.models.resnet18().state_dict()
    state["conv1.weight"] = torch.zeros(64, 3, 3, 3)
    shape = tmp_path / "shape.pt"
    torch.save(state, shape)
    with pytest.raises(
        ConfigError, match=r"'model\.options\.weights_path'.*conv1\.weight has shape"
    ):
        load_config(None, [*base, f"model.options.weights_path={shape}"])
    good = tmp_path / "r18.pt"
    torch.save(torchvision.models.resnet18().state_dict(), good)
    load_config(None, [*base, f"model.options.weights_path={good}"])


# ------------------------------------------------------------------ monitoring (CHOICE F3)
@pytest.mark.parametrize("method", ["fedfd", "fedfd_a"])
def test_the_logged_loss_terms_add_up_to_the_training_loss_and_are_sample_weighted(
    method, tmp_path
):
    """Catches loss terms reported from the wrong path or weighted by λ (each client's terms
    must add up, with the λs, to its training loss, which the shared loop measures on its
    own), and a server mean of them that is not weighted by the clients' sample counts."""
    lambdas = {"lambda_feature": 0.25, "lambda_classifier": 2.0}
    _, _, _, seen = _run(method, tmp_path, rounds=1, algorithm=lambdas)
    replies = [m for _, m in seen[0][2]]
    for m in replies:
        s = m.scalars
        total = s["ce"] + 0.25 * s["cafl"] + 2.0 * s["cacl"] + s.get("adapter_ce", 0.0)
        assert total == pytest.approx(s["loss"], rel=1e-5)
        assert ("adapter_ce" in s) == (method == "fedfd_a")
    record = _records(tmp_path)[-1]["diagnostics"]["loss_terms"]
    for name in ("ce", "cafl", "cacl"):
        want = sum(n * m.scalars[name] for n, m in zip(TRAIN_SIZES, replies, strict=True))
        assert record[name] == pytest.approx(want / sum(TRAIN_SIZES), rel=1e-12)
    assert record["cafl_over_ce"] == pytest.approx(record["cafl"] / record["ce"], rel=1e-12)
