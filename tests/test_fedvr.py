"""FedVR: fedvr.md §8 checks A1-A10, the privacy declaration, bad hyper-parameters, and the
resume / Flower guarantees. Runs use the tiny synthetic federation in frozen-feature mode (the
random LeNet-5's features, cached), so every test takes seconds."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from feddomain.algorithms import resolve_method
from feddomain.algorithms.base import ServerContext
from feddomain.algorithms.fedvr import (
    STATS_ARRAY,
    FedVRClient,
    FedVRServer,
    feature_statistics,
    generalisation_weights,
    loss_statistics,
    variance_shift,
)
from feddomain.algorithms.hfedf import DomainEncoder, client_gradients
from feddomain.errors import ConfigError, DataError
from feddomain.federation.data import UNLABELED, ClientData
from feddomain.federation.messages import Message
from feddomain.federation.training import set_arrays
from feddomain.models.frozen import head_model
from tests.engine_helpers import run_sim, tiny_config, tiny_dataset, tiny_federation


def frozen_config(tmp: Path, algorithm: dict | str = "fedvr", **overrides: object):
    """The tiny federation on cached LeNet-5 features with FedVR's protocol knobs."""
    algorithm = {"name": algorithm} if isinstance(algorithm, str) else algorithm
    base = {
        "model__frozen": True,
        "model__head_adapter": 8,
        "dataset__cache_dir": str(tmp / "cache"),
        "split__pilot_fraction": 0.1,
        "train__drop_last": True,
        "train__momentum": 0.9,
        "algorithm": algorithm,
    }
    return tiny_config(**{**base, **overrides})


def make_server(
    n_features: int = 6, n_classes: int = 3, n_clients: int = 3, **hp: object
) -> FedVRServer:
    spec = resolve_method("fedvr", {"embed_dim": 4, "hidden": 5, "encoder_hidden": 7, **hp})
    factory = lambda: head_model(n_features, n_classes, adapter=2)  # noqa: E731
    return FedVRServer(ServerContext(factory, n_clients, seed=0, rounds=3), spec.hp)


def set_statistics(server: FedVRServer, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    stats = torch.randn(server.ctx.n_clients, server.hnet.encoder.in_features, generator=g)
    server.on_collect({c: Message("stats", {STATS_ARRAY: stats[c]}) for c in range(len(stats))})


def reply(delta: dict, loss_mean: float, loss_var: float) -> Message:
    scalars = {"num_examples": 10, "loss": loss_mean, "loss_mean": loss_mean, "loss_var": loss_var}
    return Message("fit", delta, {**scalars, "batches": 3})


def random_deltas(server: FedVRServer, seed: int = 1) -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        c: {k: 1e-2 * torch.randn(v.shape, generator=g) for k, v in server.generated(c).items()}
        for c in range(server.ctx.n_clients)
    }


def surrogate_gradients(server: FedVRServer, deltas: dict) -> dict[int, list[torch.Tensor]]:
    """g_i by plain autograd of Σ⟨θ_i^0, stopgrad(Δ_i)⟩ w.r.t. (φ, ψ), in trainable() order."""
    params = server.trainable()
    out = {}
    for cid, delta in deltas.items():
        theta0 = server.hnet(cid)
        s = sum((theta0[k] * delta[k].detach()).sum() for k in theta0)
        out[cid] = list(torch.autograd.grad(s, params))
    return out


# ----------------------------------------------------------------------------- A1 shapes


@pytest.mark.parametrize(("classes", "expected"), [(7, 278_599), (65, 397_441), (5, 274_501)])
def test_a1_generated_adapter_and_classifier_sizes(classes: int, expected: int) -> None:
    """Catches a client model of the wrong architecture (fedvr.md §3.1: |θ| for PACS /
    Office-Home / VLCS on 2048-d ResNet-50 features, r = 64)."""
    model = head_model(2048, classes, adapter=64)
    assert sum(p.numel() for p in model.parameters()) == expected
    assert [k for k in model.state_dict()] == [
        "featurizer.down.weight",
        "featurizer.down.bias",
        "featurizer.up.weight",
        "featurizer.up.bias",
        "classifier.weight",
        "classifier.bias",
    ]


def test_a1_encoder_size_and_the_hypernetwork_emits_exactly_the_model_tensors() -> None:
    """Catches an encoder of the wrong shape (557,440 parameters for 2048 -> 256 -> 128), and a
    hypernetwork that emits tensors the client model does not have (or misses one)."""
    assert sum(p.numel() for p in DomainEncoder(2048, 256, 128).parameters()) == 557_440
    server = make_server()
    set_statistics(server)
    model = head_model(6, 3, adapter=2)
    for cid in range(3):
        generated = server.generated(cid)
        assert {k: v.shape for k, v in generated.items()} == {
            k: v.shape for k, v in model.state_dict().items()
        }


