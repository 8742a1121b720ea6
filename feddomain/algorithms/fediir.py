"""FedIIR (Guo, Guo, Cao, Wu & Chang, "Out-of-Distribution Generalization of Federated Learning via
Implicit Invariant Relationships", ICML 2023): FedAvg whose clients keep their classifier
gradient close to the federation's mean classifier gradient.

Each client minimises, per batch (hfedatm.md §6),

    CE + γ · Σ_{classifier params} ‖∇_cls CE_client − ḡ‖²

where ∇_cls CE_client is the gradient of the batch's mean cross-entropy w.r.t. the classifier's
parameters (weight and bias), taken with ``autograd.grad(create_graph=True)`` so that the
penalty's own gradient (double backprop) reaches the featurizer and the classifier (checked
against finite differences in float64). Only the classifier's gradient is in the double graph:
on LeNet-5 a step costs about what a plain cross-entropy step does; the per-round pre-task (one
forward pass over the client's data, featurizer under no_grad) is FedIIR's extra cost.

ḡ is an EMA, ``ḡ ← β·ḡ + (1 − β)·mean`` with β = ``ema`` (0.95) and ḡ = 0 before the first
round, of the mean classifier gradient, recomputed at the start of every round on the current
global model: the server's per-round pre-task asks each participating client for the sum of
its per-batch mean classifier gradients over one pass of its training batches (same batch size,
augmentation and train mode as training; no weights change) and their count, and broadcasts ḡ
with the model. CHOICE (``grad_mean: batches``, default): the mean is over all mini-batches of
all participating clients, Σ_i Σ_b g_ib / Σ_i n_i — the official code's ``mean_grad`` and
FL-bench's, and hfedatm.md's "mean (over the clients, per mini-batch)"; ``grad_mean: clients``
averages each client's mean batch gradient with equal weight instead. The EMA is server state
and checkpointed (FL-bench forgets to store it; the official code keeps it).

With stations (hfedatm.md §6) each station keeps its own EMA over its clients: before every
station round it asks them for the same statistic on the current station model and sends its ḡ
with the model (``hierarchical: station``, default); the EMA is station state, checkpointed.
``hierarchical: server`` keeps one EMA at the server (computed before each global round over
all participating clients) and the stations pass it on.

What crosses: the pre-task's reply is one statistic ``classifier_grad`` of shape
[1, classifier size] plus the scalar ``n_batches``; the fit reply is FedAvg's. FedIIR needs its
own server (or station) part for ḡ: as the client part of another aggregator its clients stop
with an error naming that.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from feddomain.algorithms.base import (
    ClientContext,
    Hparams,
    MethodSpec,
    Plan,
    ServerContext,
    StationAlgorithm,
    StationContext,
)
from feddomain.algorithms.fedavg import FedAvgClient, FedAvgHparams, FedAvgServer
from feddomain.algorithms.registry import register
from feddomain.algorithms.space import LogUniform
from feddomain.errors import ConfigError, FeddomainError
from feddomain.federation.messages import Message
from feddomain.federation.privacy import Uploads
from feddomain.federation.training import cross_entropy_loss, get_arrays, set_arrays
from feddomain.models.base import FeatureClassifier

GRAD_TASK = "classifier_grad"  # the pre-task, and the name of its statistic
GRAD_MEAN = "grad_mean"  # ḡ, sent down with the model


class FedIIRHparams(FedAvgHparams):
    """FedIIR's hyper-parameters: FedAvg's server step and the gradient-alignment penalty
    (default γ: hfedatm.md §4, FL-bench's)."""

    gamma: float = Field(1e-3, ge=0.0)
    """γ: weight of the penalty Σ ‖∇_cls CE − ḡ‖² pulling each batch's classifier gradient to
    the federation's mean ḡ; 0 is FedAvg."""
    ema: float = Field(0.95, ge=0.0, le=1.0)
    """β: EMA weight of the previous ḡ, `ḡ ← β·ḡ + (1 − β)·(this round's mean gradient)`; 0:
    this round's mean only."""
    grad_mean: Literal["batches", "clients"] = "batches"
    """How the round's mean classifier gradient is taken: over all mini-batches of all
    participants (`batches`, the official code's) or as the equal-weight mean of each client's
    mean (`clients`)."""
    hierarchical: Literal["station", "server"] = "station"
    """With stations, who keeps ḡ: each `station` over its own clients, recomputed every station
    round, or the `server` over all participants, once per global round."""


def _require_split(model: nn.Module, hp: Hparams) -> nn.Module:
    """FedIIR's model hook: no change, but a model without a classifier is refused by name."""
    if not isinstance(model, FeatureClassifier):
        raise ConfigError(
            "fediir needs a model split into featurizer and classifier (a FeatureClassifier); "
            f"{type(model).__name__} has no such split"
        )
    return model


def classifier_gradients(classifier: nn.Module, ce: Tensor, *, create_graph: bool) -> list[Tensor]:
    """∇ of the batch's mean cross-entropy ``ce`` w.r.t. ``classifier.parameters()``, in their
    order; kept in the graph (for double backprop) when ``create_graph``."""
    params = list(classifier.parameters())
    return list(torch.autograd.grad(ce, params, create_graph=create_graph))


def penalty(grads: Iterable[Tensor], grad_mean: Tensor) -> Tensor:
    """Σ over the classifier's parameters of ‖g − ḡ‖² (ḡ flat, in parameter order)."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    if grad_mean.numel() == 0:  # no ḡ yet (every reply of the first pre-task was rejected)
        return flat.pow(2).sum()
    return (flat - grad_mean.to(flat.dtype)).pow(2).sum()


def fediir_loss(gamma: float, grad_mean: Tensor):
    """CE + γ·penalty per batch (a ``ctx.fit`` loss function)."""

    def loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        ce = F.cross_entropy(model.classifier(model.featurizer(x)), y)
        grads = classifier_gradients(model.classifier, ce, create_graph=True)
        return ce + gamma * penalty(grads, grad_mean)

    return loss


def update_ema(
    ema: Tensor | None, replies: Iterable[Message], beta: float, mean: str
) -> Tensor | None:
    """β·ḡ + (1 − β)·(mean classifier gradient of ``replies``), in float64; ``ema`` unchanged when
    no reply holds a batch."""
    sums, counts = [], []
    for msg in replies:
        n = int(msg.scalars["n_batches"])
        if n > 0:
            sums.append(msg.arrays[GRAD_TASK].reshape(-1).double())
            counts.append(n)
    if not sums:
        return ema
    if mean == "batches":
        new = torch.stack(sums).sum(0) / sum(counts)
    else:
        new = torch.stack([s / n for s, n in zip(sums, counts, strict=True)]).mean(0)
    previous = torch.zeros_like(new) if ema is None else ema
    return beta * previous + (1.0 - beta) * new


def _downlinked(ema: Tensor | None) -> Tensor:
    """ḡ as clients receive it (float32; empty before any ḡ exists)."""
    return torch.zeros(0) if ema is None else ema.float()


class FedIIRServer(FedAvgServer):
    def __init__(self, ctx: ServerContext, hp: Hparams) -> None:
        super().__init__(ctx, hp)
        self.grad_ema: Tensor | None = None  # float64, flat over the classifier's parameters
        self.at_stations = ctx.stations > 0 and hp.hierarchical == "station"

    def pre_round(self, rnd: int, clients: list[int]) -> Plan:
        """Every participant's classifier gradient on the current global model (none when the
        stations keep ḡ)."""
        if self.at_stations:
            return {}
        return dict.fromkeys(clients, Message(GRAD_TASK, self.global_arrays))

    def on_pre_round(self, rnd: int, replies: dict[int, Message]) -> None:
        self.grad_ema = update_ema(self.grad_ema, replies.values(), self.hp.ema, self.hp.grad_mean)

    def configure(self, rnd: int, clients: list[int]) -> dict[int, Message]:
        if self.at_stations:
            return super().configure(rnd, clients)
        arrays = {**self.global_arrays, GRAD_MEAN: _downlinked(self.grad_ema)}
        return dict.fromkeys(clients, Message("fit", arrays))

    def diagnostics(self) -> dict[str, Any]:
        if self.grad_ema is None:
            return {}
        return {"grad_mean_norm": float(self.grad_ema.norm())}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "grad_ema": self.grad_ema}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.grad_ema = state["grad_ema"]


class FedIIRStation(StationAlgorithm):
    """Keeps ḡ over its own clients (``hierarchical: station``: a pre-task before every station
    round, on the station's current model), or passes on the server's; sends it with the model
    in every downlink. Its uplink is the default (the station's sample-weighted mean model)."""

    def __init__(self, ctx: StationContext, hp: Hparams) -> None:
        super().__init__(ctx, hp)
        self.own = hp.hierarchical == "station"
        self.grad_ema: Tensor | None = None
        self.from_server: Tensor | None = None

    def begin(self, rnd: int, msg: Message) -> None:
        arrays = dict(msg.arrays)
        self.from_server = arrays.pop(GRAD_MEAN, None)
        super().begin(rnd, Message(msg.task, arrays, msg.scalars))

    def pre_round(self, rnd: int, r: int, clients: list[int]) -> Plan | None:
        if not self.own:
            return None
        return dict.fromkeys(clients, Message(GRAD_TASK, self.current.arrays))

    def on_pre_round(self, rnd: int, r: int, replies: dict[int, Message]) -> None:
        self.grad_ema = update_ema(self.grad_ema, replies.values(), self.hp.ema, self.hp.grad_mean)

    def downlink(self, rnd: int, r: int) -> Message:
        model = super().downlink(rnd, r)
        grad_mean = _downlinked(self.grad_ema) if self.own else self.from_server
        if grad_mean is None:  # the server sent no ḡ (it is another aggregator)
            return model
        return Message(model.task, {**model.arrays, GRAD_MEAN: grad_mean}, model.scalars)

    def state_dict(self) -> dict[str, Any]:
        return {"grad_ema": self.grad_ema}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.grad_ema = state["grad_ema"]


class FedIIRClient(FedAvgClient):
    """Answers the pre-task with its classifier-gradient sum; trains with the penalty."""

    def run(self, msg: Message, ctx: ClientContext) -> Message:
        if msg.task == GRAD_TASK:
            return self.classifier_grad(msg, ctx)
        arrays = dict(msg.arrays)
        grad_mean = arrays.pop(GRAD_MEAN, None)
        if grad_mean is None:
            raise FeddomainError(
                "fediir's clients need the mean classifier gradient that fediir's own server "
                "(or station) part sends with the model; it cannot be the client part of "
                "another aggregator (algorithm.client)"
            )
        gamma = self.hp.gamma
        loss_fn = cross_entropy_loss if gamma == 0.0 else fediir_loss(gamma, grad_mean)
        stats = ctx.fit(arrays, loss_fn=loss_fn)
        return Message(
            "fit",
            get_arrays(ctx.model),
            {"num_examples": len(ctx.train), "loss": stats.mean_loss},
        )

    def classifier_grad(self, msg: Message, ctx: ClientContext) -> Message:
        """Σ over one pass of training batches of the batch-mean CE gradient w.r.t. the
        classifier, at the received model (train mode, like training; no step is taken)."""
        model = ctx.model
        set_arrays(model, msg.arrays)
        model.train()
        total: Tensor | None = None
        n = 0
        batches = ctx.train.batches(ctx.batch_size, ctx.generator, drop_last=ctx.drop_last)
        for x, y in batches:
            with torch.no_grad():
                features = model.featurizer(x)
            with torch.enable_grad():
                ce = F.cross_entropy(model.classifier(features), y)
                grads = classifier_gradients(model.classifier, ce, create_graph=False)
            flat = torch.cat([g.detach().reshape(-1) for g in grads])
            total = flat if total is None else total + flat
            n += 1
        if total is None:
            size = sum(p.numel() for p in model.classifier.parameters())
            total = torch.zeros(size)
        return Message(GRAD_TASK, {GRAD_TASK: total.unsqueeze(0)}, {"n_batches": n})

    def uploads(self, n_clients: int) -> Uploads:
        """The trained model, its sample count and mean loss; once a round (or station round),
        the classifier-gradient sum (one row of the classifier's size) and its batch count."""
        return Uploads(
            model=("*",),
            statistics={GRAD_TASK: (1, None)},
            scalars=("num_examples", "loss", "n_batches"),
        )


register(
    MethodSpec(
        "fediir",
        FedIIRServer,
        FedIIRClient,
        FedIIRHparams,
        station=FedIIRStation,
        description="FedIIR: FedAvg with a penalty pulling each client's classifier gradient "
        "to an EMA of the federation's mean (Guo et al., ICML 2023)",
        model_hook=_require_split,
        space={"gamma": LogUniform(1e-4, 1e-2)},  # x/10 .. x10 around FL-bench's 1e-3
    )
)
