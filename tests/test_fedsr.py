"""FedSR (feddomain/algorithms/fedsr.py): its reduction to FedAvg, each loss term against a
float64 formula written here, the eval-mode z, the averaged priors, the models it hooks onto,
composition and its hyper-parameter checks. Expected values never come from the code under test.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from feddomain.algorithms import METHODS, register
from feddomain.algorithms.base import MethodSpec
from feddomain.algorithms.fedavg import FedAvgClient, FedAvgServer
from feddomain.algorithms.fedsr import (
    FedSRHparams,
    FedSRModel,
    cmi_term,
    fedsr_loss,
    l2r_term,
    probabilistic_head,
)
from feddomain.errors import ConfigError
from feddomain.federation.simulation import Simulation
from feddomain.models import build_model
from feddomain.models.base import FeatureClassifier
from tests.engine_helpers import run_sim, tiny_config
from tests.test_evidence_engine import TRAIN_SIZES, uneven_federation


@contextmanager
def fedavg_on_fedsr_model():
    """FedAvg's server and client on the model FedSR's hook builds (the same architecture)."""
    name = "_fedavg_fedsr_arch"
    register(
        MethodSpec(name, FedAvgServer, FedAvgClient, FedSRHparams, model_hook=probabilistic_head)
    )
    try:
        yield name
    finally:
        del METHODS[name]


def _tiny_model(kl: str = "scaled", **hp: object) -> FedSRModel:
    """A float64 FedSR model on a 5-feature Linear featurizer, 3 classes, z_dim 4."""
    torch.manual_seed(0)
    base = FeatureClassifier(nn.Sequential(nn.Linear(6, 5), nn.Tanh()), nn.Linear(5, 3), 5)
    model = probabilistic_head(base, FedSRHparams(z_dim=4, kl=kl, **hp)).double()
    with torch.no_grad():  # priors away from their init, so every term of the KL matters
        model.r_mu.normal_()
        model.r_sigma.normal_()
        if model.C is not None:
            model.C.fill_(1.7)
    return model


# ------------------------------------------------------------------------------ reductions
def test_with_both_coefficients_zero_and_no_sampling_fedsr_is_fedavg_exactly(tmp_path):
    """Catches: a FedSR objective that adds anything to the cross-entropy when α_L2R = α_CMI = 0
    and z = μ, or a client step that differs from FedAvg's on the same architecture (unequal
    clients: 36/18/9 samples, several rounds, Adam)."""
    hp = {"alpha_l2r": 0.0, "alpha_cmi": 0.0, "sample": False}
    runs = {}
    with fedavg_on_fedsr_model() as reference:
        for name in ("fedsr", reference):
            cfg = tiny_config(rounds=3, algorithm={"name": name, **hp}, train__optimizer="adam")
            runs[name] = run_sim(cfg, tmp_path / name, uneven_federation(cfg))
    fedsr, fedavg = runs["fedsr"].server.global_arrays, runs[reference].server.global_arrays
    assert set(fedsr) == set(fedavg) and "r_mu" in fedsr
    init = runs["fedsr"].server.ctx.model_factory().state_dict()
    assert not torch.equal(fedsr["map_layer.weight"], init["map_layer.weight"])  # it trained
    for k, v in fedavg.items():
        assert torch.equal(fedsr[k], v), k
    records = [[_untimed(r) for r in runs[n].records] for n in ("fedsr", reference)]
    assert records[0] == records[1]


def _untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "time"}


def test_as_the_client_part_of_fedavg_it_is_fedsr(tmp_path):
    """Catches: a composed method that loses the model hook or the client's objective
    (``algorithm: {name: fedavg, client: {name: fedsr}}`` must be FedSR itself)."""
    hp = {"alpha_l2r": 0.1, "alpha_cmi": 0.01}
    alone = run_sim(tiny_config(rounds=2, algorithm={"name": "fedsr", **hp}), tmp_path / "a")
    composed_cfg = tiny_config(
        rounds=2, algorithm={"name": "fedavg", "client": {"name": "fedsr", **hp}}
    )
    composed = run_sim(composed_cfg, tmp_path / "b")
    assert composed.method.name == "fedavg+fedsr"
    assert isinstance(composed.model, FedSRModel)
    for k, v in alone.server.global_arrays.items():
        assert torch.equal(composed.server.global_arrays[k], v), k


# ----------------------------------------------------------------------------- loss terms
def _kl_by_hand(a: float, s: float, m: float, r: float) -> float:
    """KL(N(a, s²) ‖ N(m, r²)) for one dimension, the textbook closed form."""
    return math.log(r / s) + (s * s + (a - m) ** 2) / (2 * r * r) - 0.5


@pytest.mark.parametrize("kl", ["scaled", "plain"])
def test_the_cmi_term_is_the_closed_form_kl_between_diagonal_gaussians(kl):
    """Catches: a wrong KL (sign, missing ½, σ vs σ², prior σ without softplus, labels not
    selecting the prior's row, the scale C left out or applied to the prior, a mean over
    dimensions instead of a sum)."""
    model = _tiny_model(kl)
    g = torch.Generator().manual_seed(1)
    mu = torch.randn(5, 4, generator=g, dtype=torch.float64)
    sigma = torch.rand(5, 4, generator=g, dtype=torch.float64) + 0.1
    y = torch.tensor([0, 2, 1, 2, 0])
    c = 1.7 if kl == "scaled" else 1.0
    r_mu, r_sigma = model.r_mu.detach(), model.r_sigma.detach()
    total = 0.0
    for b in range(5):
        for d in range(4):
            prior_sigma = math.log1p(math.exp(float(r_sigma[y[b], d])))  # softplus
            a, s = c * float(mu[b, d]), c * float(sigma[b, d])
            total += _kl_by_hand(a, s, float(r_mu[y[b], d]), prior_sigma)
    expected = total / 5  # summed over z's dimensions, averaged over the batch
    assert float(cmi_term(model, mu, sigma, y).detach()) == pytest.approx(expected, rel=1e-12)
    assert (model.C is not None) == (kl == "scaled")


@pytest.mark.parametrize(("form", "expected"), [("norm", 2.0), ("squared", 26 / 3)])
def test_the_l2r_term_by_hand(form, expected):
    """Catches: the L2 norm squared where the code form wants it plain (or vice versa), or a
    sum over the batch instead of a mean (rows: ‖(3,4)‖ = 5, ‖0‖ = 0, ‖(1,0)‖ = 1)."""
    z = torch.tensor([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    assert float(l2r_term(z, form)) == pytest.approx(expected, rel=1e-15)


def test_the_objective_weights_each_term_by_its_own_coefficient():
    """Catches: swapped or missing coefficients, or the loss's terms computed on another z than
    the classifier's (float64, z = μ so the objective is deterministic)."""
    model = _tiny_model(sample=False).train()
    hp = FedSRHparams(alpha_l2r=0.3, alpha_cmi=0.07, sample=False, l2r="squared")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 6, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0])
    h = model.map_layer(model.featurizer(x))
    mu, sigma = h[:, :4], F.softplus(h[:, 4:])
    ce = F.cross_entropy(model.classifier(mu), y)
    prior_mu, prior_sigma = model.r_mu[y], F.softplus(model.r_sigma)[y]
    kl = torch.distributions.kl_divergence(
        torch.distributions.Normal(1.7 * mu, 1.7 * sigma),
        torch.distributions.Normal(prior_mu, prior_sigma),
    )
    expected = ce + 0.3 * mu.pow(2).sum(1).mean() + 0.07 * kl.sum(1).mean()
    got = fedsr_loss(hp)(model, x, y)
    assert float(got.detach()) == pytest.approx(float(expected.detach()), rel=1e-12)


