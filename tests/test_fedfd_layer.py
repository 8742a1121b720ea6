"""FedFDBatchNorm2d (fedfda.md §3.2-§3.3) against independent references: torch's BatchNorm2d and
InstanceNorm2d, float64 formulas written out here, a hand-computed adapter parameter count, and
batch permutations/splits (fedfda.md §8 checks 1, 2, 5 and 6)."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
import torchvision
from torch import nn

from feddomain.errors import ConfigError
from feddomain.models import build_model
from feddomain.models.fedfd_bn import (
    BNMode,
    FedFDBatchNorm2d,
    adapter_parameters,
    convert_batchnorm,
    fedfd_layers,
    set_bn_mode,
)

F32 = dict(rtol=1e-5, atol=1e-5)  # float32 rounding of a few operations on O(1) values
F64 = dict(rtol=1e-12, atol=1e-12)  # float64: only the order of operations differs


def _layer(channels: int = 4, seed: int = 0, adapter: int | None = None) -> FedFDBatchNorm2d:
    """A layer with non-trivial γ, β, running and global statistics (all distinct)."""
    g = torch.Generator().manual_seed(seed)
    layer = FedFDBatchNorm2d(channels, adapter_reduction=adapter)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(channels, generator=g) + 0.5)
        layer.bias.copy_(torch.randn(channels, generator=g))
        layer.running_mean.copy_(torch.randn(channels, generator=g))
        layer.running_var.copy_(torch.rand(channels, generator=g) + 0.5)
        layer.global_mean.copy_(torch.randn(channels, generator=g))
        layer.global_var.copy_(torch.rand(channels, generator=g) + 0.2)
    return layer


def _input(batch: int = 6, channels: int = 4, seed: int = 1) -> torch.Tensor:
    """Samples with their own per-channel offsets and scales (instance statistics differ)."""
    g = torch.Generator().manual_seed(seed)
    shift = 3 * torch.randn(batch, channels, 1, 1, generator=g)
    scale = torch.rand(batch, channels, 1, 1, generator=g) + 0.5
    return shift + scale * torch.randn(batch, channels, 5, 7, generator=g)


def _expected(
    layer: FedFDBatchNorm2d, x: torch.Tensor, a: torch.Tensor, local: str
) -> torch.Tensor:
    """γ (x − μ*)/σ* + β in float64, μ* = a μ_L + (1 − a) μ_G, σ* likewise (§3.2)."""
    x = x.double()
    eps = layer.eps
    dims = (2, 3) if local == "instance" else (0, 2, 3)
    mu_l = x.mean(dim=dims, keepdim=True)
    sigma_l = (((x - mu_l) ** 2).mean(dim=dims, keepdim=True) + eps).sqrt()
    mu_g = layer.global_mean.double().view(1, -1, 1, 1)
    sigma_g = (layer.global_var.double() + eps).sqrt().view(1, -1, 1, 1)
    a = a.double().view(-1, 1, 1, 1)
    mu = a * mu_l + (1 - a) * mu_g
    sigma = a * sigma_l + (1 - a) * sigma_g
    gamma = layer.weight.double().view(1, -1, 1, 1)
    beta = layer.bias.double().view(1, -1, 1, 1)
    return gamma * (x - mu) / sigma + beta


def _forward(layer: FedFDBatchNorm2d, mode: BNMode, x: torch.Tensor) -> torch.Tensor:
    layer.train_mode = mode
    layer.train()
    return layer(x)


def _fixed_rand(monkeypatch: pytest.MonkeyPatch, value: float) -> list[tuple[int, ...]]:
    """torch.rand returns ``value`` everywhere; the shapes asked for are recorded."""
    asked: list[tuple[int, ...]] = []

    def rand(*size, **kwargs):
        shape = tuple(size[0]) if size and isinstance(size[0], tuple | list) else tuple(size)
        asked.append(shape)
        return torch.full(shape, value)

    monkeypatch.setattr(torch, "rand", rand)
    return asked


# ------------------------------------------------------------------ check 1
def test_random_mix_with_u_forced_to_0_is_eval_mode_batchnorm_with_the_global_statistics(
    monkeypatch,
):
    """Catches the mix weighting the wrong side (u on the global statistics), σ_G without eps,
    or the mix using the running instead of the global statistics (§8 check 1a)."""
    layer, x = _layer(), _input()
    reference = nn.BatchNorm2d(4).eval()
    reference.load_state_dict(
        {**{k: v for k, v in layer.state_dict().items() if k in reference.state_dict()},
         "running_mean": layer.global_mean, "running_var": layer.global_var}
    )  # fmt: skip
    asked = _fixed_rand(monkeypatch, 0.0)
    out = _forward(layer, BNMode("random"), x)
    assert asked == [()]  # one u for the layer, shared by the batch (CHOICE F2)
    torch.testing.assert_close(out, reference(x), **F32)
    assert torch.equal(_forward(layer, BNMode("global"), x), reference(x))  # torch's own kernel
    assert not torch.allclose(out, _forward(layer, BNMode("batch"), x), atol=1e-2)


def test_random_mix_with_u_forced_to_1_is_instance_norm_with_the_same_affine(monkeypatch):
    """Catches instance statistics over the wrong dimensions, the unbiased variance, or eps
    added outside the square root (§8 check 1b)."""
    layer, x = _layer(), _input()
    noise = torch.randn(x[:, 0].shape, generator=torch.Generator().manual_seed(9))
    x[:, 0] = 3e-3 * noise  # a channel whose variance (about 1e-5) is near eps
    assert x[:, 0].var() < 1e-4
    reference = nn.InstanceNorm2d(4, affine=True, eps=layer.eps)
    reference.load_state_dict({"weight": layer.weight, "bias": layer.bias})
    _fixed_rand(monkeypatch, 1.0)
    torch.testing.assert_close(_forward(layer, BNMode("random"), x), reference(x), **F32)
    torch.testing.assert_close(_forward(layer, BNMode("instance"), x), reference(x), **F32)


@pytest.mark.parametrize("local", ["instance", "batch"])
@pytest.mark.parametrize("u", [0.25, 0.7])
def test_an_intermediate_u_mixes_means_and_standard_deviations_convexly(monkeypatch, u, local):
    """Catches mixing variances instead of standard deviations, u and 1 − u swapped, or
    ``local_stats`` ignored (§8 check 1c; float64 layer against a float64 formula)."""
    layer, x = _layer().double(), _input().double()
    _fixed_rand(monkeypatch, u)
    # torch.rand's u is a float32 number; the fixed mode's alpha a Python (float64) one
    expected = _expected(layer, x, torch.tensor(u, dtype=torch.float32), local)
    out = _forward(layer, BNMode("random", local_stats=local), x)
    torch.testing.assert_close(out, expected, **F64)
    fixed = _forward(layer, BNMode("fixed", alpha=u, local_stats=local), x)
    torch.testing.assert_close(
        fixed, _expected(layer, x, torch.tensor(u, dtype=torch.float64), local), **F64
    )
    # mixing the variances linearly instead gives a different output (the test can tell)
    other = _expected(layer, x, torch.tensor(u**2), local)
    assert (out - other).abs().max() > 1e-3


def test_per_sample_random_u_draws_one_u_per_sample(monkeypatch):
    """Catches ``per_sample`` ignored: each sample gets its own u (CHOICE F2's option)."""
    layer, x = _layer().double(), _input().double()
    draws = torch.tensor([0.1, 0.9, 0.5, 0.0, 1.0, 0.3], dtype=torch.float64)
    asked = []
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: asked.append(shape) or draws.clone())
    out = _forward(layer, BNMode("random", per_sample=True), x)
    assert asked == [(6,)]
    torch.testing.assert_close(out, _expected(layer, x, draws, "instance"), **F64)