def test_a1_only_the_head_trains_on_cached_features(tmp_path: Path) -> None:
    """Catches a backbone inside the trained model: with frozen features the clients' model is
    the adapter and classifier only, so no backbone tensor can change or get a gradient (the
    cache equals the eval-mode forward: tests/test_frozen_features.py)."""
    sim = run_sim(frozen_config(tmp_path, rounds=1), tmp_path / "run")
    assert set(sim.model.state_dict()) == {
        f"{p}.{t}"
        for p in ("featurizer.down", "featurizer.up", "classifier")
        for t in ("weight", "bias")
    }
    assert sim.data.train[0].inputs.dim() == 2  # clients hold feature rows, not images


# ----------------------------------------------------------------------------- A2 identity


def test_a2_every_generated_adapter_starts_as_the_identity() -> None:
    """Catches adapter output heads that are not zero-initialised (weight and bias), so the
    round-0 adapter would perturb the frozen feature for some embedding."""
    server = make_server()
    set_statistics(server)
    model = head_model(6, 3, adapter=2)
    z = torch.randn(5, 6)
    for stats in [*server.hnet.statistics, 10 * torch.randn(6), torch.zeros(6)]:
        theta = server.synthesise(stats)
        assert not theta["featurizer.up.weight"].any() and not theta["featurizer.up.bias"].any()
        assert theta["featurizer.down.weight"].abs().sum() > 0
        set_arrays(model, {k: v.detach() for k, v in theta.items()})
        assert torch.equal(model.featurizer(z), z)


# ----------------------------------------------------------------------------- A3 weights


def test_a3_generalisation_weights() -> None:
    """Catches α not normalised, τ = 0 not uniform, weights not decreasing in V, no one-hot
    limit, or an overflow for large τ (no max-subtraction)."""
    v = torch.tensor([0.05, 0.01, 0.2, 0.011], dtype=torch.float64)
    alpha = generalisation_weights(v, 10.0)
    assert float(alpha.sum()) == pytest.approx(1.0, abs=1e-15)
    order = torch.argsort(v)
    assert torch.all(alpha[order][:-1] > alpha[order][1:])  # strictly decreasing in V
    assert torch.equal(generalisation_weights(v, 0.0), torch.full((4,), 0.25, dtype=torch.float64))
    one_hot = generalisation_weights(v, 1e6)
    assert torch.equal(one_hot, torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64))
    huge = generalisation_weights(torch.tensor([1e3, 2e3, 1e3 + 1e-3]), 1e6)
    assert torch.isfinite(huge).all() and float(huge[0]) == 1.0
    # hand value: τ = 1, V = (0, ln 2): α = (2/3, 1/3)
    two = generalisation_weights(torch.tensor([0.0, np.log(2)], dtype=torch.float64), 1.0)
    assert two.tolist() == pytest.approx([2 / 3, 1 / 3], abs=1e-15)


# ----------------------------------------------------------------------------- A4 variance term


def test_a4_variance_gradient_formula_on_quadratics() -> None:
    """Catches a wrong variance-gradient formula: (2/N) Σ (L_i − L̄) ∇L_i must equal autograd's
    gradient of (1/N) Σ (L_i − L̄)² on differentiable L_i(ψ)."""
    g = torch.Generator().manual_seed(0)
    psi = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True)
    quads = [
        (
            torch.randn(4, 5, dtype=torch.float64, generator=g),
            torch.randn(4, dtype=torch.float64, generator=g),
        )
        for _ in range(3)
    ]
    losses = torch.stack([0.5 * ((a @ psi - b) ** 2).sum() for a, b in quads])
    (auto,) = torch.autograd.grad(((losses - losses.mean()) ** 2).mean(), psi, retain_graph=True)
    grads = [torch.autograd.grad(loss, psi, retain_graph=True)[0] for loss in losses]
    shift = variance_shift(losses.detach(), 1.0)
    formula = sum(s * gi for s, gi in zip(shift, grads, strict=True))
    assert torch.allclose(formula, auto, atol=1e-12, rtol=0)
    assert float(shift.sum()) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("on_phi", [False, True])
