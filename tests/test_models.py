"""Model zoo: exact layer shapes and parameter counts from the papers, the featurizer/classifier
contract, local-only weight loading, frozen BatchNorm statistics and the registry's errors."""

from __future__ import annotations

import re
import sys
import urllib.request

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.func import functional_call

from feddomain.errors import ConfigError
from feddomain.models import (
    IMAGENET_NORMALIZATION,
    MODELS,
    FeatureClassifier,
    build_model,
    input_normalization,
    model_options,
)
from feddomain.models.hfedf_cnn import Inception

RANDOM_INIT = ["hfedf_cnn", "lenet5", "small_cnn", "resnet18", "resnet50"]


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- hFedF's client CNN (hfedf.md §3.2) -------------------------------------------------------


@pytest.mark.parametrize(("classes", "expected"), [(7, 928_199), (65, 943_105), (5, 927_685)])
def test_hfedf_cnn_parameter_counts_match_the_spec(classes: int, expected: int) -> None:
    model = build_model("hfedf_cnn", classes)
    assert n_params(model) == expected
    assert len(list(model.parameters())) == 22


def test_hfedf_cnn_intermediate_shapes_follow_table_9() -> None:
    model = build_model("hfedf_cnn", 7)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, layer in model.featurizer.named_children():
        layer.register_forward_hook(
            lambda _m, _i, out, name=name: shapes.__setitem__(name, tuple(out.shape[1:]))
        )
    logits = model(torch.randn(2, 3, 32, 32))
    assert shapes == {
        "conv1": (32, 32, 32),
        "pool1": (32, 16, 16),
        "relu1": (32, 16, 16),
        "conv2": (32, 16, 16),
        "conv3": (64, 16, 16),
        "pool2": (64, 8, 8),
        "relu2": (64, 8, 8),
        "inception1": (176, 8, 8),
        "inception2": (288, 8, 8),
        "avgpool": (288, 3, 3),
        "flatten": (2592,),
        "dropout": (2592,),
        "fc": (256,),
    }
    assert logits.shape == (2, 7)
    assert model.n_features == 256
    assert isinstance(model.classifier, nn.Linear)
    assert (model.classifier.in_features, model.classifier.out_features) == (256, 7)


def test_hfedf_cnn_modules_are_discoverable_by_type() -> None:
    model = build_model("hfedf_cnn", 7)
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert len(convs) == 3 + 2 * 3
    assert linears == ["featurizer.fc", "classifier"]
    assert not [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def test_inception_concatenates_three_convs_and_the_max_pooled_input() -> None:
    torch.manual_seed(0)
    block = Inception(64)
    x = torch.randn(2, 64, 8, 8)
    out = block(x)
    assert out.shape == (2, 176, 8, 8)
    assert torch.equal(out[:, 112:], torch.relu(F.max_pool2d(x, 3, stride=1, padding=1)))
    assert torch.equal(out[:, :32], torch.relu(block.branch1(x)))
    assert len(list(block.parameters())) == 6  # the pass-through branch has none


def test_hfedf_cnn_fc_act_controls_the_feature_sign() -> None:
    x = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    linear = build_model("hfedf_cnn", 7).eval()
    torch.manual_seed(0)
    relu = build_model("hfedf_cnn", 7, fc_act="relu").eval()
    with torch.no_grad():
        f_linear, f_relu = linear.featurizer(x), relu.featurizer(x)
    assert (f_linear < 0).any()  # Table 9: no activation after Linear 2592->256
    assert torch.equal(f_relu, torch.relu(f_linear))
    with pytest.raises(ConfigError, match=r"fc_act='tanh'.*\['none', 'relu'\]"):
        build_model("hfedf_cnn", 7, fc_act="tanh")


# --- LeNet-5 (hfedatm.md §2.7) ---------------------------------------------------------------


def test_lenet5_has_61751_parameters_for_seven_classes() -> None:
    model = build_model("lenet5", 7)
    assert n_params(model) == 61_751
    assert model.featurizer.fc1.in_features == 400
    assert model.n_features == 84
    assert model(torch.randn(3, 3, 32, 32)).shape == (3, 7)


def test_lenet5_features_are_tanh_bounded() -> None:
    torch.manual_seed(0)
    features = build_model("lenet5", 10).featurizer(100 * torch.randn(4, 3, 32, 32))
    assert features.abs().max() <= 1.0


def test_lenet5_adapts_flatten_width_to_resolution() -> None:
    # 64 -> conv5 60 -> pool 30 -> conv5 26 -> pool 13: 16 * 13 * 13 = 2704
    model = build_model("lenet5", 7, resolution=64)
    assert model.featurizer.fc1.in_features == 2704
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 7)
    # 16 is the smallest that leaves a 1x1 map: 16 -> 12 -> 6 -> 2 -> 1
    assert build_model("lenet5", 7, resolution=16).featurizer.fc1.in_features == 16
    with pytest.raises(ConfigError, match=r"resolution=15 is too small.*at least 16"):
        build_model("lenet5", 7, resolution=15)


