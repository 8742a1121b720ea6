"""torchvision's VGG-11 (configuration "A", no BatchNorm) with a K-way head (hfedatm.md §2.7).

The featurizer is torchvision's ``features``, ``avgpool`` (adaptive 7x7), a flatten and the two
hidden fully connected layers (``classifier.0`` and ``classifier.3`` keep torchvision's indices,
so an ImageNet state dict loads by name); the K-way classifier replaces the 1000-way one.
``hidden`` (default 4096, torchvision's) narrows the two hidden layers — same structure, for
tests and CPU runs; pretrained weights need the default. Nothing here downloads.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from torch import nn

from feddomain.errors import ConfigError
from feddomain.models.base import FeatureClassifier
from feddomain.models.resnet import _check_compatible, read_state_dict

TORCHVISION_HIDDEN = 4096
_HEAD_PREFIX = "classifier.6."


def _hidden_layers(in_features: int, hidden: int) -> nn.Sequential:
    """torchvision's classifier without its last Linear, at width ``hidden``."""
    return nn.Sequential(
        OrderedDict(
            [
                ("0", nn.Linear(in_features, hidden)),
                ("1", nn.ReLU(inplace=True)),
                ("2", nn.Dropout()),
                ("3", nn.Linear(hidden, hidden)),
                ("4", nn.ReLU(inplace=True)),
                ("5", nn.Dropout()),
            ]
        )
    )


def vgg11(
    num_classes: int,
    *,
    resolution: int = 224,
    hidden: int = TORCHVISION_HIDDEN,
    weights_path: str | None = None,
) -> FeatureClassifier:
    """VGG-11 (``hidden`` features). Any resolution >= 32 works (five 2x2 max-pools, then the
    adaptive 7x7 pool); 224 is ImageNet's."""
    if resolution < 32:
        raise ConfigError(f"vgg11: resolution={resolution} is below 32 (five 2x2 max-pools)")
    if hidden < 1:
        raise ConfigError(f"vgg11: hidden={hidden} must be a positive int")
    from torchvision import models as tvm  # late: seconds of start-up other models skip

    net = tvm.vgg11(weights=None)
    if weights_path is not None:
        if hidden != TORCHVISION_HIDDEN:
            raise ConfigError(
                f"vgg11: weights_path needs hidden={TORCHVISION_HIDDEN}, not {hidden}"
            )
        path = Path(weights_path).expanduser()
        state = {k: v for k, v in read_state_dict(path).items() if not k.startswith(_HEAD_PREFIX)}
        net.classifier = net.classifier[:-1]
        _check_compatible(net, state, path, "vgg11")
        net.load_state_dict(state)
        hidden_layers = net.classifier
    else:
        hidden_layers = _hidden_layers(net.classifier[0].in_features, hidden)
    featurizer = nn.Sequential(
        OrderedDict(
            [
                ("features", net.features),
                ("avgpool", net.avgpool),
                ("flatten", nn.Flatten()),
                ("classifier", hidden_layers),
            ]
        )
    )
    return FeatureClassifier(featurizer, nn.Linear(hidden, num_classes), hidden)