def test_a4_a5_a9_the_server_step_equals_the_hand_combined_gradients(on_phi: bool) -> None:
    """Catches a wrong combination Σ c_i g_i (c_i = α_i + (2λ/N)(L̄_i − L̄), Σ c_i = 1), the
    variance term reaching φ (Alg. 1: ψ only) or missing there with `var_reg_on_phi`, or a step
    other than plain SGD ψ − η·G. g_i here is autograd's gradient of the surrogate
    Σ⟨θ_i^0, stopgrad(Δ_i)⟩, not the factored VJP."""
    lr, lam, tau = 0.5, 0.7, 3.0
    server = make_server(lr_s=lr, lambda_var=lam, tau=tau, var_reg_on_phi=on_phi)
    set_statistics(server)
    deltas = random_deltas(server)
    losses, variances = [1.2, 0.7, 0.95], [0.02, 0.11, 0.05]
    g = surrogate_gradients(server, deltas)
    before = [p.detach().clone() for p in server.trainable()]
    n_phi = len(server.hnet.conditioning())
    server.aggregate(1, iter((c, reply(deltas[c], losses[c], variances[c])) for c in range(3)))

    v = torch.tensor(variances, dtype=torch.float64)
    alpha = torch.softmax(-tau * v, 0)
    ell = torch.tensor(losses, dtype=torch.float64)
    c = alpha + 2 * lam / 3 * (ell - ell.mean())
    assert float(c.sum()) == pytest.approx(1.0, abs=1e-12)
    assert server.round_log["coef"] == pytest.approx(c.tolist(), abs=1e-12)
    assert server.round_log["alpha"] == pytest.approx(alpha.tolist(), abs=1e-12)
    assert server.round_log["loss_var_across_clients"] == pytest.approx(
        float(((ell - ell.mean()) ** 2).mean()), abs=1e-15
    )
    for k, (p, p0) in enumerate(zip(server.trainable(), before, strict=True)):
        w = alpha if k < n_phi and not on_phi else c  # φ: Σ α g (Alg. 1); ψ: + λ G_var
        expected = p0.double() - lr * sum(w[i] * g[i][k].double() for i in range(3))
        scale = max(float(p0.abs().max()), 1.0)
        assert torch.allclose(p.detach().double(), expected, atol=1e-6 * scale, rtol=0), k


# ----------------------------------------------------------------------------- A5 VJP


def test_a5_vjp_through_encoder_and_hypernetwork_matches_autograd_and_finite_differences() -> None:
    """Catches a wrong VJP through h_ψ and g_φ (the factored form), a zero encoder gradient, or
    a sign error, against autograd of the surrogate and a central finite difference (float64)."""
    server = make_server()
    set_statistics(server)
    server.hnet.double()
    deltas = {c: {k: v.double() for k, v in d.items()} for c, d in random_deltas(server).items()}
    grads = client_gradients(server.hnet, deltas)
    auto = surrogate_gradients(server, deltas)
    n_phi = len(server.hnet.conditioning())
    for i in range(3):
        phi = torch.cat([t.reshape(-1) for t in auto[i][:n_phi]])
        trunk = torch.cat(
            [t.reshape(-1) for t in auto[i][n_phi : n_phi + len(server.hnet.trunk.state_dict())]]
        )
        assert torch.allclose(grads.nu[i], phi, atol=1e-12, rtol=0)
        assert torch.allclose(grads.trunk[i], trunk, atol=1e-12, rtol=0)
        assert float(grads.nu[i].abs().max()) > 1e-6  # g_φ,i is non-zero
    # combine() with a one-hot weight is client 0's full gradient, heads included
    one_hot = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    combined = grads.combine(one_hot, one_hot)
    for got, want in zip(combined, auto[0], strict=True):
        assert torch.allclose(got.reshape(want.shape), want, atol=1e-12, rtol=0)
    # finite difference on one encoder weight
    w = server.hnet.encoder.net[0].weight
    eps = 1e-6

    def surrogate() -> float:
        theta = server.hnet(0)
        return float(sum((theta[k] * deltas[0][k]).sum() for k in theta))

    with torch.no_grad():
        w[1, 2] += eps
        up = surrogate()
        w[1, 2] -= 2 * eps
        down = surrogate()
        w[1, 2] += eps
    assert (up - down) / (2 * eps) == pytest.approx(float(auto[0][0][1, 2]), rel=1e-6, abs=1e-12)


# ----------------------------------------------------------------------------- A6 sign


def test_a6_a_server_step_moves_the_generated_model_toward_the_trained_one() -> None:
    """Catches the Δ sign convention reversed: with λ_var = 0, one client and a tiny η, the
    step must move θ_i toward θ_i^final = θ_i^0 − Δ_i."""
    server = make_server(n_clients=1, lambda_var=0.0, lr_s=1e-4)
    set_statistics(server)
    theta0 = {k: v.clone() for k, v in server.generated(0).items()}
    delta = random_deltas(server)[0]
    server.aggregate(1, iter([(0, reply(delta, 1.0, 0.1))]))
    after = server.generated(0)
    dot = sum(float(((after[k] - theta0[k]) * -delta[k]).sum()) for k in theta0)
    assert dot > 0


# ----------------------------------------------------------------------------- A7 batch stats


