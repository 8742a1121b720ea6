"""hFedF's Inception-style client CNN (hfedf.md §3.2, Table 9), layer for layer.

Table 9's activation placement is kept literally: ReLU after each max-pool (not after the convs),
no nonlinearity between the 1x1 and 3x3 convs, none after the 2592->256 linear unless
``fc_act="relu"``. There is no normalisation layer, so hypernetwork-generated parameters need no
running statistics.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn

from feddomain.errors import ConfigError
from feddomain.models.base import FeatureClassifier

FC_ACTIVATIONS = ("none", "relu")
N_FEATURES = 256


class Inception(nn.Module):
    """Three conv branches (1x1 -> 32, 3x3 -> 64, 5x5 -> 16) plus the input max-pooled in place.

    The pass-through branch has no parameters: it is what makes the widths 64 -> 176 -> 288 add up
    (in + 32 + 64 + 16), the reading hfedf.md reverse-engineers from the paper's channel counts.
    """

    def __init__(self, in_channels: int) -> None:
        super().__init__()
        self.branch1 = nn.Conv2d(in_channels, 32, kernel_size=1)
        self.branch3 = nn.Conv2d(in_channels, 64, kernel_size=3, padding=1)
        self.branch5 = nn.Conv2d(in_channels, 16, kernel_size=5, padding=2)
        self.pool = nn.MaxPool2d(kernel_size=3, stride=1, padding=1)
        self.out_channels = in_channels + 32 + 64 + 16

    def forward(self, x: Tensor) -> Tensor:
        branches = [self.branch1(x), self.branch3(x), self.branch5(x), self.pool(x)]
        return torch.relu(torch.cat(branches, dim=1))


def _featurizer(fc_act: str) -> nn.Sequential:
    inception1 = Inception(64)
    inception2 = Inception(inception1.out_channels)
    layers: list[tuple[str, nn.Module]] = [
        ("conv1", nn.Conv2d(3, 32, kernel_size=3, padding=1)),
        ("pool1", nn.MaxPool2d(2)),
        ("relu1", nn.ReLU()),
        ("conv2", nn.Conv2d(32, 32, kernel_size=1)),
        ("conv3", nn.Conv2d(32, 64, kernel_size=3, padding=1)),
        ("pool2", nn.MaxPool2d(2)),
        ("relu2", nn.ReLU()),
        ("inception1", inception1),
        ("inception2", inception2),
        ("avgpool", nn.AdaptiveAvgPool2d(3)),
        ("flatten", nn.Flatten()),
        ("dropout", nn.Dropout(0.2)),
        ("fc", nn.Linear(inception2.out_channels * 9, N_FEATURES)),
    ]
    if fc_act == "relu":
        layers.append(("fc_act", nn.ReLU()))
    return nn.Sequential(OrderedDict(layers))


def hfedf_cnn(num_classes: int, *, resolution: int = 32, fc_act: str = "none") -> FeatureClassifier:
    """The client model every method uses in hFedF's experiments (32x32 inputs in the paper).

    The adaptive 3x3 pool makes any resolution >= 4 work; the parameter count does not change.
    """
    if fc_act not in FC_ACTIVATIONS:
        raise ConfigError(f"hfedf_cnn: fc_act={fc_act!r} is not one of {list(FC_ACTIVATIONS)}")
    if resolution < 4:
        raise ConfigError(f"hfedf_cnn: resolution={resolution} is below 4 (two 2x2 max-pools)")
    return FeatureClassifier(_featurizer(fc_act), nn.Linear(N_FEATURES, num_classes), N_FEATURES)
