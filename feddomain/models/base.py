"""The one shape every model has: ``featurizer`` (images -> [B, F]) then ``classifier``."""

from __future__ import annotations

from torch import Tensor, nn


class FeatureClassifier(nn.Module):
    """``forward(x) = classifier(featurizer(x))``, DomainBed style.

    Methods that regularise representations (FedSR, FISC, FedIIR) call ``featurizer`` and
    ``classifier`` separately; frozen-backbone training caches ``featurizer`` outputs. Both are
    plain child modules, so ``named_parameters()`` has a fixed order and the model works with
    ``torch.func.functional_call``.

    ``freeze_bn_stats=True`` keeps every BatchNorm layer in eval mode even under ``train()``: the
    running statistics of a pretrained backbone stay as loaded while its affine parameters train
    (the convention HFedATM's code follows for ResNet-18).
    """

    def __init__(
        self,
        featurizer: nn.Module,
        classifier: nn.Module,
        n_features: int,
        *,
        freeze_bn_stats: bool = False,
    ) -> None:
        super().__init__()
        self.featurizer = featurizer
        self.classifier = classifier
        self.n_features = n_features
        self.freeze_bn_stats = freeze_bn_stats

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.featurizer(x))

    def train(self, mode: bool = True) -> FeatureClassifier:
        super().train(mode)
        if mode and self.freeze_bn_stats:
            for module in self.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.eval()
        return self