def test_batch_mode_is_torchs_batchnorm_in_train_mode_running_statistics_included():
    """Catches a batch mode that normalises or updates running statistics differently from
    nn.BatchNorm2d (momentum, unbiased running variance, the counter), in train and eval."""
    layer = _layer()
    reference = nn.BatchNorm2d(4)
    reference.load_state_dict(
        {k: v for k, v in layer.state_dict().items() if k in reference.state_dict()}
    )
    for seed in range(3):
        x = _input(seed=seed)
        assert torch.equal(_forward(layer, BNMode("batch"), x), reference.train()(x))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(layer, name), getattr(reference, name)), name
    assert int(layer.num_batches_tracked) == 3
    layer.eval_mode = BNMode("batch")
    assert torch.equal(layer.eval()(x), reference.eval()(x))


# ------------------------------------------------------------------ check 2
@pytest.mark.parametrize(
    "mode",
    [BNMode("global"), BNMode("instance"), BNMode("fixed", alpha=0.3), BNMode("random"),
     BNMode("random", per_sample=True), BNMode("adapter")],
    ids=["global", "instance", "fixed", "random", "random-per-sample", "adapter"],
)  # fmt: skip
def test_only_batch_mode_moves_running_statistics_and_no_mode_moves_the_global_ones(mode):
    """Catches a mixing or adapter mode that updates running statistics (they must hold the
    client's ordinary BN statistics only) or any mode that writes the global statistics."""
    layer = _layer(adapter=2)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    for seed in range(2):
        _forward(layer, mode, _input(seed=seed))
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())
    _forward(layer, BNMode("batch"), _input())
    after = layer.state_dict()
    assert not torch.equal(after["running_mean"], before["running_mean"])
    for k in ("global_mean", "global_var"):
        assert torch.equal(after[k], before[k])