def test_a7_loss_statistics_are_the_mean_and_population_variance_of_the_batches(
    tmp_path: Path,
) -> None:
    """Catches the wrong number of recorded batches (E·floor(n/B) with drop_last), a sample
    variance instead of the population variance, or statistics of other losses than the ones
    trained on."""
    cfg = frozen_config(tmp_path, rounds=1, train__local_epochs=2, train__batch_size=8)
    fed = tiny_federation(cfg)
    sim = run_sim(cfg, tmp_path / "run", fed)
    server: FedVRServer = sim.server
    client = FedVRClient(server.hp)
    captured = {}
    ctx = sim._context(0, 1, torch.Generator().manual_seed(5))
    fit = ctx.fit

    def spy(arrays, **kw):
        captured["stats"] = fit(arrays, **kw)
        return captured["stats"]

    ctx.fit = spy  # type: ignore[method-assign]
    out = client.run(Message("fit", server.generated(0)), ctx)
    n = len(fed.train[0])
    assert out.scalars["batches"] == 2 * (n // 8) == len(captured["stats"].batch_losses)
    losses = captured["stats"].batch_losses.double().numpy()
    assert out.scalars["loss_mean"] == pytest.approx(float(np.mean(losses)), abs=1e-15)
    assert out.scalars["loss_var"] == pytest.approx(float(np.var(losses, ddof=0)), abs=1e-15)
    assert loss_statistics(torch.tensor([1.0, 3.0])) == (2.0, 1.0)  # by hand
    # the recorded losses are the ones the server read this round
    assert server.round_log["loss_batch_var"][0] > 0


# ----------------------------------------------------------------------------- A8 zero-shot


def test_a8_a_clients_own_training_split_as_pilot_reproduces_its_model_bitwise(
    tmp_path: Path,
) -> None:
    """Catches a zero-shot path that computes the statistics or the generation differently from
    the clients' (another reduction order, dtype or batching): client i's own training split,
    run as the pilot task through the runner, must give θ_i bit for bit."""
    sim = run_sim(frozen_config(tmp_path, rounds=2), tmp_path / "run")
    server: FedVRServer = sim.server
    (domain,) = sim.data.targets
    for cid in range(3):
        server.pilot.clear()
        server._generated.clear()
        sim.data.pilots[domain] = sim.data.train[cid]
        sim.pilot_sizes[domain] = len(sim.data.train[cid])
        sim._pilot(3)
        zero_shot, own = server.eval_arrays(None), server.generated(cid)
        assert all(torch.equal(zero_shot[k], own[k]) for k in own), cid
    others = server.generated(0)
    assert not torch.equal(zero_shot["classifier.weight"], others["classifier.weight"])


def test_a8_a_pilot_from_a_source_validation_split_scores_like_the_clients_model(
    tmp_path: Path,
) -> None:
    """Catches a zero-shot model far from the client model of the same domain: statistics of a
    source domain's validation split (a sample of that domain, not the training rows) must give
    a model within 2 points of that client's id accuracy on the split."""
    cfg = frozen_config(
        tmp_path, {"name": "fedvr", "lr_s": 1.0}, rounds=15, train__batch_size=32, eval__every=15
    )
    fed = tiny_federation(cfg, tiny_dataset(n_per_domain=1200, seed=3))
    sim = run_sim(cfg, tmp_path / "run", fed)
    server: FedVRServer = sim.server
    model = sim.server.ctx.model_factory()
    for cid in range(3):
        val = fed.val[cid]
        stats = feature_statistics(val, "mean")
        acc_zero = accuracy(model, server.synthesise(stats), val)
        acc_own = accuracy(model, server.generated(cid), val)
        assert acc_own > 0.5
        assert abs(acc_zero - acc_own) <= 0.02, (cid, acc_zero, acc_own)


def accuracy(model: torch.nn.Module, arrays: dict, data: ClientData) -> float:
    set_arrays(model, {k: v.detach() for k, v in arrays.items()})
    model.eval()
    with torch.no_grad():
        return float((model(data.inputs).argmax(1) == data.labels).double().mean())


def test_a8_the_run_level_ood_is_the_zero_shot_model_and_clients_stay_a_diagnostic(
    tmp_path: Path,
) -> None:
    """Catches ood numbers not from θ_new = h(g(x̄_pilot)) (by hand: the pilot's feature mean,
    encoded and generated here), or the clients' own ood scores lost as a diagnostic."""
    sim = run_sim(frozen_config(tmp_path, rounds=2), tmp_path / "run")
    server: FedVRServer = sim.server
    (domain,) = sim.data.targets
    pilot = sim.data.pilots[domain]
    stats = pilot.inputs.double().mean(0).float()
    with torch.no_grad():
        theta = server.hnet.generate(server.hnet.encoder(stats))
    model = server.ctx.model_factory()
    record = sim.records[-1]
    assert record["ood_acc"] == pytest.approx(
        accuracy(model, theta, sim.data.targets[domain]), abs=1e-12
    )
    clients = [accuracy(model, server.generated(c), sim.data.targets[domain]) for c in range(3)]
    assert record["client_ood_acc"] == pytest.approx(float(np.mean(clients)), abs=1e-12)


# ----------------------------------------------------------------------------- A9 reductions


def test_a9_without_weights_or_regulariser_the_step_is_sgd_on_the_mean_vjp() -> None:
    """Catches τ = 0, λ_var = 0 not reducing to ψ ← ψ − η·mean_i VJP_i (plain SGD)."""
    lr = 0.3
    server = make_server(lr_s=lr, lambda_var=0.0, tau=0.0)
    set_statistics(server)
    deltas = random_deltas(server, seed=4)
    g = surrogate_gradients(server, deltas)
    before = [p.detach().clone() for p in server.trainable()]
    server.aggregate(
        1, iter((c, reply(deltas[c], [3.0, 0.1, 1.0][c], [1.0, 0.0, 5.0][c])) for c in range(3))
    )
    assert server.round_log["coef"] == [1 / 3] * 3
    for k, (p, p0) in enumerate(zip(server.trainable(), before, strict=True)):
        expected = p0.double() - lr * sum(g[i][k].double() for i in range(3)) / 3
        scale = max(float(p0.abs().max()), 1.0)
        assert torch.allclose(p.detach().double(), expected, atol=1e-6 * scale, rtol=0), k


def test_a9_table_conditioning_with_gradalign_ema_adam_is_hfedf_bit_for_bit(tmp_path: Path) -> None:
    """Catches FedVR's trainer diverging from hFedF's (a copied rather than shared code path):
    conditioning=table, τ = 0, λ_var = 0, GradAlign + EMA + Adam with hFedF's settings must
    give hFedF's hypernetwork and metrics exactly, round after round."""
    shared = {"lr_s": 1e-3, "wd_s": 1e-5, "ema_warmup": 1, "hidden": 50, "embed_dim": 1}
    fedvr = {
        "name": "fedvr_table",
        "server_optimizer": "adam",
        "gradalign": True,
        "ema": True,
        "tau": 0.0,
        "lambda_var": 0.0,
        **shared,
    }
    a = run_sim(frozen_config(tmp_path, fedvr, rounds=3), tmp_path / "fedvr")
    b = run_sim(frozen_config(tmp_path, {"name": "hfedf", **shared}, rounds=3), tmp_path / "hfedf")
    sa, sb = a.server.state_dict(), b.server.state_dict()
    for k, v in sb["hnet"].items():
        assert torch.equal(sa["hnet"][k], v), k
    assert sa["gradalign"] == sb["gradalign"]
    for ra, rb in zip(a.records, b.records, strict=True):
        for key in ("id_acc", "ood_acc", "per_client"):
            assert ra[key] == rb[key], key


# ----------------------------------------------------------------------------- A10 hygiene


def test_a10_the_pilot_is_left_out_of_evaluation_the_same_way_for_every_method(
    tmp_path: Path,
) -> None:
    """Catches pilot images scored as ood, a different evaluation subset for FedVR than for
    another method, or pilot labels reaching the client's statistics task."""
    fedvr = tiny_federation(frozen_config(tmp_path))
    fedavg = tiny_federation(frozen_config(tmp_path, "fedavg"))
    (domain,) = fedvr.targets
    target, pilot = fedvr.targets[domain], fedvr.pilots[domain]
    n_domain = 40  # tiny_dataset: 40 images per domain
    assert len(pilot) == round(0.1 * n_domain) and len(target) == n_domain - len(pilot)
    assert torch.equal(target.inputs, fedavg.targets[domain].inputs)
    assert torch.equal(pilot.inputs, fedavg.pilots[domain].inputs)
    rows = {tuple(r.tolist()) for r in target.inputs}
    assert not any(tuple(r.tolist()) in rows for r in pilot.inputs)
    assert (pilot.labels == UNLABELED).all()


def test_a10_the_zero_shot_model_never_sees_target_labels(tmp_path: Path) -> None:
    """Catches statistics that depend on labels: relabelling the pilot set changes nothing."""
    fed = tiny_federation(frozen_config(tmp_path))
    (domain,) = fed.pilots
    pilot = fed.pilots[domain]
    scrambled = ClientData(pilot.inputs, torch.randint(0, 3, pilot.labels.shape), pilot.transform)
    assert torch.equal(feature_statistics(pilot, "mean"), feature_statistics(scrambled, "mean"))


# ----------------------------------------------------------------------------- privacy


def test_clients_send_deltas_loss_scalars_and_one_statistics_vector(tmp_path: Path) -> None:
    """Catches a client sending anything but Δ, its loss scalars and one feature-statistics
    vector (hand count from the model and feature width), or a per-image feature."""
    sim = run_sim(frozen_config(tmp_path, rounds=2), tmp_path / "run")
    width = sim.data.train[0].inputs.shape[1]
    model_bytes = 4 * sum(p.numel() for p in sim.model.parameters())
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").open()]
    (collect,) = [r for r in rounds if r["round"] == 0]
    assert collect["ledger"]["up"] == {"model": 0, "statistics": 3 * 4 * width, "scalars": 3 * 8}
    fits = [r for r in rounds if r["round"] >= 1 and r.get("task") != "pilot"]
    for r in fits:
        assert r["ledger"]["up"] == {"model": 3 * model_bytes, "statistics": 0, "scalars": 3 * 40}
    (pilot,) = [r for r in rounds if r.get("task") == "pilot"]  # asked once, then known
    assert pilot["ledger"]["up"]["statistics"] == 4 * width
    per_image = Message("stats", {STATS_ARRAY: sim.data.train[0].inputs})
    from feddomain.federation.privacy import PrivacyViolation

    with pytest.raises(PrivacyViolation, match="per-sample"):
        sim.upload_check.check(0, per_image, len(sim.data.train[0]))


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"tau": -1.0}, "tau"),
        ({"lambda_var": -0.1}, "lambda_var"),
        ({"tau": float("inf")}, "tau"),
        ({"gradalign": True}, "tau=0"),
        ({"conditioning": "table"}, "zero_shot"),
        ({"stats": "median"}, "stats"),
        ({"var_loss_source": "full"}, "var_loss_source"),
        ({"ood_model": "best"}, "ood_model"),
        ({"lamda_var": 0.5}, "lamda_var"),
    ],
)
def test_bad_hyper_parameters_are_refused_by_name(
    overrides: dict, match: str, tmp_path: Path
) -> None:
    """Catches a bad FedVR setting accepted (or refused without naming the key)."""
    with pytest.raises(ConfigError, match=match):
        frozen_config(tmp_path, {"name": "fedvr", **overrides})


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"model__frozen": False, "model__head_adapter": None}, "model.frozen"),
        ({"split__pilot_fraction": 0.0}, "split.pilot_fraction"),
        ({"model__head_hidden": 8}, "head_adapter"),
    ],
)
def test_configs_fedvr_cannot_run_are_refused_naming_the_key(
    overrides: dict, match: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=match):
        frozen_config(tmp_path, **overrides)


