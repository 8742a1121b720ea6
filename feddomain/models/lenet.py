"""LeNet-5 as HFedATM specifies it (hfedatm.md §2.7): tanh activations, average pooling.

``norm="batch"`` puts a BatchNorm after each convolution: the BatchNorm model of the CPU profile
(FedBN, SiloBN, MixStyle, FedFD act on BatchNorm layers), at LeNet-5's cost.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from feddomain.errors import ConfigError
from feddomain.models.base import FeatureClassifier

N_FEATURES = 84
MIN_RESOLUTION = 16


def _spatial_size(resolution: int) -> int:
    """Side of the last feature map: two (5x5 valid conv, 2x2 average pool) stages."""
    side = resolution
    for _ in range(2):
        side = (side - 4) // 2
    return side


NORMS = ("none", "batch")


def _conv_block(i: int, in_c: int, out_c: int, norm: str) -> list[tuple[str, nn.Module]]:
    # A conv followed by BatchNorm gets no bias: the norm's shift replaces it.
    conv = nn.Conv2d(in_c, out_c, kernel_size=5, bias=norm == "none")
    bn = [(f"bn{i}", nn.BatchNorm2d(out_c))] if norm == "batch" else []
    return [(f"conv{i}", conv), *bn, (f"act{i}", nn.Tanh()), (f"pool{i}", nn.AvgPool2d(2))]


def lenet5(num_classes: int, *, resolution: int = 32, norm: str = "none") -> FeatureClassifier:
    """LeNet-5; at the paper's 32 px the flatten has 16*5*5 = 400 features.

    Other resolutions keep the layer list and size the first linear layer from the computed
    flatten width (16 * side**2), so the conv filters stay comparable across resolutions.
    """
    if norm not in NORMS:
        raise ConfigError(f"lenet5: norm={norm!r} is not one of {list(NORMS)}")
    if resolution < MIN_RESOLUTION:
        raise ConfigError(
            f"lenet5: resolution={resolution} is too small; it needs at least {MIN_RESOLUTION} px "
            "(two 5x5 convolutions and two 2x2 poolings)"
        )
    flat = 16 * _spatial_size(resolution) ** 2
    featurizer = nn.Sequential(
        OrderedDict(
            [
                *_conv_block(1, 3, 6, norm),
                *_conv_block(2, 6, 16, norm),
                ("flatten", nn.Flatten()),
                ("fc1", nn.Linear(flat, 120)),
                ("act3", nn.Tanh()),
                ("fc2", nn.Linear(120, N_FEATURES)),
                ("act4", nn.Tanh()),
            ]
        )
    )
    stages = ("featurizer.pool1", "featurizer.pool2")  # conv-tanh-pool blocks 1 and 2
    return FeatureClassifier(
        featurizer, nn.Linear(N_FEATURES, num_classes), N_FEATURES, stages=stages
    )
