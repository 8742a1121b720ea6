"""Frozen prefix (``model.frozen_prefix``): the cut model computes what the whole model does, a
run on the cached prefix maps equals the run that recomputes the prefix on every batch, and the
cache is recomputed whenever anything the maps depend on changes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from feddomain.config import validate_config
from feddomain.data.federated import prefix_features
from feddomain.errors import ConfigError
from feddomain.models import build_model
from feddomain.models.frozen import FrozenFeatures, PixelVariant
from feddomain.models.prefix import split_at
from tests.engine_helpers import run_sim, tiny_config, tiny_dataset, tiny_federation

F32_TOL = dict(rtol=1e-4, atol=1e-5)  # float32 rounding of the same convolutions, batched apart


def _prefix_config(tmp_path: Path, **overrides: object):
    settings = {
        "model__name": "small_cnn",
        "model__frozen_prefix": 1,
        "dataset__cache_dir": str(tmp_path / "cache"),
        "train__mean": [0.4, 0.5, 0.6],
        "train__std": [0.2, 0.25, 0.3],
        "train__momentum": 0.9,
    }
    return tiny_config(**{**settings, **overrides})


@pytest.mark.parametrize(
    ("name", "options", "stage"),
    [
        ("small_cnn", {}, 2),
        ("resnet18", {}, 2),
        ("efficientnet_lite0", {"pretrained": False}, 4),
    ],
)
def test_prefix_then_tail_computes_the_whole_model(name, options, stage) -> None:
    """Catches a cut that drops, repeats or reorders a layer (ResNet's stem, Lite0's head conv
    or pooling): in eval mode tail(prefix(x)) must be the whole model's output."""
    torch.manual_seed(0)
    whole = build_model(name, 5, resolution=64, **options).eval()
    x = torch.randn(3, 3, 64, 64)
    with torch.no_grad():
        expected = whole(x)
        prefix, tail = split_at(whole, stage)
        got = tail.eval()(prefix(x))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert tail.frozen_stages == stage and len(tail.stages) == len(whole.stages) - stage
    assert not any(p.requires_grad for p in prefix.parameters())
    for later in tail.stages:  # every later stage is a module of the tail
        tail.get_submodule(later)


def test_lite0_tail_keeps_the_whole_networks_drop_connect_rates() -> None:
    """Catches a tail that numbers its blocks from 0 (drop-connect rates of the first blocks
    instead of the network's later ones)."""
    whole = build_model("efficientnet_lite0", 5, resolution=64, pretrained=False)
    net = whole.featurizer
    _, tail = split_at(whole, 4)
    total = len(net._blocks)
    rate = net._global_params.drop_connect_rate
    first = tail.featurizer.start
    assert first == int(whole.stages[3].rsplit(".", 1)[1]) + 1 and rate > 0
    assert tail.featurizer.rate * first / tail.featurizer.total == pytest.approx(
        rate * first / total
    )


def test_cached_prefix_run_equals_recomputed_prefix_run(tmp_path) -> None:
    """Catches a cache that differs from the prefix the recomputing run applies (another
    normalisation, train-mode BatchNorm in the prefix, stale weights), or a tail trained on
    something else: 3 FedAvg rounds (SGD with momentum) end with the same weights and scores up
    to float32 error."""
    runs = {}
    for cache in (True, False):
        cfg = _prefix_config(tmp_path, model__prefix_cache=cache)
        sim = run_sim(cfg, tmp_path / f"run-{cache}")
        runs[cache] = sim
    cached, recomputed = runs[True], runs[False]
    assert cached.data.train[0].inputs.dtype == torch.float32  # maps, not images
    assert cached.data.train[0].inputs.shape[1:] == (32, 16, 16)
    assert recomputed.data.train[0].inputs.dtype == torch.uint8
    a, b = cached.model.state_dict(), recomputed.model.state_dict()
    assert a.keys() == b.keys()
    start = cached._init_model().state_dict()
    moved = [k for k in a if a[k].is_floating_point() and not torch.equal(a[k], start[k])]
    assert "featurizer.1.1.running_mean" in moved  # the tail's BatchNorm trains
    for key in a:
        torch.testing.assert_close(a[key], b[key], **F32_TOL)
    for rec_a, rec_b in zip(cached.records, recomputed.records, strict=True):
        assert rec_a["id_acc"] == pytest.approx(rec_b["id_acc"], abs=1e-9)
        assert rec_a["ood_acc"] == pytest.approx(rec_b["ood_acc"], abs=1e-9)


def _cache_files(tmp_path: Path) -> set[str]:
    return {p.name for p in (tmp_path / "cache" / "features").glob("features-*.pt")}