def test_a_client_without_one_full_batch_is_named(tmp_path: Path) -> None:
    """Catches a client with no training step (fewer samples than a batch under drop_last)
    silently reporting NaN loss statistics instead of an error naming it."""
    sim = run_sim(frozen_config(tmp_path, rounds=1), tmp_path / "run")
    ctx = sim._context(1, 1, torch.Generator().manual_seed(0))
    few = ClientData(ctx.train.inputs[:3], ctx.train.labels[:3], ctx.train.transform)
    ctx = dataclasses.replace(ctx, train=few)
    with pytest.raises(DataError, match="client 1 ran no training step"):
        FedVRClient(sim.server.hp).run(Message("fit", sim.server.generated(1)), ctx)


# ----------------------------------------------------------------------------- resume


def test_sigkill_then_resume_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    """Catches FedVR server state lost across a SIGKILL and --resume: the clients' statistics
    (collected once, before round 1), the hypernetwork and encoder, the pilot statistics and the
    round's loss log; the resumed run must equal an uninterrupted one, its exported final state
    (fingerprint in summary.json) included."""
    from tests.resume_helpers import (
        assert_resumed_equals,
        kill_after_checkpoint,
        resume,
        run_to_end,
        write_config,
    )

    rounds = 6
    config = {
        "name": "resume-fedvr",
        "seed": 3,
        "rounds": rounds,
        "threads": 1,
        "dataset": {"name": "digits_embedded", "resolution": 16, "cache_dir": str(tmp_path / "c")},
        "split": {"scheme": "lodo", "targets": ["grey"], "pilot_fraction": 0.1},
        "partition": {"n_clients": 3, "d": 1},
        "model": {"name": "lenet5", "frozen": True, "head_adapter": 8},
        "train": {
            "batch_size": 64,
            "optimizer": "sgd",
            "lr": 0.05,
            "momentum": 0.9,
            "drop_last": True,
        },
        "eval": {"every": 2},
        "checkpoint": {"every": 1},
        "algorithm": {"name": "fedvr", "embed_dim": 8, "hidden": 16, "encoder_hidden": 16},
    }
    path = write_config(tmp_path / "fedvr.yaml", config)
    run_to_end(path, tmp_path / "reference")
    out = tmp_path / "killed"
    state = kill_after_checkpoint(path, out, min_round=2)
    assert state["round"] < rounds
    server = state["server"]
    assert float(server["hnet"]["statistics"].abs().sum()) > 0  # collected before round 1
    assert list(server["pilot"]) == ["grey"] and server["round_log"]["coef"]
    resume(out)
    assert_resumed_equals(out, tmp_path / "reference")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["server_state"]["file"] == "server_state.pt"