# ------------------------------------------------------------------------------ the model
def test_training_samples_z_and_eval_predicts_with_mu():
    """Catches: eval-mode predictions that sample (non-deterministic), training that never
    samples (or samples with ``sample: false``), or noise not drawn from torch's seeded RNG
    (runs would not replay)."""
    model = _tiny_model()
    x = torch.randn(8, 6, dtype=torch.float64)
    mu, _ = model.distribution(x)
    model.eval()
    assert torch.equal(model(x), model.classifier(mu))
    assert torch.equal(model(x), model(x))
    model.train()
    torch.manual_seed(3)
    first = model(x)
    torch.manual_seed(3)
    assert torch.equal(model(x), first)  # seeded: replays
    assert not torch.equal(model(x), first)  # and it does sample
    assert not torch.allclose(first, model.classifier(mu))
    deterministic = _tiny_model(sample=False).train()  # the ablation: z = μ in training too
    assert torch.equal(deterministic(x), deterministic.classifier(deterministic.distribution(x)[0]))


def test_eval_z_sample_is_a_draw_that_repeats_at_every_evaluation():
    """Catches: the sampled-eval option predicting with μ, or drawing a new stream at each
    evaluation (scores would change between identical evaluations, and on resume)."""
    model = _tiny_model(eval_z="sample")
    x = torch.randn(8, 6, dtype=torch.float64)
    mu, _ = model.distribution(x)
    model.eval()
    first = model(x)
    model.train()
    torch.manual_seed(123)  # the global RNG plays no part
    model.eval()
    assert torch.equal(model(x), first)
    assert not torch.allclose(first, model.classifier(mu))


