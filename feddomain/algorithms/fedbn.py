"""FedBN (Li, Jiang, Zhang, Kamp & Dou, "FedBN: Federated Learning on Non-IID Features via Local
Batch Normalization", ICLR 2021).

Rule: every BatchNorm layer stays local on each client — its affine weight and bias and its
running statistics (``running_mean``, ``running_var``, ``num_batches_tracked``) — and every other
array is FedAvg'd (sample-weighted). The layers are found by module type
(``federation.layout.batchnorm_arrays``), so any model with BatchNorm works (``small_cnn``,
ResNet, EfficientNet-Lite0); a model without any is refused when the config loads, naming
``model.name``. Each client's id accuracy uses its own BatchNorm layers.

CHOICE (fedfda.md §6, "average them at test"): FedBN has no model for a domain no client holds.
The unseen-domain model (``eval_arrays(None)``; the run-level ood numbers score it) is the shared
arrays with the **sample-weighted** mean of the clients' BatchNorm layers — weighted like
FedAvg, over the clients of the latest aggregated round. For that mean the clients upload their
BatchNorm layers (per-channel affine parameters and statistics, no per-sample data) with the
shared arrays; the server uses them for nothing else and never broadcasts them (a client that
has not trained yet starts from the initial model's BatchNorm values). Each client's own model
on the target domains stays a diagnostic (``per_client.ood_acc``, ``client_ood_acc``).
"""

from __future__ import annotations

from torch import nn

from feddomain.algorithms.base import Hparams, MethodSpec, model_requirement
from feddomain.algorithms.layout import LayoutClient, LayoutServer, LayoutStation
from feddomain.algorithms.registry import register
from feddomain.federation.layout import BN_MODELS, StateLayout, batchnorm_arrays


def fedbn_layout(model: nn.Module, hp: Hparams) -> StateLayout:
    """Every BatchNorm layer's affine parameters and running statistics are local."""
    return StateLayout(local=batchnorm_arrays(model))


def needs_batchnorm(model: nn.Module, hp: Hparams) -> str | None:
    if batchnorm_arrays(model):
        return None
    return (
        "keeps every BatchNorm layer local, and this model has none (models with BatchNorm: "
        f"{BN_MODELS})"
    )


class FedBNServer(LayoutServer):
    layout = staticmethod(fedbn_layout)


class FedBNClient(LayoutClient):
    layout = staticmethod(fedbn_layout)


class FedBNStation(LayoutStation):
    layout = staticmethod(fedbn_layout)


register(
    MethodSpec(
        "fedbn",
        FedBNServer,
        FedBNClient,
        Hparams,
        station=FedBNStation,
        description="FedBN: BatchNorm layers (affine + statistics) stay local, the rest is "
        "FedAvg'd (Li et al., ICLR 2021)",
        check_config=model_requirement("fedbn", needs_batchnorm),
        image_only="keeps BatchNorm layers local, which text models do not have",
    )
)