# ----------------------------------------------------------------------------- §5 metrics


def test_alignment_and_embedding_metrics_by_hand() -> None:
    """Catches wrong §5 diagnostics: cosines of each g_i to the step and to the mean, the mean
    pairwise cosine (orthogonal unit gradients: 1/√2, 0), and the embedding spread and the
    zero-shot embedding's distances (a 3-4-5 triangle)."""
    from feddomain.algorithms.fedvr import cosine_diagnostics, embedding_geometry

    gram = torch.eye(2, dtype=torch.float64)
    half = cosine_diagnostics(gram, torch.tensor([0.5, 0.5]))
    assert half["cos_to_update"] == pytest.approx([2**-0.5] * 2, abs=1e-11)
    assert half["cos_pairwise_mean"] == pytest.approx(0.0, abs=1e-12)
    assert half["grad_norm"] == [1.0, 1.0]
    first = cosine_diagnostics(gram, torch.tensor([1.0, 0.0]))
    assert first["cos_to_update"] == pytest.approx([1.0, 0.0], abs=1e-11)
    assert first["cos_to_mean"] == pytest.approx([2**-0.5] * 2, abs=1e-11)
    geo = embedding_geometry(torch.tensor([[0.0, 0.0], [3.0, 4.0]]), torch.tensor([0.0, 0.0]))
    assert geo["embedding_l2_mean"] == pytest.approx(5.0)
    assert geo["zero_shot_l2_to_clients"] == pytest.approx([0.0, 5.0])
    assert geo["zero_shot_l2_to_centroid"] == pytest.approx(2.5)


