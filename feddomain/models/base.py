"""The one shape every model has: ``featurizer`` (images -> [B, F]) then ``classifier``."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)
MIN_INSTANCE_VALUES = 16  # per channel; fewer and instance statistics carry class information


def warn_small_instance_map(owner: object, where: str, height: int, width: int) -> None:
    """Warn once per ``owner`` (a layer, a style client) that it takes per-sample, per-channel
    statistics over fewer than 16 values: on 2x2 maps (FedFD at 64 px) mixing such statistics
    destroyed class information even on source data (issue 25's linear probes)."""
    if height * width >= MIN_INSTANCE_VALUES or getattr(owner, "_small_map_warned", False):
        return
    owner._small_map_warned = True
    log.warning(
        "%s takes instance statistics over a %dx%d feature map (%d values per channel, fewer "
        "than %d): they are noisy and carry the content; give the model larger inputs "
        "(dataset.resolution) or act on an earlier stage",
        where,
        height,
        width,
        height * width,
        MIN_INSTANCE_VALUES,
    )


class FeatureClassifier(nn.Module):
    """``forward(x) = classifier(featurizer(x))``, DomainBed style.

    Methods that regularise representations (FedSR, FISC, FedIIR) call ``featurizer`` and
    ``classifier`` separately; frozen-backbone training caches ``featurizer`` outputs. Both are
    plain child modules, so ``named_parameters()`` has a fixed order and the model works with
    ``torch.func.functional_call``.

    ``freeze_bn_stats=True`` keeps every BatchNorm layer in eval mode even under ``train()``: the
    running statistics of a pretrained backbone stay as loaded while its affine parameters train
    (the convention HFedATM's code follows for ResNet-18).

    ``stages`` names the modules (as in ``named_modules()``) whose outputs end the network's
    successive convolutional stages, shallow to deep (small_cnn's conv blocks, LeNet-5's two
    pooling layers, ResNet's layer1-4); style methods act after them (MixStyle). Empty for a
    model that declares none.

    ``arch`` is the registry name the model was built under (``build_model`` sets it; empty for
    a model built otherwise), so that tables keyed by architecture (HFedATM's permutation specs)
    find it after model hooks.

    ``frozen_stages`` is k for the trainable tail of a model cut after its stage k
    (``model.frozen_prefix``): its ``stages`` are the stages k+1.. of the whole model.
    """

    arch: str = ""
    frozen_stages = 0  # a frozen prefix's tail (models/prefix.py): the stages cut off before it

    def __init__(
        self,
        featurizer: nn.Module,
        classifier: nn.Module,
        n_features: int,
        *,
        freeze_bn_stats: bool = False,
        stages: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.featurizer = featurizer
        self.classifier = classifier
        self.n_features = n_features
        self.freeze_bn_stats = freeze_bn_stats
        self.stages = tuple(stages)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.featurizer(x))

    def train(self, mode: bool = True) -> FeatureClassifier:
        super().train(mode)
        if mode and self.freeze_bn_stats:
            for module in self.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.eval()
        return self


def with_memory_format(model: nn.Module, choice: str, device: torch.device) -> nn.Module:
    """``model`` with its 4-D weights in the layout ``choice`` names (``model.memory_format``;
    ``auto``: channels_last on the CPU when it has a 2-D convolution). A convolution whose
    weight is channels_last outputs channels_last, so the activations follow without touching
    the inputs; loading arrays copies into the weights and keeps their layout."""
    if choice == "auto":
        convolutional = any(isinstance(m, nn.Conv2d) for m in model.modules())
        choice = "channels_last" if device.type == "cpu" and convolutional else "contiguous"
    if choice == "channels_last":
        return model.to(memory_format=torch.channels_last)
    return model
