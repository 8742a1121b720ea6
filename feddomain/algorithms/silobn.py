"""SiloBN (Andreux, du Terrail, Beguier & Tramel, "Siloed Federated Learning for Multi-Centric
Histopathology Datasets", MICCAI DART 2020).

Rule: the BatchNorm running statistics (``running_mean``, ``running_var`` and
``num_batches_tracked``) stay local on each client; everything else, the BatchNorm affine weight
and bias included, is FedAvg'd (sample-weighted). The layers are found by module type
(``federation.layout.batchnorm_arrays``); a model without BatchNorm statistics is refused when
the config loads, naming ``model.name``. Each client's id accuracy uses its own statistics.

CHOICE: ``num_batches_tracked`` counts the batches behind the running statistics, so it stays
local with them (it only matters for BatchNorm with ``momentum=None``).

CHOICE (fedfda.md §6, "test with averaged stats"): the unseen-domain model
(``eval_arrays(None)``; the run-level ood numbers score it) is the shared arrays with the
**sample-weighted** mean of the clients' running statistics — weighted like FedAvg, over the
clients of the latest aggregated round (FedFD §3.5 forms its global statistics the same way).
For that mean the clients upload their statistics (per-channel, no per-sample data) with the
shared arrays; the server uses them for nothing else and never broadcasts them (a client that
has not trained yet starts from the initial model's statistics). Each client's own model on the
target domains stays a diagnostic (``per_client.ood_acc``, ``client_ood_acc``).
"""

from __future__ import annotations

from torch import nn

from feddomain.algorithms.base import Hparams, MethodSpec, model_requirement
from feddomain.algorithms.layout import LayoutClient, LayoutServer, LayoutStation
from feddomain.algorithms.registry import register
from feddomain.federation.layout import BN_MODELS, StateLayout, batchnorm_arrays


def silobn_layout(model: nn.Module, hp: Hparams) -> StateLayout:
    """Every BatchNorm layer's running statistics are local; its affine parameters are shared."""
    return StateLayout(local=batchnorm_arrays(model, affine=False))


def needs_batchnorm_statistics(model: nn.Module, hp: Hparams) -> str | None:
    if batchnorm_arrays(model, affine=False):
        return None
    return (
        "keeps BatchNorm running statistics local, and this model has none (models with "
        f"BatchNorm: {BN_MODELS})"
    )


class SiloBNServer(LayoutServer):
    layout = staticmethod(silobn_layout)


class SiloBNClient(LayoutClient):
    layout = staticmethod(silobn_layout)


class SiloBNStation(LayoutStation):
    layout = staticmethod(silobn_layout)


register(
    MethodSpec(
        "silobn",
        SiloBNServer,
        SiloBNClient,
        Hparams,
        station=SiloBNStation,
        description="SiloBN: BatchNorm statistics stay local, BatchNorm affine and the rest "
        "FedAvg'd (Andreux et al., MICCAI DART 2020)",
        check_config=model_requirement("silobn", needs_batchnorm_statistics),
        image_only="keeps BatchNorm statistics local, which text models do not have",
    )
)