def test_every_evaluated_round_logs_the_fairness_and_alignment_metrics(tmp_path: Path) -> None:
    """Catches a round whose metrics lack §5's per-round values (L_var from the clients'
    reported losses, α, c, cosines, embedding spread) or the run-level worst client and ECE."""
    sim = run_sim(frozen_config(tmp_path, rounds=2), tmp_path / "run")
    for record in sim.records:
        d = record["diagnostics"]
        ell = np.array(d["loss_mean"])
        assert d["loss_var_across_clients"] == pytest.approx(float(np.var(ell)), abs=1e-15)
        assert len(d["alpha"]) == len(d["coef"]) == len(d["cos_to_update"]) == 3
        assert "embedding_l2_mean" in d and "zero_shot_l2_to_centroid" in d
        assert record["id_spread"]["min"] == min(record["per_client"]["id_acc"])
        assert 0.0 <= record["ood_ece"] <= 1.0


@pytest.mark.parametrize("source", ["init_model_full_pass", "gap"])
def test_the_loss_in_the_penalty_can_be_a_full_pass_or_the_gap(source: str, tmp_path: Path) -> None:
    """Catches `var_loss_source` options reporting another loss than θ_i^0's mean cross-entropy
    on all of D_i^tr (full pass) or that minus θ_i^final's (gap), both recomputed here."""
    cfg = frozen_config(tmp_path, {"name": "fedvr", "var_loss_source": source}, rounds=1)
    sim = run_sim(cfg, tmp_path / "run")
    server: FedVRServer = sim.server
    theta0 = {k: v.clone() for k, v in server.generated(1).items()}
    ctx = sim._context(1, 2, torch.Generator().manual_seed(0))
    out = FedVRClient(server.hp).run(Message("fit", theta0), ctx)
    model = server.ctx.model_factory()
    data = sim.data.train[1]

    def ce(arrays: dict) -> float:
        set_arrays(model, arrays)
        with torch.no_grad():
            return float(F.cross_entropy(model(data.inputs).double(), data.labels))

    trained = {k: theta0[k] - out.arrays[k] for k in theta0}
    expected = ce(theta0) if source == "init_model_full_pass" else ce(theta0) - ce(trained)
    assert out.scalars["loss_mean"] == pytest.approx(expected, abs=1e-5)


def test_mean_and_std_statistics_by_hand() -> None:
    """Catches `stats: mean+std` sending another vector than [mean, population std]."""
    x = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    data = ClientData(x, torch.zeros(2, dtype=torch.int64))
    assert feature_statistics(data, "mean").tolist() == [2.0, 4.0]
    assert feature_statistics(data, "mean+std").tolist() == [2.0, 4.0, 1.0, 2.0]