def test_lenet5_batchnorm_variant_normalises_each_conv_before_its_activation() -> None:
    """The BN model of the CPU profile. Catches: the option ignored (no BatchNorm), BatchNorm
    after the tanh or the pooling, a conv bias left in front of it, a changed parameter count
    (61,751 - 22 conv biases + 2 * 22 affine = 61,773)."""
    model = build_model("lenet5", 7, norm="batch")
    names = [name for name, _ in model.featurizer.named_children()]
    assert names[:8] == ["conv1", "bn1", "act1", "pool1", "conv2", "bn2", "act2", "pool2"]
    assert [m.num_features for m in model.modules() if isinstance(m, nn.BatchNorm2d)] == [6, 16]
    assert model.featurizer.conv1.bias is None and model.featurizer.conv2.bias is None
    assert n_params(model) == 61_773
    with pytest.raises(ConfigError, match=r"norm='group' is not one of \['none', 'batch'\]"):
        build_model("lenet5", 7, norm="group")


# --- small CNN with a choice of normalisation -------------------------------------------------


def test_small_cnn_parameter_count_with_batchnorm() -> None:
    # convs without bias: 3*32*9 + 32*64*9 + 64*128*9; BN affine: 2*(32+64+128); head: 128*7+7
    expected = 864 + 18_432 + 73_728 + 2 * 224 + 903
    model = build_model("small_cnn", 7)
    assert n_params(model) == expected
    assert model.n_features == 128


@pytest.mark.parametrize(
    ("norm", "kind", "conv_bias"),
    [("batch", nn.BatchNorm2d, False), ("group", nn.GroupNorm, False), ("none", None, True)],
)
def test_small_cnn_norm_option(norm: str, kind: type | None, conv_bias: bool) -> None:
    model = build_model("small_cnn", 7, norm=norm)
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d | nn.GroupNorm)]
    assert len(norms) == (0 if kind is None else 3)
    assert all(isinstance(m, kind) for m in norms)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert all((c.bias is not None) == conv_bias for c in convs)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_small_cnn_rejects_bad_options() -> None:
    with pytest.raises(ConfigError, match=r"norm='layer'.*\['batch', 'group', 'none'\]"):
        build_model("small_cnn", 7, norm="layer")
    with pytest.raises(ConfigError, match="groups=8 must divide every width in \\[12, 64\\]"):
        build_model("small_cnn", 7, norm="group", widths=[12, 64])
    with pytest.raises(ConfigError, match="resolution=4 is below 8"):
        build_model("small_cnn", 7, resolution=4)


# --- ResNets: architecture, local weights, frozen BN statistics --------------------------------


