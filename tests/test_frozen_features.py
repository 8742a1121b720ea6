"""Frozen-backbone features: equal to a direct eval-mode forward pass, computed once and then
read from an atomically written cache, recomputed whenever anything they depend on changes."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from feddomain.errors import ConfigError, DataError
from feddomain.models import build_model, input_normalization
from feddomain.models.frozen import FrozenFeatures, head_model

MEAN, STD = (0.5, 0.4, 0.3), (0.25, 0.2, 0.5)


def _images(n: int = 10, size: int = 32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)


def _normalise(images: torch.Tensor) -> torch.Tensor:
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    return (images.float() / 255 - mean) / std


class CountingForward:
    """Counts featurizer calls, to tell a cache hit from a recomputation."""

    def __init__(self, model: nn.Module) -> None:
        self.calls = 0
        model.featurizer.register_forward_hook(self._count)

    def _count(self, *_args) -> None:
        self.calls += 1


@pytest.fixture
def lenet() -> nn.Module:
    torch.manual_seed(0)
    return build_model("lenet5", 7)


def test_features_equal_a_direct_eval_forward(lenet, tmp_path) -> None:
    images = _images()
    features = FrozenFeatures.compute(
        lenet, images, batch_size=len(images), mean=MEAN, std=STD, cache_dir=tmp_path, key="d"
    )
    lenet.eval()
    with torch.no_grad():
        direct = lenet.featurizer(_normalise(images))
    assert features.dtype == torch.float32 and features.shape == (10, 84)
    assert torch.equal(features, direct)
    cached = FrozenFeatures.compute(
        lenet, images, batch_size=len(images), mean=MEAN, std=STD, cache_dir=tmp_path, key="d"
    )
    assert torch.equal(cached, direct)


def test_batching_covers_every_image_once(lenet) -> None:
    images = _images(n=10)
    batched = FrozenFeatures.compute(lenet, images, batch_size=4, mean=MEAN, std=STD)
    whole = FrozenFeatures.compute(lenet, images, batch_size=10, mean=MEAN, std=STD)
    assert batched.shape == (10, 84)
    # Batches of 4 and of 10 may run different kernel blockings, so the dot products (≤ 400
    # terms, four layers) round differently: float32 error ≲ sqrt(400)·eps32 ≈ 1e-6 per layer
    # relative to features that are tanh outputs (here |f| ≤ 0.18; measured 4.5e-8, other CPUs
    # round in other orders). 1e-5 covers that; a skipped, repeated or misplaced image changes
    # its features by ≥ 6e-2 (the closest pair of these images).
    assert torch.allclose(batched, whole, rtol=0, atol=1e-5)


def test_normalisation_and_resize_by_hand() -> None:
    # A parameter-free "backbone" exposes the preprocessing: features are the normalised pixels.
    flatten = nn.Flatten()
    images = torch.full((2, 3, 8, 8), 255, dtype=torch.uint8)
    images[1] = 51  # 51 / 255 = 0.2
    features = FrozenFeatures.compute(flatten, images, batch_size=2, mean=MEAN, std=STD)
    assert features.shape == (2, 3 * 8 * 8)
    per_channel = features.view(2, 3, 64)
    expected_white = torch.tensor([(1 - 0.5) / 0.25, (1 - 0.4) / 0.2, (1 - 0.3) / 0.5])
    expected_grey = torch.tensor([(0.2 - 0.5) / 0.25, (0.2 - 0.4) / 0.2, (0.2 - 0.3) / 0.5])
    assert torch.allclose(per_channel[0], expected_white[:, None].expand(3, 64), atol=1e-6)
    assert torch.allclose(per_channel[1], expected_grey[:, None].expand(3, 64), atol=1e-6)

    resized = FrozenFeatures.compute(
        flatten, images, batch_size=2, mean=MEAN, std=STD, resolution=4
    )
    assert resized.shape == (2, 3 * 4 * 4)  # a constant image stays constant when resized
    assert torch.allclose(
        resized.view(2, 3, 16)[1], expected_grey[:, None].expand(3, 16), atol=1e-5
    )


def test_second_compute_hits_the_cache_and_changes_recompute(tmp_path) -> None:
    torch.manual_seed(0)
    model = build_model("small_cnn", 7, norm="none", widths=(8, 16))  # any input size works
    counter = CountingForward(model)
    images = _images(n=6)

    def compute(**kw) -> torch.Tensor:
        args = {"batch_size": 4, "mean": MEAN, "std": STD, "cache_dir": tmp_path, "key": "a"}
        return FrozenFeatures.compute(model, images, **(args | kw))

    first = compute()
    assert counter.calls == 2  # ceil(6 / 4) batches
    assert len(list(tmp_path.glob("features-*.pt"))) == 1
    again = compute()
    assert counter.calls == 2
    assert torch.equal(again, first)
    compute(resolution=32)  # the stored resolution: the same features, the same entry
    assert counter.calls == 2

    compute(key="b")
    assert counter.calls == 4
    compute(resolution=24)
    assert counter.calls == 6
    compute(mean=(0.0, 0.0, 0.0))
    assert counter.calls == 8
    with torch.no_grad():
        model.featurizer[0][0].bias.add_(1.0)  # new weights, same key
    changed = compute()
    assert counter.calls == 10
    assert not torch.equal(changed, first)
    assert len(list(tmp_path.glob("features-*.pt"))) == 5
    assert not list(tmp_path.glob(".*.tmp"))


def test_without_a_key_the_image_bytes_key_the_cache(lenet, tmp_path) -> None:
    counter = CountingForward(lenet)
    kw = {"batch_size": 8, "mean": MEAN, "std": STD, "cache_dir": tmp_path}
    FrozenFeatures.compute(lenet, _images(seed=0), **kw)
    FrozenFeatures.compute(lenet, _images(seed=0), **kw)
    assert counter.calls == 2
    FrozenFeatures.compute(lenet, _images(seed=1), **kw)
    assert counter.calls == 4


def test_train_flags_are_restored_per_module(tmp_path) -> None:
    torch.manual_seed(0)
    model = build_model("small_cnn", 7, freeze_bn_stats=True).train()
    bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    running = bn.running_mean.clone()
    assert model.featurizer.training and not bn.training
    features = FrozenFeatures.compute(model, _images(), batch_size=5, mean=MEAN, std=STD)
    assert model.featurizer.training and not bn.training
    assert torch.equal(bn.running_mean, running)  # eval mode: statistics untouched
    model.eval()
    with torch.no_grad():
        direct = model.featurizer(_normalise(_images()))
    # batches of 5 vs one of 10: float32 rounding that depends on the CPU's kernel blocking
    # (≲ 1e-6 relative, see test_batching_covers_every_image_once; |f| ≤ 0.91 here), far below
    # a real difference: batch-statistics BatchNorm would change these features by up to 1.4
    assert torch.allclose(features, direct, rtol=1e-5, atol=1e-5)


def test_failed_write_leaves_no_partial_file(lenet, tmp_path, monkeypatch) -> None:
    def broken_save(_obj, f) -> None:
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        FrozenFeatures.compute(
            lenet, _images(), batch_size=10, mean=MEAN, std=STD, cache_dir=tmp_path
        )
    assert list(tmp_path.iterdir()) == []


def test_unreadable_cache_file_is_named(lenet, tmp_path) -> None:
    kw = {"batch_size": 10, "mean": MEAN, "std": STD, "cache_dir": tmp_path, "key": "k"}
    FrozenFeatures.compute(lenet, _images(), **kw)
    (path,) = tmp_path.glob("features-*.pt")
    path.write_bytes(b"garbage")
    with pytest.raises(DataError, match=f"feature cache {re.escape(str(path))} is unreadable"):
        FrozenFeatures.compute(lenet, _images(), **kw)


def test_bad_inputs_are_rejected(lenet) -> None:
    with pytest.raises(DataError, match=r"uint8 \[N, 3, H, W\], got torch.float32"):
        FrozenFeatures.compute(lenet, torch.zeros(2, 3, 32, 32), batch_size=2, mean=MEAN, std=STD)
    with pytest.raises(ConfigError, match="batch_size=0"):
        FrozenFeatures.compute(lenet, _images(), batch_size=0, mean=MEAN, std=STD)
    with pytest.raises(ConfigError, match="3 values each"):
        FrozenFeatures.compute(lenet, _images(), batch_size=2, mean=(0.5, 0.5), std=STD)


def test_cached_features_train_a_head(lenet, tmp_path) -> None:
    features = FrozenFeatures.compute(
        lenet, _images(), batch_size=4, mean=MEAN, std=STD, cache_dir=tmp_path, key="t"
    )
    features = FrozenFeatures.compute(
        lenet, _images(), batch_size=4, mean=MEAN, std=STD, cache_dir=tmp_path, key="t"
    )
    head = head_model(84, 7)
    loss = nn.functional.cross_entropy(head(features), torch.arange(10) % 7)
    loss.backward()
    assert head.classifier.weight.grad is not None
    assert not features.requires_grad


def test_head_model_shapes() -> None:
    linear = head_model(1280, 7)
    assert isinstance(linear.featurizer, nn.Identity) and linear.n_features == 1280
    assert sum(p.numel() for p in linear.parameters()) == 1280 * 7 + 7
    mlp = head_model(1280, 7, hidden=64)
    assert mlp.n_features == 64
    assert sum(p.numel() for p in mlp.parameters()) == 1280 * 64 + 64 + 64 * 7 + 7
    assert mlp(torch.randn(5, 1280)).shape == (5, 7)
    with pytest.raises(ConfigError, match="hidden=0"):
        head_model(1280, 7, hidden=0)


# --- profile pacs-effnet-frozen on real photos ---------------------------------------------------

IMAGENET_ELEPHANTS = {101, 385, 386}  # tusker, Indian elephant, African elephant
IMAGENET_GUITARS = {402, 546}  # acoustic guitar, electric guitar


def _pacs_photos(root: Path, cls: str, n: int) -> torch.Tensor:
    files = sorted((root / "PACS" / "photo" / cls).iterdir())[:n]
    arrays = [np.array(Image.open(f).convert("RGB")) for f in files]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def test_efficientnet_frozen_features_recognise_pacs_photos(
    shared_data, tmp_path, efficientnet_extra
) -> None:
    from feddomain.models.efficientnet import packaged_weights_path

    images = torch.cat([_pacs_photos(shared_data, c, 16) for c in ("elephant", "guitar")])
    model = build_model("efficientnet_lite0", 7, resolution=128)
    mean, std = input_normalization("efficientnet_lite0")
    features = FrozenFeatures.compute(
        model, images, batch_size=8, mean=mean, std=std, cache_dir=tmp_path, key="pacs-photo"
    )
    assert features.shape == (32, 1280)
    # The packaged 1000-way ImageNet layer on top of our features must name what is pictured.
    packaged = torch.load(packaged_weights_path(), map_location="cpu", weights_only=True)
    logits = features @ packaged["_fc.weight"].T + packaged["_fc.bias"]
    top5 = logits.topk(5, dim=1).indices.tolist()
    elephants = sum(bool(IMAGENET_ELEPHANTS & set(t)) for t in top5[:16])
    guitars = sum(bool(IMAGENET_GUITARS & set(t)) for t in top5[16:])
    # Random weights hit none of these 5 classes in 1000; the real ones hit 14 of 16 (measured).
    assert elephants >= 12 and guitars >= 12, (elephants, guitars)
