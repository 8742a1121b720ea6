"""torchvision ResNet-18/50 with a K-way head; ImageNet weights only from a local file.

Nothing here downloads: users who want pretrained weights save torchvision's state dict once
(``torch.save(resnet18(weights="DEFAULT").state_dict(), path)``) and pass ``weights_path``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from feddomain.errors import ConfigError
from feddomain.models.base import FeatureClassifier

if TYPE_CHECKING:
    from torchvision.models import ResNet

_HEAD_PREFIX = "fc."


def _factory(arch: str) -> Callable[..., ResNet]:
    """torchvision's builder of ``arch``, imported when a ResNet is built: torchvision costs
    seconds at start-up (it pulls in SymPy), which runs of the small models need not pay."""
    from torchvision import models as tvm

    return getattr(tvm, arch)


def read_state_dict(path: Path, what: str = "weights_path") -> dict[str, torch.Tensor]:
    """The tensors of a local weights file; a ConfigError naming ``what`` and the file if it is
    missing, unreadable or not a state dict (name -> tensor)."""
    if not path.is_file():
        raise ConfigError(f"{what}: file not found: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(f"{what}: cannot read {path} as a torch state dict: {exc}") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"{what}: {path} does not hold a state dict (name -> tensor)")
    return state


def _check_compatible(
    net: nn.Module, state: dict[str, torch.Tensor], path: Path, arch: str
) -> None:
    """Name the keys or shapes that differ, instead of torch's multi-screen RuntimeError."""
    expected = {k: v.shape for k, v in net.state_dict().items()}
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ConfigError(
            f"weights_path: {path} does not match {arch}: missing keys {missing[:5]} "
            f"({len(missing)} in all), unexpected keys {unexpected[:5]} ({len(unexpected)} in all)"
        )
    wrong = [k for k, shape in expected.items() if state[k].shape != shape]
    if wrong:
        k = wrong[0]
        raise ConfigError(
            f"weights_path: {path} does not match {arch}: {k} has shape {tuple(state[k].shape)}, "
            f"expected {tuple(expected[k])} ({len(wrong)} tensors differ)"
        )


def _fitting_state(net: nn.Module, weights_path: str, arch: str) -> dict[str, torch.Tensor]:
    """The file's state dict without the ImageNet head, checked against ``net`` (headless)."""
    path = Path(weights_path).expanduser()
    # The ImageNet 1000-way head is dropped: the K-way classifier is always freshly initialised.
    state = {k: v for k, v in read_state_dict(path).items() if not k.startswith(_HEAD_PREFIX)}
    _check_compatible(net, state, path, arch)
    return state


def check_weights_path(arch: str, weights_path: str) -> None:
    """The checks the weights file gets when the model is built, against a network on the meta
    device (no memory): for a config check, before any data is read. ConfigError if it fails."""
    with torch.device("meta"):
        net = _factory(arch)(weights=None)
    net.fc = nn.Identity()
    _fitting_state(net, weights_path, arch)


def _resnet(
    arch: str,
    num_classes: int,
    weights_path: str | None,
    freeze_bn_stats: bool,
) -> FeatureClassifier:
    net = _factory(arch)(weights=None)
    n_features = net.fc.in_features
    net.fc = nn.Identity()
    if weights_path is not None:
        net.load_state_dict(_fitting_state(net, weights_path, arch))
    classifier = nn.Linear(n_features, num_classes)
    stages = [f"featurizer.layer{i}" for i in range(1, 5)]  # residual stages res1-res4
    return FeatureClassifier(
        net, classifier, n_features, freeze_bn_stats=freeze_bn_stats, stages=stages
    )


def resnet18(
    num_classes: int,
    *,
    resolution: int = 224,
    weights_path: str | None = None,
    freeze_bn_stats: bool = False,
) -> FeatureClassifier:
    """ResNet-18 (512 features). Any resolution works (adaptive pooling); 224 is ImageNet's."""
    del resolution  # the common builder signature; the architecture does not depend on it
    return _resnet("resnet18", num_classes, weights_path, freeze_bn_stats)


def resnet50(
    num_classes: int,
    *,
    resolution: int = 224,
    weights_path: str | None = None,
    freeze_bn_stats: bool = False,
) -> FeatureClassifier:
    """ResNet-50 (2048 features). Any resolution works (adaptive pooling); 224 is ImageNet's."""
    del resolution
    return _resnet("resnet50", num_classes, weights_path, freeze_bn_stats)
