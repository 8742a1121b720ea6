"""MixStyle: the statistics mixing against a hand computation, detached statistics, identity in
evaluation, where it is inserted, its draws, p = 0 as FedAvg exactly, config-time refusals."""

from __future__ import annotations

import json

import pytest
import torch

from feddomain.algorithms.mixstyle import MixStyle, MixStyleHparams, insert_mixstyle, mix_styles
from feddomain.config import load_config
from feddomain.errors import ConfigError
from feddomain.models import build_model
from tests.engine_helpers import run_sim, tiny_config

# Two samples, two channels, H×W = 1×2. Per (sample, channel): values, mean μ, biased std σ.
#   sample 0: ch0 [1, 3]   μ=2  σ=1 | ch1 [-1, 1]  μ=0   σ=1
#   sample 1: ch0 [2, 6]   μ=4  σ=2 | ch1 [10, 14] μ=12  σ=2
X = torch.tensor(
    [[[[1.0, 3.0]], [[-1.0, 1.0]]], [[[2.0, 6.0]], [[10.0, 14.0]]]], dtype=torch.float64
)
LAM = torch.tensor([0.25, 0.5], dtype=torch.float64)
PERM = torch.tensor([1, 0])
# sample 0 (λ=.25, partner 1): ch0 μ_mix=.25·2+.75·4=3.5, σ_mix=.25·1+.75·2=1.75 -> (x-2)/1·1.75+3.5
#                              ch1 μ_mix=.25·0+.75·12=9, σ_mix=1.75            -> x·1.75+9
# sample 1 (λ=.5, partner 0):  ch0 μ_mix=.5·4+.5·2=3, σ_mix=.5·2+.5·1=1.5      -> (x-4)/2·1.5+3
#                              ch1 μ_mix=.5·12+.5·0=6, σ_mix=1.5              -> (x-12)/2·1.5+6
HAND = torch.tensor(
    [[[[1.75, 5.25]], [[7.25, 10.75]]], [[[1.5, 4.5]], [[4.5, 7.5]]]], dtype=torch.float64
)
RATIO = torch.tensor([1.75, 0.75], dtype=torch.float64).view(2, 1, 1, 1)  # σ_mix / σ per sample


def test_mixing_matches_a_hand_computation_on_a_tiny_tensor():
    """Catches a wrong mixing formula: λ on the wrong side, std mixed as variance, unbiased
    variance with ε, statistics over the wrong dimensions, or the permutation ignored."""
    torch.testing.assert_close(mix_styles(X, LAM, PERM, eps=0.0), HAND, rtol=0, atol=1e-12)
    # with ε: σ = sqrt(var + ε) in both the normalisation and the mix
    eps = 1e-3
    mu = torch.tensor([[2.0, 0.0], [4.0, 12.0]], dtype=torch.float64).view(2, 2, 1, 1)
    sig = torch.tensor([[1.0, 1.0], [4.0, 4.0]], dtype=torch.float64).add(eps).sqrt()
    sig = sig.view(2, 2, 1, 1)
    lam = LAM.view(2, 1, 1, 1)
    expected = (X - mu) / sig * (lam * sig + (1 - lam) * sig[PERM]) + (
        lam * mu + (1 - lam) * mu[PERM]
    )
    torch.testing.assert_close(mix_styles(X, LAM, PERM, eps=eps), expected, rtol=1e-12, atol=1e-12)
    # λ = 1 keeps each sample's own style: the input comes back
    torch.testing.assert_close(
        mix_styles(X, torch.ones(2, dtype=torch.float64), PERM, eps=0.0), X, rtol=0, atol=1e-12
    )


def test_the_statistics_are_detached_as_in_the_paper():
    """Catches gradients through μ and σ: with them detached, d x̂ / d x = σ_mix / σ exactly."""
    x = X.clone().requires_grad_(True)
    upstream = torch.tensor([[[[1.0, -2.0]], [[0.5, 3.0]]], [[[2.0, 1.0]], [[-1.0, 4.0]]]])
    mix_styles(x, LAM, PERM, eps=0.0).backward(upstream.double())
    torch.testing.assert_close(x.grad, upstream.double() * RATIO, rtol=0, atol=1e-12)


def test_evaluation_mode_is_the_identity_and_training_mixes():
    """Catches MixStyle active at evaluation (or never active in training)."""
    layer = MixStyle(p=1.0, alpha=0.1)
    x = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(0))
    assert layer.eval()(x) is x
    torch.manual_seed(0)
    assert not torch.allclose(layer.train()(x), x)
    # a whole hooked model: in eval mode the same function as the plain model
    torch.manual_seed(1)
    plain = build_model("small_cnn", 3)
    hooked = build_model("small_cnn", 3)
    hooked.load_state_dict(plain.state_dict())
    insert_mixstyle(hooked, MixStyleHparams(p=1.0))
    images = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(hooked.eval()(images), plain.eval()(images))
        torch.manual_seed(3)
        assert not torch.allclose(hooked.train()(images), plain.train()(images))