def test_resnet_heads_and_parameter_counts() -> None:
    # torchvision's published totals with the 1000-way head: 11,689,512 and 25,557,032.
    r18 = build_model("resnet18", 7)
    assert r18.n_features == 512
    assert n_params(r18) == 11_689_512 - (512 * 1000 + 1000) + (512 * 7 + 7)
    r50 = build_model("resnet50", 7)
    assert r50.n_features == 2048
    assert n_params(r50) == 25_557_032 - (2048 * 1000 + 1000) + (2048 * 7 + 7)
    assert r18(torch.randn(2, 3, 32, 32)).shape == (2, 7)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args, **_kwargs):
        raise AssertionError("a model builder tried to use the network")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", refuse)
    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)
    monkeypatch.setattr(urllib.request, "urlopen", refuse)


@pytest.mark.usefixtures("no_network")
def test_resnet18_loads_a_local_state_dict(tmp_path) -> None:
    torch.manual_seed(123)
    source = torchvision.models.resnet18(weights=None)
    with torch.no_grad():  # make buffers differ from their defaults too
        source.bn1.running_mean.uniform_()
    path = tmp_path / "resnet18.pt"
    torch.save(source.state_dict(), path)

    torch.manual_seed(0)
    model = build_model("resnet18", 7, weights_path=str(path))
    loaded = model.featurizer.state_dict()
    expected = {k: v for k, v in source.state_dict().items() if not k.startswith("fc.")}
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    torch.manual_seed(0)
    fresh = build_model("resnet18", 7)
    assert not torch.equal(fresh.featurizer.conv1.weight, model.featurizer.conv1.weight)
    assert torch.equal(fresh.classifier.weight, model.classifier.weight)  # head: same fresh init


@pytest.mark.usefixtures("no_network")
def test_resnet_weight_errors_name_the_file(tmp_path) -> None:
    missing = tmp_path / "nope.pt"
    with pytest.raises(ConfigError, match=f"file not found: {re.escape(str(missing))}"):
        build_model("resnet18", 7, weights_path=str(missing))

    r18 = tmp_path / "r18.pt"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), r18)
    with pytest.raises(
        ConfigError, match=f"{re.escape(str(r18))} does not match resnet50: missing keys"
    ):
        build_model("resnet50", 7, weights_path=str(r18))

    state = torchvision.models.resnet18(weights=None).state_dict()
    state["conv1.weight"] = torch.zeros(64, 3, 3, 3)
    bad_shape = tmp_path / "shape.pt"
    torch.save(state, bad_shape)
    with pytest.raises(ConfigError, match=r"conv1.weight has shape \(64, 3, 3, 3\), expected"):
        build_model("resnet18", 7, weights_path=str(bad_shape))

    not_a_state = tmp_path / "list.pt"
    torch.save([1, 2, 3], not_a_state)
    with pytest.raises(ConfigError, match="does not hold a state dict"):
        build_model("resnet18", 7, weights_path=str(not_a_state))

    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match=f"cannot read {re.escape(str(garbage))}"):
        build_model("resnet18", 7, weights_path=str(garbage))


def _bn_layers(model: nn.Module) -> list[nn.BatchNorm2d]:
    return [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]


