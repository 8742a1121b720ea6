"""LeNet-5 as HFedATM specifies it (hfedatm.md §2.7): tanh activations, average pooling."""

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


def lenet5(num_classes: int, *, resolution: int = 32) -> FeatureClassifier:
    """LeNet-5; at the paper's 32 px the flatten has 16*5*5 = 400 features.

    Other resolutions keep the layer list and size the first linear layer from the computed
    flatten width (16 * side**2), so the conv filters stay comparable across resolutions.
    """
    if resolution < MIN_RESOLUTION:
        raise ConfigError(
            f"lenet5: resolution={resolution} is too small; it needs at least {MIN_RESOLUTION} px "
            "(two 5x5 convolutions and two 2x2 poolings)"
        )
    flat = 16 * _spatial_size(resolution) ** 2
    featurizer = nn.Sequential(
        OrderedDict(
            [
                ("conv1", nn.Conv2d(3, 6, kernel_size=5)),
                ("act1", nn.Tanh()),
                ("pool1", nn.AvgPool2d(2)),
                ("conv2", nn.Conv2d(6, 16, kernel_size=5)),
                ("act2", nn.Tanh()),
                ("pool2", nn.AvgPool2d(2)),
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
