"""fedfda.md §8 check 7 on embedded data: a CE-only BatchNorm model evaluated with instance
statistics only (TBN) loses much of its accuracy; a model trained with FedFD's loss loses far
less, because it was trained on mixes that include u ≈ 1.

Setting (about 20 s on one CPU thread): the embedded four-domain digits at 16 px, 3,000 training
images pooled (one client: FedFD's loss does not need a federation to show this), small_cnn
(16, 32, 64), Adam 3e-3, batch 32, 3 epochs; statistics re-estimated with the final weights
(PreciseBN) and used as the global statistics, as a one-client server would compute them;
scored on 1,000 held-out images. FedFD uses the per-dimension feature loss λ_F = 1/64 (the
fallback of CHOICE F3): with λ_F = 1 the feature loss is 10-20x the CE at initialisation on this
from-scratch model and training stalls near chance (measured: 0.16-0.19 accuracy).

Measured (seeds 0 and 1): CE 0.80/0.82 with global statistics -> 0.49/0.53 with TBN; FedFD
0.79/0.80 -> 0.74/0.75. The poster's CE-only model falls to 13% on PACS; here the drop is about
30 points, not to chance, so the thresholds below are relative and leave margins of at least
0.08 on both seeds.
"""

from __future__ import annotations

import pytest
import torch

from feddomain.algorithms.fedfd import FedFDHparams, fedfd_loss
from feddomain.data.embedded import load_embedded_digits
from feddomain.federation.data import ClientData
from feddomain.federation.training import (
    LossFn,
    cross_entropy_loss,
    recalibrate_batchnorm,
    train_epochs,
)
from feddomain.models import build_model
from feddomain.models.fedfd_bn import BNMode, convert_batchnorm, fedfd_layers, set_bn_mode

WIDTHS = (16, 32, 64)


def _data(seed: int) -> tuple[ClientData, tuple[torch.Tensor, torch.Tensor]]:
    digits = load_embedded_digits(resolution=16)
    x, y = digits.images.float() / 255, digits.labels
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    train, test = order[:3000], order[4000:]
    return ClientData(x[train], y[train]), (x[test], y[test])


def _trained(loss: LossFn, train: ClientData, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = convert_batchnorm(build_model("small_cnn", 10, resolution=16, widths=WIDTHS))
    train_epochs(
        model,
        train,
        torch.optim.Adam(model.parameters(), lr=3e-3),
        epochs=3,
        batch_size=32,
        generator=torch.Generator().manual_seed(1),
        loss_fn=loss,
    )
    recalibrate_batchnorm(model, train, 256, torch.Generator().manual_seed(2))
    with torch.no_grad():
        for _, layer in fedfd_layers(model):
            layer.global_mean.copy_(layer.running_mean)
            layer.global_var.copy_(layer.running_var)
    return model.eval()


def _accuracy(model: torch.nn.Module, test: tuple[torch.Tensor, torch.Tensor], mode: str) -> float:
    set_bn_mode(model, BNMode(mode), training=False)
    with torch.no_grad():
        return float((model(test[0]).argmax(1) == test[1]).float().mean())


@pytest.mark.parametrize("seed", [0])
def test_tbn_collapses_a_ce_only_model_far_more_than_a_fedfd_model(seed):
    """Catches a diversified path that does not expose the model to instance statistics (e.g.
    u stuck at 0, or the mix using the global statistics on both sides), and TBN evaluation
    that does not use instance statistics: then FedFD's model would fall under TBN like the
    CE-only one, or neither would fall (§8 check 7)."""
    train, test = _data(seed)
    ce = _trained(cross_entropy_loss, train, seed)
    fd = _trained(fedfd_loss(FedFDHparams(lambda_feature=1 / WIDTHS[-1])), train, seed)
    ce_global, ce_tbn = _accuracy(ce, test, "global"), _accuracy(ce, test, "instance")
    fd_global, fd_tbn = _accuracy(fd, test, "global"), _accuracy(fd, test, "instance")
    assert ce_global > 0.6 and fd_global > 0.6  # both models learned the task
    assert ce_global - ce_tbn > 0.2  # the CE-only model loses much of its accuracy
    assert fd_global - fd_tbn < 0.1  # FedFD's barely moves
    assert fd_tbn > ce_tbn + 0.15
