"""FedAvg (McMahan et al., AISTATS 2017): clients train the global model, the server averages.

The server step is ``w <- w + server_lr * (mean_i w_i - w)`` with sample-count weights, which is
plain averaging at the default ``server_lr = 1``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pydantic import Field

from feddomain.algorithms.base import (
    Arrays,
    ClientAlgorithm,
    ClientContext,
    Hparams,
    MethodSpec,
    ServerAlgorithm,
    ServerContext,
    fit_together,
)
from feddomain.algorithms.registry import register
from feddomain.federation.batched import FunctionalRegularizer
from feddomain.federation.messages import Message, weighted_mean
from feddomain.federation.privacy import Uploads
from feddomain.federation.training import LossFn, cross_entropy_loss, get_arrays


class FedAvgHparams(Hparams):
    """FedAvg's hyper-parameter: the server step."""

    server_lr: float = Field(1.0, gt=0.0)
    """η_s: server step size, `w ← w + η_s·(weighted mean of the client models − w)`; 1: plain
    averaging."""


class FedAvgServer(ServerAlgorithm):
    def __init__(self, ctx: ServerContext, hp: Hparams) -> None:
        super().__init__(ctx, hp)
        self.global_arrays: Arrays = get_arrays(ctx.model_factory())

    def configure(self, rnd: int, clients: list[int]) -> dict[int, Message]:
        broadcast = Message("fit", self.global_arrays)
        return dict.fromkeys(clients, broadcast)

    def aggregate(self, rnd: int, replies: Iterator[tuple[int, Message]]) -> None:
        mean, _ = weighted_mean(msg for _, msg in replies)
        if mean is None:  # every update of the round was rejected: keep the model
            return
        lr = getattr(self.hp, "server_lr", 1.0)
        if lr == 1.0:
            self.global_arrays = mean
            return
        self.global_arrays = {
            k: (w + lr * (mean[k] - w)) if w.is_floating_point() else mean[k]
            for k, w in self.global_arrays.items()
        }

    def eval_arrays(self, cid: int | None) -> Arrays | None:
        """The global model for every client; no separate unseen-domain model (the clients'
        shared model is the one the target domain is scored with)."""
        return None if cid is None else self.global_arrays

    def state_dict(self) -> dict[str, Any]:
        return {"global": self.global_arrays}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_arrays = state["global"]


class FedAvgClient(ClientAlgorithm):
    """Load the received model, train E local epochs, return the trained arrays."""

    def run(self, msg: Message, ctx: ClientContext) -> Message:
        stats = ctx.fit(
            msg.arrays, loss_fn=self.loss_fn(msg, ctx), regularizer=self.regularizer(msg, ctx)
        )
        return Message(
            "fit",
            get_arrays(ctx.model),
            {
                "num_examples": len(ctx.train),
                "loss": stats.mean_loss,
            },
        )

    def run_batch(self, msgs: list[Message], ctxs: list[ClientContext]) -> list[Message]:
        """``run`` for a round's clients trained together (FedAvg, FedProx: registered
        ``batchable``; a subclass with its own loss is not)."""
        results = fit_together(
            ctxs,
            [m.arrays for m in msgs],
            regularizer=self.functional_regularizer(),
            anchors=[m.arrays for m in msgs],
        )
        return [
            Message("fit", arrays, {"num_examples": len(ctx.train), "loss": stats.mean_loss})
            for (arrays, stats), ctx in zip(results, ctxs, strict=True)
        ]

    def functional_regularizer(self) -> FunctionalRegularizer | None:
        """``regularizer`` as a function of (parameters, received arrays), for clients trained
        together (none for FedAvg)."""
        return None

    def uploads(self, n_clients: int) -> Uploads:
        """The trained model (every array), its sample count and mean training loss."""
        return Uploads(model=("*",), scalars=("num_examples", "loss"))

    def loss_fn(self, msg: Message, ctx: ClientContext) -> LossFn:
        """The per-batch loss (cross-entropy for FedAvg; FedSR's objective, FedSAM's SAM)."""
        return cross_entropy_loss

    def regularizer(self, msg: Message, ctx: ClientContext):
        """Extra loss term added to every batch (none for FedAvg)."""
        return None


register(
    MethodSpec(
        "fedavg",
        FedAvgServer,
        FedAvgClient,
        FedAvgHparams,
        description="FedAvg: sample-weighted parameter averaging (McMahan et al., AISTATS 2017)",
        takes_client=True,
        batchable=True,
    )
)