@pytest.mark.parametrize(
    "mode",
    [BNMode("global"), BNMode("instance"), BNMode("fixed", alpha=0.3), BNMode("random"),
     BNMode("adapter")],
    ids=["global", "instance", "fixed", "random-u-fixed", "adapter"],
)  # fmt: skip
def test_per_sample_modes_do_not_depend_on_the_other_samples_of_the_batch(mode, monkeypatch):
    """Catches batch statistics leaking into a per-sample mode: a permuted batch gives the
    permuted outputs, and two halves give the whole batch's outputs (§8 check 2)."""
    _fixed_rand(monkeypatch, 0.6)
    layer = _layer(adapter=2)
    with torch.no_grad():  # a non-constant adapter: α depends on the sample
        layer.adapter.net[2].weight.normal_()
    x = _input(batch=8)
    perm = torch.tensor([3, 0, 7, 1, 6, 2, 5, 4])
    whole = _forward(layer, mode, x)
    torch.testing.assert_close(_forward(layer, mode, x[perm]), whole[perm], **F32)
    halves = torch.cat([_forward(layer, mode, x[:3]), _forward(layer, mode, x[3:])])
    torch.testing.assert_close(halves, whole, **F32)
    # the batch-statistics mix does depend on the rest of the batch (the check can tell)
    mixed = BNMode("fixed", alpha=0.6, local_stats="batch")
    assert not torch.allclose(_forward(layer, mixed, x[:3]), _forward(layer, mixed, x)[:3])


