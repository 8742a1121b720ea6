"""Frozen prefix: a pretrained backbone cut after one of its declared stages.

``model.frozen_prefix: k`` freezes stages 1..k (and the stem before them) and trains the rest —
BatchNorm layers included — and the head. The prefix never changes, so its output for an image
never changes either: ``feddomain/data/federated.py`` computes it once per image and caches it
with the frozen-feature machinery (``models/frozen.py``: keyed, memory-mapped, atomic), and the
clients train :func:`split_at`'s tail on those cached maps. ``model.prefix_cache: false``
recomputes the prefix on every batch instead (the same run up to float error; for checks and
timing).

Each architecture has its own cut (its forward is not a plain chain of children): the
``Sequential`` featurizers (small_cnn), torchvision's ResNets and EfficientNet-Lite0.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from feddomain.errors import ConfigError
from feddomain.models.base import FeatureClassifier

Split = tuple[nn.Module, nn.Module, list[str]]  # prefix, tail featurizer, tail stage names


def _sequential(featurizer: nn.Module, stage: int, names: list[str]) -> Split:
    """small_cnn: ``featurizer.<i>`` per conv block; the pooling and flatten follow the last.
    A slice of a ``Sequential`` keeps its children's names, so the later stages keep theirs."""
    end = int(names[stage - 1].rsplit(".", 1)[1])
    return featurizer[: end + 1], featurizer[end + 1 :], names[stage:]


def _resnet(net: nn.Module, stage: int, names: list[str]) -> Split:
    """torchvision ResNet: stem + layer1..k frozen; layer k+1..4, pooling, flatten trained."""
    layers = [getattr(net, f"layer{i}") for i in range(1, 5)]
    prefix = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, *layers[:stage])
    tail = nn.Sequential(*layers[stage:], net.avgpool, nn.Flatten())
    return prefix, tail, [f"featurizer.{i}" for i in range(len(names) - stage)]


class _LitePrefix(nn.Module):
    """EfficientNet-Lite's stem and its first ``end`` blocks (its ``extract_features`` cut)."""

    def __init__(self, net: nn.Module, end: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(net._conv_stem, net._bn0, net._swish)
        self.blocks = nn.ModuleList(net._blocks[:end])
        self.rate = net._global_params.drop_connect_rate
        self.total = len(net._blocks)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for idx, block in enumerate(self.blocks):
            x = block(x, drop_connect_rate=self.rate * idx / self.total if self.rate else None)
        return x


class _LiteTail(nn.Module):
    """EfficientNet-Lite's blocks from ``start`` on, its head conv, pooling and dropout, with
    each block's drop-connect rate of the whole network (scaled by its index there)."""

    def __init__(self, net: nn.Module, start: int) -> None:
        super().__init__()
        self.start = start
        self.total = len(net._blocks)
        self.rate = net._global_params.drop_connect_rate
        self.blocks = nn.ModuleList(net._blocks[start:])
        self.head = nn.Sequential(net._conv_head, net._bn1, net._swish)
        self.pool = net._avg_pooling
        self.dropout = net._dropout

    def forward(self, x: Tensor) -> Tensor:
        for j, block in enumerate(self.blocks):
            idx = self.start + j
            x = block(x, drop_connect_rate=self.rate * idx / self.total if self.rate else None)
        return self.dropout(self.pool(self.head(x)).flatten(1))


def _efficientnet(net: nn.Module, stage: int, names: list[str]) -> Split:
    end = int(names[stage - 1].rsplit(".", 1)[1]) + 1  # blocks [0, end) are frozen
    later = [f"featurizer.blocks.{int(n.rsplit('.', 1)[1]) - end}" for n in names[stage:]]
    return _LitePrefix(net, end), _LiteTail(net, end), later


_SPLITTERS: dict[str, Callable[[nn.Module, int, list[str]], Split]] = {
    "small_cnn": _sequential,
    "resnet18": _resnet,
    "resnet50": _resnet,
    "efficientnet_lite0": _efficientnet,
}


def prefix_problem(arch: str, n_stages: int, stage: int) -> str | None:
    """Why ``model.frozen_prefix = stage`` cannot cut model ``arch`` with ``n_stages`` stages."""
    if arch not in _SPLITTERS:
        return f"model {arch!r} cannot be cut into a frozen prefix; models that can: " + ", ".join(
            sorted(_SPLITTERS)
        )
    if not 1 <= stage < n_stages:
        return (
            f"model {arch!r} has {n_stages} stages and the last must train: "
            f"model.frozen_prefix must be 1..{n_stages - 1}, not {stage}"
        )
    return None


def split_at(model: FeatureClassifier, stage: int) -> tuple[nn.Module, FeatureClassifier]:
    """(frozen prefix in eval mode without gradients, trainable tail with ``model``'s classifier)
    of ``model`` cut after its ``stage``-th declared stage (1-based, as MixStyle's ``blocks``).

    The tail keeps the stage numbering: ``frozen_stages = stage`` and ``stages`` lists the
    stages after the cut, so stage ``b`` is ``tail.stages[b - stage - 1]``.
    """
    names = list(model.stages)
    problem = prefix_problem(model.arch, len(names), stage)
    if problem:
        raise ConfigError(f"invalid configuration: 'model.frozen_prefix': {problem}")
    prefix, tail, later = _SPLITTERS[model.arch](model.featurizer, stage, names)
    prefix.eval().requires_grad_(False)
    out = FeatureClassifier(
        tail,
        model.classifier,
        model.n_features,
        freeze_bn_stats=model.freeze_bn_stats,
        stages=later,
    )
    out.frozen_stages = stage
    out.arch = f"{model.arch}/tail{stage}"
    return prefix, out