def test_prefix_cache_key_changes_with_weights_resolution_normalisation_and_variant(
    tmp_path,
) -> None:
    """Catches a cache key that misses what the maps depend on: each change writes a new file
    and the repeated call reads the first (no new file)."""
    dataset = tiny_dataset(n_per_domain=6)
    cfg = _prefix_config(tmp_path)
    first = prefix_features(cfg, dataset.images, 3)
    assert len(_cache_files(tmp_path)) == 1
    again = prefix_features(cfg, dataset.images, 3)
    assert torch.equal(first, again) and len(_cache_files(tmp_path)) == 1
    changes = [
        (cfg.model_copy(update={"seed": 1}), dataset.images),  # other initial weights
        (_prefix_config(tmp_path, train__mean=[0.5, 0.5, 0.5]), dataset.images),
        (
            _prefix_config(tmp_path, dataset__resolution=16),
            torch.nn.functional.interpolate(dataset.images.float(), size=16).to(torch.uint8),
        ),
    ]
    for n, (changed, images) in enumerate(changes, start=2):
        prefix_features(changed, images, 3)
        assert len(_cache_files(tmp_path)) == n
    dark = PixelVariant("style:dark", lambda x: x * 0.5)
    styled = prefix_features(cfg, dataset.images, 3, dark)
    assert len(_cache_files(tmp_path)) == 5
    assert not torch.allclose(styled, first)
    other = PixelVariant("style:light", lambda x: x * 0.5 + 0.5)
    prefix_features(cfg, dataset.images, 3, other)
    assert len(_cache_files(tmp_path)) == 6


def test_variant_maps_are_the_prefix_of_the_changed_images(tmp_path) -> None:
    """Catches a variant applied after normalisation (or not at all): its cached maps are the
    prefix of the changed images, normalised as any other."""
    torch.manual_seed(0)
    model = build_model("small_cnn", 3)
    prefix, _ = split_at(model, 1)
    images = tiny_dataset(n_per_domain=3).images
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
    variant = PixelVariant("half", lambda x: x * 0.5)
    maps = FrozenFeatures.compute(
        prefix, images, batch_size=5, mean=mean, std=std, cache_dir=tmp_path, key="k",
        variant=variant, flatten=False,
    )
    m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    with torch.no_grad():
        direct = prefix((images.float() / 255 * 0.5 - m) / s)
    torch.testing.assert_close(maps, direct, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"train__augment__hflip": True}, "train.augment"),
        ({"model__frozen_prefix": 3}, "model.frozen_prefix"),
        ({"model__name": "lenet5"}, "model.frozen_prefix"),
        ({"model__frozen": True}, "frozen_prefix"),
        (
            {"model__frozen_prefix": 2, "algorithm__name": "mixstyle", "algorithm__blocks": [1, 2]},
            "inside the frozen prefix",
        ),
        ({"model__frozen_prefix": 2, "algorithm__name": "mixstyle"}, "inside the frozen prefix"),
        ({"algorithm__name": "fisc", "model__prefix_cache": False}, "model.prefix_cache"),
        ({"algorithm__name": "ccst", "train__precise_bn": True}, "train.precise_bn"),
    ],
)
def test_random_pixel_work_and_bad_cuts_are_refused_by_name(tmp_path, overrides, named) -> None:
    """Catches a prefix run that would silently cache over augmentation or MixStyle inside the
    prefix, or cut a model that has no such stage."""
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        cfg = _prefix_config(tmp_path, **overrides)
        tiny_federation(cfg)


def test_mixstyle_after_the_prefix_acts_on_the_tail(tmp_path) -> None:
    """Catches stage numbers read from the tail's own list: stage 2 of small_cnn must be the
    tail's first stage."""
    cfg = _prefix_config(tmp_path, algorithm__name="mixstyle", algorithm__blocks=[2])
    sim = run_sim(cfg.model_copy(update={"rounds": 1}), tmp_path / "run")
    hooked = [n for n, m in sim.model.named_modules() if m._forward_hooks]
    assert hooked == ["featurizer.1"]


def test_mixstyle_by_default_on_a_tail_cut_after_stage_1_follows_the_whole_models_stages(
    tmp_path,
) -> None:
    """Catches the default rule (every stage but the last) dropping the cut's stage on a tail:
    small_cnn cut after stage 1 must mix the tail's input (stage 1's output) and after stage 2,
    as the whole model would; cut after stage 2, the default reaches into the prefix (refused,
    the test above)."""
    cfg = _prefix_config(tmp_path, algorithm__name="mixstyle")
    sim = run_sim(cfg.model_copy(update={"rounds": 1}), tmp_path / "run")
    after = [n for n, m in sim.model.named_modules() if m._forward_hooks]
    before = [n for n, m in sim.model.named_modules() if m._forward_pre_hooks]
    assert (before, after) == (["featurizer"], ["featurizer.1"])