def test_the_layer_draws_lambda_from_beta_and_a_permutation_from_the_seeded_torch_rng():
    """Catches draws outside torch's seeded RNG (python's random: runs not reproducible, Flower
    not equal to the simulator) or λ not Beta(α, α): same seed, same output; the output is
    mix_styles with λ ~ Beta(α, α) per sample and a random permutation, drawn in that order."""
    layer = MixStyle(p=1.0, alpha=0.3, eps=1e-6).train()
    x = torch.randn(5, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(7)
    out = layer(x)
    torch.manual_seed(7)
    alpha = torch.tensor(0.3, dtype=torch.float64)
    lam = torch.distributions.Beta(alpha, alpha).sample((5,))
    perm = torch.randperm(5)
    assert torch.equal(out, mix_styles(x, lam, perm, 1e-6))
    torch.manual_seed(8)
    assert not torch.equal(layer(x), out)


def test_p_is_the_probability_of_mixing_and_p_zero_draws_nothing():
    """Catches p inverted (mixing with probability 1 - p) and p = 0 consuming random numbers
    (which would shift dropout or any later draw, so p = 0 would not equal FedAvg)."""
    x = torch.randn(2, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    layer = MixStyle(p=0.2, alpha=0.1).train()
    torch.manual_seed(0)
    mixed = sum(not torch.equal(layer(x), x) for _ in range(2000))
    assert abs(mixed - 400) < 90  # binomial(2000, 0.2): sd 17.9, so 5 sd
    off = MixStyle(p=0.0, alpha=0.1).train()
    torch.manual_seed(0)
    before = torch.get_rng_state()
    assert off(x) is x
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize(
    ("model", "blocks", "expected"),
    [
        ("small_cnn", None, ["featurizer.0", "featurizer.1"]),  # all but the last of 3 blocks
        ("lenet5", None, ["featurizer.pool1"]),  # all but the last of 2 blocks
        ("lenet5", (1, 2), ["featurizer.pool1", "featurizer.pool2"]),
        ("small_cnn", (2,), ["featurizer.1"]),
        ("resnet18", None, ["featurizer.layer1", "featurizer.layer2", "featurizer.layer3"]),
    ],
)
def test_mixstyle_follows_the_chosen_conv_stages_and_adds_no_arrays(model, blocks, expected):
    """Catches MixStyle inserted after the wrong stages (the last one by default, the paper
    says not to), or inserted in a way that renames or adds model arrays (FedAvg and
    checkpoints would break)."""
    net = build_model(model, 3)
    names = list(net.state_dict())
    insert_mixstyle(net, MixStyleHparams(blocks=blocks))
    hooked = [n for n, m in net.named_modules() if m._forward_hooks]
    assert hooked == expected
    assert list(net.state_dict()) == names
    assert len(net.mixstyle) == len(expected)


def test_p_zero_equals_fedavg_exactly(tmp_path):
    """Catches MixStyle that changes training when it never mixes (a draw, a changed name or
    a changed op): with p = 0 a run equals FedAvg bit for bit."""
    fedavg = run_sim(tiny_config(rounds=2), tmp_path / "fedavg")
    mix = run_sim(tiny_config(rounds=2, algorithm={"name": "mixstyle", "p": 0.0}), tmp_path / "m")
    a, b = fedavg.server.global_arrays, mix.server.global_arrays
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def records(path):
        lines = (path / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if k != "time"} for x in lines]

    assert records(tmp_path / "fedavg") == records(tmp_path / "m")
    # and mixing does change training (the test above is not vacuous)
    on = run_sim(tiny_config(rounds=2, algorithm={"name": "mixstyle", "p": 1.0}), tmp_path / "on")
    assert not all(torch.equal(on.server.global_arrays[k], a[k]) for k in a)


# ------------------------------------------------------------------ config-time refusals
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.p=1.5"], "'algorithm.p'"),
        (["algorithm.p=-0.1"], "'algorithm.p'"),
        (["algorithm.alpha=0"], "'algorithm.alpha'"),
        (["algorithm.eps=0"], "'algorithm.eps'"),
        (["algorithm.blocks=[]"], "'algorithm.blocks'"),
        (["algorithm.blocks=[0]"], "'algorithm.blocks.0'"),
        (["algorithm.blocks=[1, 1]"], "'algorithm.blocks'"),
        (["algorithm.q=0.5"], "unknown key 'algorithm.q'"),
        (["algorithm.blocks=[3]"], "'model.name' = 'lenet5'.*algorithm.blocks = \\[3\\]"),
        (
            ["model.name=efficientnet_lite0", "algorithm.blocks=[8]"],
            "'model.name' = 'efficientnet_lite0'.*7 convolutional stages",
        ),
        (["model.name=small_cnn", "model.frozen=true"], "'model.frozen' = true"),
        (["model.name=small_cnn", "model.options.widths=[8]"], "set algorithm.blocks"),
    ],
)
def test_bad_settings_are_refused_when_the_config_loads(overrides, message):
    """Catches out-of-range hyper-parameters or an impossible insertion point accepted, or a
    message that does not name the key."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["algorithm.name=mixstyle", *overrides])


def test_good_settings_load():
    """Catches valid settings refused (p at its bounds, explicit blocks, unsorted blocks)."""
    for overrides in (
        ["algorithm.p=0"],
        ["algorithm.p=1", "algorithm.alpha=0.3"],
        ["algorithm.blocks=[2, 1]"],
        ["model.name=small_cnn", "algorithm.blocks=[3]"],
    ):
        cfg = load_config(None, ["algorithm.name=mixstyle", *overrides])
        assert cfg.algorithm.name == "mixstyle"