def test_the_server_s_weights_and_coefficients_are_recorded_every_round(tmp_path: Path) -> None:
    """Catches §5.9's quantities (α_i, c_i, L_var) and §5.6's embedding spread kept only at
    evaluated rounds (every 3rd here), a round's record holding another round's values, and c_i
    that are not α_i plus the variance shift λ·(2/N)·(L_i − L̄) of that round's losses."""
    cfg = frozen_config(tmp_path, rounds=3, eval__every=3)
    run_sim(cfg, tmp_path / "run")
    rounds = [
        json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()
    ]
    rounds = [r for r in rounds if r["round"] >= 1 and "task" not in r]  # not round 0, pilot
    assert [r["round"] for r in rounds] == [1, 2, 3]
    lam = resolve_method("fedvr", {}).hp.lambda_var  # the default, 0.5
    for r in rounds:
        server = r["server"]
        losses = np.array(server["loss_mean"])
        shift = lam * 2 / len(losses) * (losses - losses.mean())
        np.testing.assert_allclose(server["coef"], np.array(server["alpha"]) + shift, atol=1e-12)
        assert server["loss_var_across_clients"] == pytest.approx(losses.var(), abs=1e-15)
    assert rounds[0]["server"]["loss_mean"] != rounds[1]["server"]["loss_mean"]
    (last,) = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert last["diagnostics"]["coef"] == rounds[2]["server"]["coef"]
    # the embeddings' spread (§5.6) every round too, moving as the encoder trains
    spreads = [r["server"]["embedding_l2_mean"] for r in rounds]
    assert len(set(spreads)) == 3
    assert spreads[2] == last["diagnostics"]["embedding_l2_mean"]


def test_alpha_weighs_the_clients_without_one_dominating() -> None:
    """Catches B3's activity read from the dominance test (or from α's max alone): τ = 10 with
    batch-loss variances (0, .05, .05) gives α ∝ (1, e^-0.5, e^-0.5), a max/min ratio of
    e^0.5 ≈ 1.65 (active) while the largest share is 1/(1 + 2e^-0.5) ≈ 0.45 (not dominated)."""
    server = make_server(tau=10.0, lambda_var=0.0)
    set_statistics(server)
    deltas = random_deltas(server, seed=1)
    variances = [0.0, 0.05, 0.05]
    server.aggregate(1, iter((c, reply(deltas[c], 1.0, variances[c])) for c in range(3)))
    record = server.round_record()
    assert max(record["alpha"]) == pytest.approx(1 / (1 + 2 * math.exp(-0.5)), abs=1e-12)
    assert (record["alpha_active"], record["alpha_dominated"]) == (True, False)
    assert server.run_summary()["alpha_active_share"] == 1.0


def test_the_share_of_rounds_one_client_dominates_alpha_is_logged(tmp_path: Path) -> None:
    """Catches a dominance count that misses a round, counts α = 1/3 each as dominated, or is
    lost from the summary: τ = 10 with batch-loss variances (0, .5, .5) gives client 0
    α = 1/(1 + 2e⁻⁵) ≈ 0.987, equal variances α = 1/3 each, (.2, .2, 0) client 2 1/(1 + 2e⁻²);
    so rounds 1 and 3 of 3 are dominated (share 2/3). α is active (max/min > 1.05, fedvr.md B3)
    in the same two rounds: e⁵ and e² as ratios; equal variances give ratio 1."""
    server = make_server(tau=10.0, lambda_var=0.0)
    set_statistics(server)
    rounds = [([0.0, 0.5, 0.5], True), ([0.1, 0.1, 0.1], False), ([0.2, 0.2, 0.0], True)]
    for rnd, (variances, dominated) in enumerate(rounds, start=1):
        deltas = random_deltas(server, seed=rnd)
        server.aggregate(rnd, iter((c, reply(deltas[c], 1.0, variances[c])) for c in range(3)))
        record = server.round_record()
        assert record["alpha_dominated"] is dominated, rnd
        assert record["alpha_active"] is dominated, rnd
        assert record["alpha_dominated_rounds"] == sum(d for _, d in rounds[:rnd])
    assert max(server.round_log["alpha"]) == pytest.approx(1 / (1 + 2 * math.exp(-2)), abs=1e-12)
    assert server.run_summary()["alpha_dominated_share"] == pytest.approx(2 / 3, abs=1e-15)
    assert server.run_summary()["alpha_active_share"] == pytest.approx(2 / 3, abs=1e-15)

    sim = run_sim(frozen_config(tmp_path, rounds=3), tmp_path / "run")
    logged = [
        json.loads(line)["server"]["alpha_dominated"]
        for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()
        if json.loads(line)["round"] >= 1 and "server" in json.loads(line)
    ]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert len(logged) == 3
    assert summary["server"]["alpha_dominated_share"] == pytest.approx(sum(logged) / 3)
    assert summary["server"] == sim.server.run_summary()