# ------------------------------------------------------------------ conversion
def test_every_batchnorm2d_of_any_backbone_is_converted_with_its_state():
    """Catches BatchNorm layers missed (nested, or named unlike 'bn'), state lost in the
    conversion (affine, running statistics, eps and momentum of a TF port), and global
    statistics not starting from the running ones (ImageNet's for a pretrained backbone)."""
    models = {
        "torchvision-resnet18": (torchvision.models.resnet18(), 20),
        "small_cnn": (build_model("small_cnn", 3), 3),
        "efficientnet_lite0": (build_model("efficientnet_lite0", 3, resolution=32), 49),
    }
    for name, (model, count) in models.items():
        model.eval()
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.uniform_(-1, 1)
        before = copy.deepcopy(model)
        convert_batchnorm(model)
        layers = dict(fedfd_layers(model))
        assert len(layers) == count, name
        assert not any(type(m) is nn.BatchNorm2d for m in model.modules()), (
            name
        )  # none left unconverted
        old = dict(before.named_modules())
        for key, layer in layers.items():
            bn = old[key]
            assert (layer.eps, layer.momentum) == (bn.eps, bn.momentum), key
            for leaf in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
                assert torch.equal(getattr(layer, leaf), getattr(bn, leaf)), (key, leaf)
            assert torch.equal(layer.global_mean, bn.running_mean)
            assert torch.equal(layer.global_var, bn.running_var)
        x = torch.rand(2, 3, 32, 32)
        assert torch.equal(model(x), before(x)), name  # mode "batch": the same network
    eff = dict(fedfd_layers(models["efficientnet_lite0"][0]))
    assert {layer.eps for layer in eff.values()} != {1e-5}  # its own eps survived


def test_a_batchnorm_without_running_statistics_is_refused_by_name():
    """Catches a layer without running statistics silently converted (FedFD needs them)."""
    model = nn.Sequential(
        OrderedDict(conv=nn.Conv2d(3, 4, 1), odd=nn.BatchNorm2d(4, track_running_stats=False))
    )
    with pytest.raises(ValueError, match="'odd' keeps no running statistics"):
        convert_batchnorm(model)


@pytest.mark.parametrize(
    "mode",
    [BNMode("instance"), BNMode("fixed", alpha=0.5), BNMode("random"), BNMode("adapter")],
    ids=["instance", "fixed", "random", "adapter"],
)
def test_instance_statistics_of_a_1x1_map_are_refused_naming_the_layer(mode):
    """Catches the silent collapse of instance statistics over a 1x1 map (the mean is the
    feature, the variance 0: every sample normalises to beta), which EfficientNet-Lite0's last
    stages reach below 64 px; batch statistics (or a 2x2 map) stay allowed."""
    model = nn.Sequential(OrderedDict(conv=nn.Conv2d(3, 4, 1), late=nn.BatchNorm2d(4)))
    convert_batchnorm(model, adapter_reduction=2)
    set_bn_mode(model, mode, training=False)
    model.eval()
    with pytest.raises(ConfigError, match="'late': instance statistics of a 1x1 feature map"):
        model(torch.randn(5, 3, 1, 1))
    assert model(torch.randn(5, 3, 2, 2)).shape == (5, 4, 2, 2)
    set_bn_mode(model, BNMode("fixed", alpha=0.5, local_stats="batch"), training=False)
    assert model(torch.randn(5, 3, 1, 1)).shape == (5, 4, 1, 1)