def test_mixstyle_at_the_cut_mixes_the_tails_input_as_the_whole_model_would() -> None:
    """Catches MixStyle at a frozen prefix's last stage (``blocks: [k]`` with ``frozen_prefix:
    k``) refused, hooked after a later stage or left out of the tail: with the same weights and
    draws, tail(prefix(x)) in training equals the whole model with MixStyle after stage k, and
    differs from the model without it. GroupNorm: no batch statistics for the frozen prefix's
    eval mode to change."""
    from feddomain.algorithms.mixstyle import MixStyleHparams, insert_mixstyle

    hp = MixStyleHparams(p=1.0, alpha=0.3, blocks=(1,))
    torch.manual_seed(0)
    plain = build_model("small_cnn", 4, resolution=32, norm="group")
    prefix, tail = split_at(copy.deepcopy(plain), 1)
    whole = insert_mixstyle(copy.deepcopy(plain), hp)
    tail = insert_mixstyle(tail, hp)
    x = torch.randn(6, 3, 32, 32)
    outputs = []
    for model, inputs in ((whole, x), (tail, prefix(x)), (plain, x)):
        torch.manual_seed(1)
        outputs.append(model.train()(inputs))
    mixed_whole, mixed_tail, unmixed = outputs
    torch.testing.assert_close(mixed_tail, mixed_whole, **F32_TOL)
    assert (mixed_whole - unmixed).abs().max() > 1e-2


def test_lite0_bn_momentum_option_sets_every_batchnorm() -> None:
    """Catches a momentum option that misses layers (Lite0 keeps 0.01 otherwise)."""
    default = build_model("efficientnet_lite0", 3, resolution=32, pretrained=False)
    tuned = build_model("efficientnet_lite0", 3, resolution=32, pretrained=False, bn_momentum=0.1)
    bns = lambda m: [x for x in m.modules() if isinstance(x, torch.nn.BatchNorm2d)]  # noqa: E731
    assert all(b.momentum == pytest.approx(0.01) for b in bns(default))
    assert len(bns(tuned)) == len(bns(default)) > 40
    assert {b.momentum for b in bns(tuned)} == {0.1}
    with pytest.raises(ConfigError, match="bn_momentum"):
        validate_config({"model": {"name": "efficientnet_lite0", "options": {"bn_momentum": 2}}})


def _style_prefix_config(tmp_path: Path, method: str, **overrides: object):
    """small_cnn with GroupNorm (no running statistics to differ by the number of forward
    passes), cut after its first block, on the tiny 32 px domains; no weight decay."""
    return _prefix_config(
        tmp_path, algorithm__name=method, model__options={"norm": "group"},
        train__momentum=0.9, **overrides,
    )  # fmt: skip


def test_style_phase_behind_a_prefix_reads_the_pixels_not_the_maps(tmp_path) -> None:
    """Catches the style phase encoding the cached prefix maps (or pixels normalised another
    way) instead of the client's images: FISC's interpolation style with a frozen prefix is the
    one the same run computes on pixels (the style phase does not depend on the model)."""
    styles = {}
    for prefix in (1, None):
        cfg = _style_prefix_config(tmp_path, "fisc", rounds=1, model__frozen_prefix=prefix)
        styles[prefix] = run_sim(cfg, tmp_path / f"fisc-{prefix}").server.styles
    assert styles[1].keys() == styles[None].keys() == {0, 1, 2}
    for cid, style in styles[1].items():
        for name, value in style.items():
            torch.testing.assert_close(value, styles[None][cid][name], **F32_TOL)


def test_ccst_at_alpha_0_behind_a_cached_prefix_is_fedavg_at_twice_the_lr(tmp_path) -> None:
    """Catches styled maps that are not those of the same images in the same order (a batch
    pairs image i's maps with another image's styled maps), a styled view fed to the model
    stacked, or the styled term dropped: at alpha 0 a styled image is the image itself (the DCT
    backend inverts exactly), so CCST's loss CE(x) + CE(x_styled) is 2 CE(x) and its SGD
    trajectory is FedAvg's at twice the learning rate, up to float32 error."""
    ccst = run_sim(
        _style_prefix_config(tmp_path, "ccst", algorithm__alpha=0.0), tmp_path / "ccst"
    )
    fedavg = run_sim(_style_prefix_config(tmp_path, "fedavg", train__lr=0.02), tmp_path / "avg")
    a, b = ccst.model.state_dict(), fedavg.model.state_dict()
    start = fedavg._init_model().state_dict()
    assert any(not torch.allclose(b[k], start[k]) for k in b)  # it trained
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)


def test_each_style_is_rendered_and_cached_once_per_client(tmp_path) -> None:
    """Catches styled maps recomputed every round or shared across clients whose images
    differ, and a style that does not change them: FISC's one interpolation style gives one
    cache file per client beside the plain maps', the files are read (not rewritten) by a
    second run, and at alpha 0.5 the styled maps differ from the plain ones."""
    cfg = _style_prefix_config(tmp_path, "fisc", algorithm__alpha=0.5)
    sim = run_sim(cfg, tmp_path / "first")
    files = _cache_files(tmp_path)
    assert len(files) == 1 + 3  # all images' plain maps, then each client's styled maps
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache" / "features").iterdir()}
    run_sim(cfg, tmp_path / "second")
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    client = sim.data.train[0]
    style = sim.server.styles[0]
    styled = client.pixels.variant_maps(
        sim.client.variant(style["style_mean"], style["style_std"])
    )
    assert styled.shape == client.inputs.shape
    assert (styled - client.inputs).abs().mean() > 1e-2
