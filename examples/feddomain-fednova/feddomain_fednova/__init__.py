"""FedNova (Wang et al., NeurIPS 2020) as a feddomain plug-in: normalised averaging.

Clients that take different numbers of local steps pull FedAvg's average towards the clients
that took more. FedNova removes that bias: client i sends its update divided by its number of
local SGD steps τ_i, d_i = (w − w_i) / τ_i, and the server steps by the effective number of
steps τ_eff = Σ p_i τ_i along the weighted mean of those directions:

    w ← w − η_g · τ_eff · Σ p_i d_i,    p_i = n_i / Σ n_j.

With equal step counts (τ_i = τ) this is w ← Σ p_i w_i at η_g = 1: FedAvg.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pydantic import Field

from feddomain import ConfigError, Hparams, MethodSpec, register
from feddomain.algorithms.base import ClientContext
from feddomain.algorithms.fedavg import FedAvgClient, FedAvgServer
from feddomain.federation.messages import Message, weighted_mean
from feddomain.federation.privacy import Uploads
from feddomain.federation.training import get_arrays


class FedNovaHparams(Hparams):
    """FedNova's hyper-parameter: the server step."""

    server_lr: float = Field(1.0, gt=0.0)
    """η_g: server step size along τ_eff · Σ p_i d_i; 1: FedNova as published."""


class FedNovaClient(FedAvgClient):
    """Train as FedAvg does, then send the update normalised by the local step count."""

    def run(self, msg: Message, ctx: ClientContext) -> Message:
        stats = ctx.fit(msg.arrays)
        steps = max(stats.steps, 1)
        direction = {
            name: (msg.arrays[name] - w) / steps if w.is_floating_point() else w
            for name, w in get_arrays(ctx.model).items()
        }
        scalars = {"num_examples": len(ctx.train), "steps": steps, "loss": stats.mean_loss}
        return Message("fit", direction, scalars)

    def uploads(self, n_clients: int) -> Uploads:
        """The privacy declaration: one model-shaped array per parameter (the normalised
        update), the sample count, the local step count and the mean training loss."""
        return Uploads(model=("*",), scalars=("num_examples", "steps", "loss"))


class FedNovaServer(FedAvgServer):
    """FedAvg's server (broadcast, evaluation, checkpoints) with FedNova's aggregation."""

    def aggregate(self, rnd: int, replies: Iterator[tuple[int, Message]]) -> None:
        replies_by_client = dict(replies)
        if not replies_by_client:  # every update of the round was rejected: keep the model
            return
        sizes = {c: float(m.scalars["num_examples"]) for c, m in replies_by_client.items()}
        total = sum(sizes.values())
        tau_eff = sum(sizes[c] * m.scalars["steps"] for c, m in replies_by_client.items()) / total
        direction, _ = weighted_mean(replies_by_client.values())  # Σ p_i d_i
        step = self.hp.server_lr * tau_eff
        self.global_arrays = {
            name: w - step * direction[name] if w.is_floating_point() else direction[name]
            for name, w in self.global_arrays.items()
        }


def check_config(cfg: Any, hp: Hparams) -> None:
    """τ_i counts plain SGD steps: other optimisers are refused by key when the config loads."""
    if cfg.train.optimizer != "sgd" or cfg.train.momentum != 0:
        raise ConfigError(
            "'train.optimizer': fednova normalises by the number of plain SGD steps; set "
            f"train.optimizer: sgd and train.momentum: 0 (got {cfg.train.optimizer!r}, "
            f"momentum {cfg.train.momentum})"
        )


register(
    MethodSpec(
        "fednova",
        FedNovaServer,
        FedNovaClient,
        FedNovaHparams,
        description="FedNova: updates normalised by local steps (Wang et al., NeurIPS 2020)",
        check_config=check_config,
    )
)
