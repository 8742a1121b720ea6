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
)
from feddomain.algorithms.registry import register
from feddomain.algorithms.space import LogUniform
from feddomain.federation.batched import FunctionalRegularizer
from feddomain.federation.messages import Message


class FedProxHparams(FedAvgHparams):
    """FedProx's hyper-parameters: FedAvg's server step and the proximal weight."""

    mu: float = Field(0.01, ge=0.0)
    """μ: weight of the proximal term (μ/2)·‖w − w_global‖² added to every local batch's loss;
    0 is FedAvg."""


class FedProxClient(FedAvgClient):
    def regularizer(self, msg: Message, ctx: ClientContext) -> Callable[[], torch.Tensor]:
        """The proximal term of the shared model's parameters and the received global ones."""
        proximal = self.functional_regularizer()
        params = dict(ctx.model.named_parameters())
        return lambda: proximal(params, msg.arrays)

    def functional_regularizer(self) -> FunctionalRegularizer:
        """(μ/2)·‖w − w_global‖² of (one client's parameters, its received arrays): the
        sequential step's term, and each client's when clients train together."""
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
        space={"mu": LogUniform(1e-3, 1.0)},  # hfedf.md Table 10 grid; hfedatm.md: 1.0
    )
)
