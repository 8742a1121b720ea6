"""FedFD-A (Yang et al., ECCV 2024): FedFD plus the
instance feature adapter, which picks per test sample how far each BatchNorm layer moves from
the global statistics toward the sample's own.

Model: FedFD's (``fedfd.py``) with an adapter A^l in every ``FedFDBatchNorm2d``
(``models/fedfd_bn.py``): α = sigmoid(W2 ReLU(W1 [μ_I − μ_G; σ_I − σ_G] + b1) + b2), 2C → C/r → 1
(CHOICE F4, r = ``adapter_reduction`` = 16: 218,220 parameters on ResNet-18), output layer zero-
initialised (α = 0.5). The adapters are shared arrays: trained on every client, FedAvg'd.

Client step per batch (§3.4, CHOICE F5: jointly from round 1): FedFD's loss on the main
parameters, plus path 3, L_A = CE(C(E(x))) with every layer in mode "adapter", whose gradient
reaches the adapters only — the other parameters enter path 3 detached, so the gradient flows
through their activations (earlier layers' adapters learn from later layers) but not into them.
One backward of the sum, then two optimisers: the configured one over the main parameters and
the adapters' own (CHOICE F6: SGD, momentum ``adapter_momentum`` = 0.9, no weight decay, lr =
``adapter_lr_mult`` × this round's lr, so it follows ``train.schedule``). With
``train.persistent_optimizer`` both keep their state across the client's rounds. The reported
training loss is the sum of FedFD's loss and L_A.

Inference (``test_mode`` = ``adapter``, the default): every layer in mode "adapter", α per test
sample and layer, no gradient step; a prediction does not depend on the other samples of the
batch. FedFD's other test modes stay available (the poster's test-time table on one model).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn
from torch.func import functional_call

from feddomain.algorithms.base import ClientContext, Hparams, MethodSpec
from feddomain.algorithms.fedfd import (
    ADAPTER_TERMS,
    FEDFD_SPACE,
    TERMS,
    TEST_TIME,
    FedFDClient,
    FedFDHparams,
    FedFDServer,
    FedFDStation,
    Terms,
    check,
    fedfd_loss,
    prepare_model,
)
from feddomain.algorithms.registry import register
from feddomain.algorithms.space import LogUniform
from feddomain.federation.messages import Message
from feddomain.federation.training import (
    LossFn,
    TrainStats,
    load_optimizer_state,
    save_optimizer_state,
)
from feddomain.models.fedfd_bn import BNMode, adapter_parameters, bn_mode

ADAPTER_OPTIMIZER_PREFIX = "adapter_optimizer/"  # its state in the client's persistent state
ADAPTER = BNMode("adapter")


class FedFDAHparams(FedFDHparams):
    """FedFD's hyper-parameters plus the instance feature adapter's (CHOICEs F4, F6)."""

    test_mode: Literal["adapter", "global", "local", "instance", "fixed", "random"] = "adapter"
    """BatchNorm statistics at evaluation: `adapter` (FedFD-A's inference: each layer's adapter
    picks the mix per test sample), or one of FedFD's test modes (`global`, `local`,
    `instance`, `fixed`, `random`)."""
    adapter_reduction: int = Field(16, ge=1)
    """r: the adapter's hidden width is C // r (at least 1) for a layer of C channels."""
    adapter_lr_mult: float = Field(10.0, gt=0.0)
    """The adapters' learning rate as a multiple of this round's `train.lr` (after
    `train.schedule`)."""
    adapter_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    """Momentum of the adapters' own SGD optimiser (no weight decay); 0: plain SGD."""


def fedfd_a_model(model: nn.Module, hp: Hparams) -> nn.Module:
    """The model hook: FedFD's layers, each with an instance feature adapter."""
    assert isinstance(hp, FedFDAHparams)
    return prepare_model(model, hp, hp.adapter_reduction)


def adapter_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """L_A: CE through the adapters, with every other parameter detached."""
    adapters = {id(p) for p in adapter_parameters(model)}
    params = {n: p if id(p) in adapters else p.detach() for n, p in model.named_parameters()}
    with bn_mode(model, ADAPTER):
        logits = functional_call(model, params, (x,))
    return F.cross_entropy(logits, y)


def fedfd_a_loss(hp: FedFDAHparams, terms: Terms | None = None) -> LossFn:
    """FedFD's loss (main parameters) plus L_A (adapters only); terms go to ``terms``."""
    main = fedfd_loss(hp, terms)

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        total = main(model, x, y)
        adapted = adapter_loss(model, x, y)
        if terms is not None:
            terms.setdefault("adapter_ce", []).append(adapted.detach())
        return total + adapted

    return loss


def adapter_optimizer(model: nn.Module, hp: FedFDAHparams, lr: float) -> torch.optim.SGD:
    return torch.optim.SGD(
        adapter_parameters(model), lr=hp.adapter_lr_mult * lr, momentum=hp.adapter_momentum
    )


class FedFDAClient(FedFDClient):
    term_names = (*TERMS, *ADAPTER_TERMS)

    def loss_fn(self, msg: Message, ctx: ClientContext) -> LossFn:
        assert isinstance(self.hp, FedFDAHparams)
        return fedfd_a_loss(self.hp, self.terms)

    def train(
        self, arrays: dict[str, torch.Tensor], msg: Message, ctx: ClientContext
    ) -> TrainStats:
        """FedFD's local training with the adapters on their own optimiser."""
        assert isinstance(self.hp, FedFDAHparams)
        adapters = {id(p) for p in adapter_parameters(ctx.model)}
        main = [p for p in ctx.model.parameters() if id(p) not in adapters]
        optimizer = adapter_optimizer(ctx.model, self.hp, ctx.lr)
        if ctx.persistent_optimizer:
            load_optimizer_state(optimizer, ctx.state, ADAPTER_OPTIMIZER_PREFIX)
        self.terms = {}
        stats = ctx.fit(
            arrays, loss_fn=self.loss_fn(msg, ctx), params=main, extra_optimizers=[optimizer]
        )
        if ctx.persistent_optimizer:
            save_optimizer_state(optimizer, ctx.state, ADAPTER_OPTIMIZER_PREFIX)
        return stats


class FedFDAServer(FedFDServer):
    pass


class FedFDAStation(FedFDStation):
    pass


register(
    MethodSpec(
        "fedfd_a",
        FedFDAServer,
        FedFDAClient,
        FedFDAHparams,
        station=FedFDAStation,
        description="FedFD-A: FedFD plus a per-BatchNorm-layer instance feature adapter that "
        "mixes instance and global statistics per test sample (Yang et al., ECCV 2024)",
        model_hook=fedfd_a_model,
        check_config=check("fedfd_a"),
        space={**FEDFD_SPACE, "adapter_lr_mult": LogUniform(1.0, 100.0)},  # fedfda.md §4 F6
        evaluation_only=TEST_TIME,
        image_only="adapts BatchNorm statistics, which text models do not have",
    )
)
