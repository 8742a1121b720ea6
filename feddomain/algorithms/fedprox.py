"""FedProx (Li et al., MLSys 2020): FedAvg plus the proximal term (mu/2)·||w - w_global||²."""

from __future__ import annotations

from collections.abc import Callable

import torch
from pydantic import Field

from feddomain.algorithms.base import ClientContext, MethodSpec
from feddomain.algorithms.fedavg import (
    FedAvgClient,
    FedAvgHparams,
    FedAvgServer,
    global_parameters,
)
from feddomain.algorithms.registry import register
from feddomain.federation.batched import FunctionalRegularizer
from feddomain.federation.messages import Message


class FedProxHparams(FedAvgHparams):
    """FedProx's hyper-parameters: FedAvg's server step and the proximal weight."""

    mu: float = Field(0.01, ge=0.0)
    """μ: weight of the proximal term (μ/2)·‖w − w_global‖² added to every local batch's loss;
    0 is FedAvg."""


class FedProxClient(FedAvgClient):
    def regularizer(self, msg: Message, ctx: ClientContext) -> Callable[[], torch.Tensor]:
        pairs = global_parameters(msg, ctx)
        mu = self.hp.mu

        def proximal() -> torch.Tensor:
            return 0.5 * mu * sum((p - g).pow(2).sum() for p, g in pairs)

        return proximal

    def functional_regularizer(self) -> FunctionalRegularizer:
        """The proximal term of (one client's parameters, its received global arrays)."""
        mu = self.hp.mu

        def proximal(params: dict[str, torch.Tensor], anchor: dict[str, torch.Tensor]):
            return 0.5 * mu * sum((p - anchor[k]).pow(2).sum() for k, p in params.items())

        return proximal


register(
    MethodSpec(
        "fedprox",
        FedAvgServer,
        FedProxClient,
        FedProxHparams,
        description="FedProx: FedAvg + proximal term mu/2 ||w - w_g||^2 (Li et al., MLSys 2020)",
        batchable=True,
    )
)