# ------------------------------------------------------------------ check 5: the adapter
def test_resnet18_adapters_hold_218220_parameters():
    """Catches an adapter of another shape (channel-wise α: 0.33M; a single 2C→1 layer: 0.01M)
    or one missing from a layer, e.g. the downsample BatchNorms (§8 check 5: 218,220 ± 1%)."""
    channels = [64] * 5 + [128] * 5 + [256] * 5 + [512] * 5  # stem, layer1, layer2-4 (+downsample)
    by_hand = sum(2 * c * (c // 16) + c // 16 + c // 16 + 1 for c in channels)
    assert by_hand == 218_220
    model = convert_batchnorm(torchvision.models.resnet18(), adapter_reduction=16)
    assert sum(p.numel() for p in adapter_parameters(model)) == by_hand
    plain = sum(p.numel() for p in torchvision.models.resnet18().parameters())
    assert sum(p.numel() for p in model.parameters()) == plain + by_hand


def _alphas(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Every adapter's α for ``x`` (forward hooks on the adapters)."""
    seen: list[torch.Tensor] = []
    hooks = [
        layer.adapter.register_forward_hook(lambda m, i, out: seen.append(out.detach()))
        for _, layer in fedfd_layers(model)
    ]
    model(x)
    for h in hooks:
        h.remove()
    return seen


def test_alpha_is_one_half_at_initialisation_and_stays_inside_0_1():
    """Catches an adapter not zero-initialised at its output (α ≠ 0.5 at the start), one α per
    channel instead of per sample, or an output not squashed into (0, 1) (§8 check 5)."""
    model = convert_batchnorm(build_model("small_cnn", 3), adapter_reduction=16).eval()
    set_bn_mode(model, BNMode("adapter"), training=False)
    x = _input(batch=5, channels=3, seed=2)[:, :, :4, :4].repeat(1, 1, 8, 8)
    alphas = _alphas(model, x)
    assert len(alphas) == 3 and all(a.shape == (5,) for a in alphas)
    assert all(torch.equal(a, torch.full((5,), 0.5)) for a in alphas)
    with torch.no_grad():
        for p in adapter_parameters(model):
            p.normal_(0, 0.3)
    alphas = _alphas(model, x)
    assert all(((a > 0) & (a < 1)).all() for a in alphas)
    assert any((a - 0.5).abs().max() > 0.05 for a in alphas)


# ------------------------------------------------------------------ check 6: inference
def test_global_mode_predicts_like_a_standard_resnet18_holding_the_global_statistics():
    """Catches FedFD's inference reading the running (local) statistics or anything but
    eval-mode BatchNorm with the global statistics (§8 check 6a; bit-identical kernels)."""
    torch.manual_seed(0)
    standard = torchvision.models.resnet18(num_classes=7)
    model = convert_batchnorm(copy.deepcopy(standard))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for (_, layer), bn in zip(
            fedfd_layers(model),
            (m for m in standard.modules() if isinstance(m, nn.BatchNorm2d)),
            strict=True,
        ):
            layer.running_mean.normal_(generator=g)  # local statistics: must not be used
            layer.global_mean.copy_(torch.randn(layer.num_features, generator=g) * 0.1)
            layer.global_var.copy_(torch.rand(layer.num_features, generator=g) + 0.5)
            bn.running_mean.copy_(layer.global_mean)
            bn.running_var.copy_(layer.global_var)
    set_bn_mode(model, BNMode("global"), training=False)
    x = torch.randn(4, 3, 32, 32, generator=g)
    assert torch.equal(model.eval()(x), standard.eval()(x))


def test_adapter_inference_gives_a_sample_the_same_prediction_at_batch_1_and_64():
    """Catches test-batch statistics used anywhere on FedFD-A's inference path (§8 check 6b):
    each of 64 samples alone gives the logits it gets inside the batch of 64."""
    torch.manual_seed(0)
    model = convert_batchnorm(torchvision.models.resnet18(num_classes=7), adapter_reduction=16)
    with torch.no_grad():
        for p in adapter_parameters(model):
            p.normal_(0, 0.5)  # α varies with the sample
    set_bn_mode(model, BNMode("adapter"), training=False)
    model.eval()
    # 64x64 images: ResNet-18's last stage is 2x2 (at 30 px it would be 1x1, where instance
    # statistics are the features themselves and every layer4 output the same)
    x = _input(batch=64, channels=3, seed=4)[:, :, :, :4].repeat(1, 1, 13, 16)[:, :, :64]
    with torch.no_grad():
        whole = model(x)
        alone = torch.cat([model(x[i : i + 1]) for i in range(64)])
        set_bn_mode(model, BNMode("global"), training=False)
        plain = model(x)
    torch.testing.assert_close(alone, whole, rtol=1e-4, atol=1e-4)
    assert torch.equal(alone.argmax(1), whole.argmax(1))
    assert (whole - plain).abs().max() > 1e-2  # the adapter really changed the output