def test_the_priors_are_model_parameters_averaged_like_weights(tmp_path):
    """Catches: priors (r_μ, r_σ, C) kept per client, left untrained, or averaged without the
    sample-count weights (clients of 36, 18 and 9 samples; float64 reference)."""
    cfg = tiny_config(rounds=1, algorithm={"name": "fedsr", "alpha_cmi": 0.5})
    sim = Simulation(cfg, uneven_federation(cfg), tmp_path)
    replies = {}
    run_client = sim._run_client

    def spy(cid, rnd, msg, *args):
        replies[cid] = run_client(cid, rnd, msg, *args)
        return replies[cid]

    sim._run_client = spy
    sim.run()
    init = sim.server.ctx.model_factory().state_dict()
    for name in ("r_mu", "r_sigma", "C"):
        sent = [replies[c].arrays[name].double() for c in range(3)]
        assert not torch.equal(sent[0], init[name])  # trained by the clients
        assert not torch.equal(sent[0], sent[1])
        expected = sum(n * s for n, s in zip(TRAIN_SIZES, sent, strict=True)) / sum(TRAIN_SIZES)
        torch.testing.assert_close(sim.server.global_arrays[name].double(), expected)
        assert not torch.allclose(expected, sum(sent) / 3)  # unweighted would be caught


@pytest.mark.parametrize(
    ("model_name", "layer", "shape"),
    [
        ("lenet5", "map_layer.weight", (168, 84)),  # appended: 84 -> 2·84
        ("small_cnn", "map_layer.weight", (256, 128)),  # BatchNorm model, appended
        ("hfedf_cnn", "featurizer.fc.weight", (512, 2592)),  # hfedf.md §6: replaces 2592->256
    ],
)
def test_it_hooks_onto_each_model_and_trains_a_round(model_name, layer, shape, tmp_path):
    """Catches: a model whose featurizer/classifier split the hook cannot use (BatchNorm, the
    hFedF CNN's replaced layer), or a classifier left on the wrong input width."""
    cfg = tiny_config(rounds=1, algorithm="fedsr", model={"name": model_name})
    sim = run_sim(cfg, tmp_path)
    arrays = sim.server.global_arrays
    assert tuple(arrays[layer].shape) == shape
    z_dim = shape[0] // 2
    assert tuple(arrays["classifier.weight"].shape) == (3, z_dim)
    assert tuple(arrays["r_mu"].shape) == tuple(arrays["r_sigma"].shape) == (3, z_dim)
    assert ("map_layer.weight" in arrays) == (model_name != "hfedf_cnn")
    assert math.isfinite(sim.records[-1]["ood_nll"])


def test_z_dim_and_head_options_shape_the_model():
    """Catches: z_dim ignored (FedVR's 512-d z on a linear head) or head: append not honoured."""
    hp = FedSRHparams(z_dim=512, head="append")
    model = probabilistic_head(build_model("hfedf_cnn", 7), hp)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["featurizer.fc.weight"] == (256, 2592)  # kept
    assert shapes["map_layer.weight"] == (1024, 256)
    assert shapes["classifier.weight"] == (7, 512)


def test_a_model_without_the_split_is_refused_by_name():
    """Catches: FedSR silently running on a model it cannot split (or replacing a layer that
    is not the featurizer's last Linear)."""
    with pytest.raises(ConfigError, match="Sequential has no such split"):
        probabilistic_head(nn.Sequential(nn.Flatten(), nn.Linear(12, 3)), FedSRHparams())
    with pytest.raises(ConfigError, match="replace needs a featurizer ending with a Linear"):
        probabilistic_head(build_model("lenet5", 3), FedSRHparams(head="replace"))


@pytest.mark.parametrize(
    ("algorithm", "key"),
    [
        ({"name": "fedsr", "alpha_l2r": -0.1}, "'algorithm.alpha_l2r'"),
        ({"name": "fedsr", "alpha_cmi": -1e-3}, "'algorithm.alpha_cmi'"),
        ({"name": "fedsr", "z_dim": 0}, "'algorithm.z_dim'"),
        ({"name": "fedsr", "kl": "exact"}, "'algorithm.kl'"),
        ({"name": "fedavg", "client": {"name": "fedsr", "alpha_cmi": -1}},
         "'algorithm.client.alpha_cmi'"),
    ],
)  # fmt: skip
def test_bad_hyper_parameters_are_refused_at_config_time_by_key(algorithm, key):
    """Catches: negative coefficients or unknown forms accepted (or refused without the key)."""
    with pytest.raises(ConfigError, match=key):
        tiny_config(algorithm=algorithm)