def test_freeze_bn_stats_keeps_running_statistics_but_trains_affine() -> None:
    torch.manual_seed(0)
    model = build_model("resnet18", 7, freeze_bn_stats=True)
    before = [bn.running_mean.clone() for bn in _bn_layers(model)]
    model.train()
    assert model.training and model.featurizer.training
    assert not any(bn.training for bn in _bn_layers(model))
    model(torch.randn(4, 3, 32, 32) + 3.0).sum().backward()
    after = [bn.running_mean for bn in _bn_layers(model)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert model.featurizer.bn1.weight.grad.abs().sum() > 0

    torch.manual_seed(0)
    plain = build_model("resnet18", 7).train()
    plain(torch.randn(4, 3, 32, 32) + 3.0)
    assert not torch.equal(plain.featurizer.bn1.running_mean, before[0])


# --- contract shared by all models -------------------------------------------------------------


@pytest.mark.parametrize("name", RANDOM_INIT)
def test_same_seed_builds_identical_parameters(name: str) -> None:
    torch.manual_seed(7)
    a = build_model(name, 5)
    torch.manual_seed(7)
    b = build_model(name, 5)
    torch.manual_seed(8)
    c = build_model(name, 5)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert list(pa) == list(pb)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not all(torch.equal(pa[k], pc[k]) for k in pa)


@pytest.mark.parametrize("name", ["hfedf_cnn", "lenet5", "small_cnn"])
def test_models_work_with_functional_call(name: str) -> None:
    torch.manual_seed(0)
    model = build_model(name, 4).eval()
    params = dict(model.named_parameters())
    assert len({p.data_ptr() for p in params.values()}) == len(params)  # no sharing
    doubled = {k: 2 * v.detach() for k, v in params.items()}
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        out = functional_call(model, doubled, (x,))
        for k, p in model.named_parameters():
            p.copy_(doubled[k])
        assert torch.allclose(out, model(x), atol=1e-6)
    assert torch.equal(model(x), model.classifier(model.featurizer(x)))


# --- EfficientNet-Lite0 (optional extra) -------------------------------------------------------


def test_efficientnet_loads_packaged_imagenet_weights(efficientnet_extra) -> None:
    from feddomain.models.efficientnet import packaged_weights_path

    packaged = torch.load(packaged_weights_path(), map_location="cpu", weights_only=True)
    torch.manual_seed(0)
    model = build_model("efficientnet_lite0", 7, resolution=128)
    state = model.featurizer.state_dict()
    backbone_keys = [k for k in packaged if not k.startswith("_fc.")]
    assert sorted(state) == sorted(backbone_keys)
    assert all(torch.equal(state[k], packaged[k]) for k in backbone_keys)
    assert model.n_features == 1280 and model.classifier.out_features == 7

    torch.manual_seed(0)
    scratch = build_model("efficientnet_lite0", 7, resolution=128, pretrained=False)
    assert not torch.equal(scratch.featurizer._conv_stem.weight, packaged["_conv_stem.weight"])

    model.eval()
    g = torch.Generator().manual_seed(0)
    smooth = torch.linspace(-1, 1, 128).expand(1, 3, 128, 128)
    noise = torch.rand(1, 3, 128, 128, generator=g) * 2 - 1
    with torch.no_grad():
        features = model.featurizer(torch.cat([smooth, noise]))
    assert features.shape == (2, 1280)
    assert not torch.allclose(features[0], features[1], atol=1e-3)


def test_efficientnet_stages_end_each_block_group(efficientnet_extra) -> None:
    """Catches: stage ends off by one block (a hook then sits inside a group, before its last
    block) or not at the groups' ends. Lite0's groups (Tan & Le 2019, Table 1, Lite variant):
    1, 2, 2, 3, 3, 4, 1 blocks of 16, 24, 40, 80, 112, 192, 320 channels at strides 2 (the stem),
    2, 4, 8, 16, 16, 32, 32 -> at 64 px sides 32, 16, 8, 4, 4, 2, 2."""
    model = build_model("efficientnet_lite0", 7, resolution=64, pretrained=False)
    assert model.stages == tuple(f"featurizer._blocks.{i}" for i in (0, 2, 4, 7, 10, 14, 15))
    shapes: list[tuple[int, ...]] = []
    for name in model.stages:
        model.get_submodule(name).register_forward_hook(
            lambda m, i, out: shapes.append(tuple(out.shape[1:]))
        )
    model.eval()
    with torch.no_grad():
        model(torch.zeros(1, 3, 64, 64))
    channels = (16, 24, 40, 80, 112, 192, 320)
    sides = (32, 16, 8, 4, 4, 2, 2)
    assert shapes == [(c, s, s) for c, s in zip(channels, sides, strict=True)]


def test_efficientnet_without_the_extra_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "efficientnet_lite_pytorch", None)
    with pytest.raises(ConfigError, match=r"pip install 'feddomain\[efficientnet\]'"):
        build_model("efficientnet_lite0", 7)


# --- VGG-11 (hfedatm.md §2.7) --------------------------------------------------------------


def test_vgg11_is_torchvisions_with_a_k_way_head() -> None:
    """Catches: a VGG-11 whose body differs from torchvision's configuration "A" (layer count,
    widths, the 7x7 pooled flatten) or whose head is not replaced. Counted on the meta device."""
    from torchvision.models import vgg11 as tv_vgg11

    with torch.device("meta"):
        ours, reference = build_model("vgg11", 7), tv_vgg11(weights=None)
    head = 4096 * 1000 + 1000
    assert n_params(ours) == n_params(reference) - head + 4096 * 7 + 7
    assert ours.featurizer.classifier[0].in_features == 512 * 7 * 7
    assert [k for k in ours.state_dict() if k.startswith("featurizer.features.")] == [
        f"featurizer.{k}" for k in reference.state_dict() if k.startswith("features.")
    ]
    narrow = build_model("vgg11", 3, hidden=16)
    assert narrow(torch.randn(2, 3, 32, 32)).shape == (2, 3)


def test_vgg11_refuses_bad_options_naming_them(tmp_path) -> None:
    with pytest.raises(ConfigError, match="weights_path needs hidden=4096, not 16"):
        build_model("vgg11", 3, hidden=16, weights_path=str(tmp_path / "w.pt"))
    with pytest.raises(ConfigError, match="weights_path: file not found"):
        build_model("vgg11", 3, weights_path=str(tmp_path / "w.pt"))
    with pytest.raises(ConfigError, match="resolution=16 is below 32"):
        build_model("vgg11", 3, resolution=16)


# --- registry ----------------------------------------------------------------------------------


def test_registry_names_and_options() -> None:
    text = {"text_cnn", "transformer", "roberta", "deberta"}  # tests/test_text*.py
    assert set(MODELS) == {*RANDOM_INIT, "efficientnet_lite0", "vgg11", *text}
    assert model_options("hfedf_cnn") == {"fc_act": "none"}
    assert model_options("resnet18") == {"weights_path": None, "freeze_bn_stats": False}
    assert isinstance(build_model("lenet5", 3), FeatureClassifier)


def test_registry_errors_name_the_culprit_and_the_closest_choice() -> None:
    with pytest.raises(ConfigError, match=r"unknown name 'lenet' \(did you mean 'lenet5'\?\)"):
        build_model("lenet", 7)
    with pytest.raises(ConfigError, match=r"unknown option 'fc_actt' \(did you mean 'fc_act'\?\)"):
        build_model("hfedf_cnn", 7, fc_actt="relu")
    with pytest.raises(ConfigError, match=r"unknown option 'weights'.*\['freeze_bn_stats'"):
        build_model("resnet18", 7, weights="DEFAULT")
    with pytest.raises(ConfigError, match="num_classes=0 must be a positive int"):
        build_model("lenet5", 0)


def test_input_normalization_for_pretrained_models() -> None:
    assert input_normalization("efficientnet_lite0") == ((0.5,) * 3, (0.5,) * 3)
    assert input_normalization("resnet50") == IMAGENET_NORMALIZATION
    assert input_normalization("lenet5") is None
    assert input_normalization("vgg11") == IMAGENET_NORMALIZATION
    with pytest.raises(ConfigError, match="unknown name 'vgg16'"):
        input_normalization("vgg16")


def test_small_cnn_flatten_pool_feeds_the_classifier_the_whole_last_map() -> None:
    """Catches ``pool="flatten"`` still averaging over positions (the demo's slow fit) or a
    classifier sized for the average: at 32 px three 2x2 pools leave 4x4, so 32 widths give
    32 * 16 = 512 features, and a digit shifted by a block of positions changes them."""
    model = build_model("small_cnn", 10, norm="batch", widths=[8, 16, 32], pool="flatten")
    assert model.n_features == 512 and model.classifier.in_features == 512
    assert not any(isinstance(m, nn.AdaptiveAvgPool2d) for m in model.modules())
    x = torch.randn(2, 3, 32, 32)
    assert model.featurizer(x).shape == (2, 512) and model(x).shape == (2, 10)
    with pytest.raises(ConfigError, match=r"pool='max' is not one of \['avg', 'flatten'\]"):
        build_model("small_cnn", 10, pool="max")
