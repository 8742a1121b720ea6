"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic controlled averaging for federated
learning", ICML 2020), with option II control variates.

The rule implemented (the paper's Algorithm 1), with x the server model, c the server control
variate and c_i client i's (all zero at the start):

    client i, from y = x:    K local steps  y ← y − lr·(g_i(y) − c_i + c)
                             c_i⁺ = c_i − c + (x − y)/(K·lr)           (option II)
                             sends y and Δc_i = c_i⁺ − c_i; keeps c_i ← c_i⁺
    server, over S:          x ← x + η_g · Σ_{i∈S} p_i (y_i − x)       p_i = n_i / Σ_{j∈S} n_j
                             c ← c + (1/N) · Σ_{i∈S} Δc_i              = c + (|S|/N)·mean_S Δc_i

K is the number of local steps the client took this round (E epochs of batches), lr this round's
learning rate (``ctx.lr``, after ``train.schedule``), N the number of clients in the federation.

Where it lives: c_i is the client's persistent state (``ctx.state``, kept by the runner, by the
node under Flower, and in checkpoints); c is server state. The correction enters through the
shared loop: while the client trains, a gradient hook on every parameter adds (c − c_i) to that
parameter's gradient as backward computes it, so the configured SGD step is exactly
y − lr·(g − c_i + c) (and ``train.grad_clip`` clips the corrected gradient).

CHOICES:

- x moves by the SAMPLE-WEIGHTED mean of the updates (as FedAvg; the paper's plain mean is the
  equal-size case); the client sends y (the model, as in FedAvg) and the server forms
  Σ p_i(y_i − x) as ``mean − x`` with FedAvg's own code, so ``server_lr = η_g`` is FedAvg's key
  and with zero control variates (the first round) SCAFFOLD is FedAvg bit for bit.
- c moves by the paper's UNWEIGHTED (1/N)·Σ Δc_i, which keeps c = mean over all N clients of c_i
  under any sampling.
- Control variates cover the trained parameters (not buffers); they travel flat, in
  ``model.parameters()`` order: the server sends c as ``scaffold_c`` and the client replies
  Δc_i as ``scaffold_delta_c`` (one row of P numbers, declared as a statistic).
- Plain SGD only (the paper's setting): the option II estimate (x − y)/(K·lr) is the mean
  applied gradient only for steps y ← y − lr·d. ``train.optimizer: adam`` and
  ``train.momentum > 0`` are refused when the config loads; weight decay is allowed (it is part
  of the local objective's gradient, so c_i includes it). Stations are refused (c would be
  updated with station aggregates).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from pydantic import Field

from feddomain.algorithms.base import ClientContext, Hparams, MethodSpec, ServerContext
from feddomain.algorithms.fedavg import FedAvgClient, FedAvgHparams, FedAvgServer
from feddomain.algorithms.registry import register
from feddomain.errors import ConfigError
from feddomain.federation.messages import Message
from feddomain.federation.privacy import Uploads
from feddomain.federation.training import get_arrays, gradient_offset

SERVER_C = "scaffold_c"  # the server's control variate c, in the fit message
DELTA_C = "scaffold_delta_c"  # a client's Δc_i, in its reply
CLIENT_C = "scaffold_c_i"  # a client's own c_i, in its persistent state


class ScaffoldHparams(FedAvgHparams):
    """SCAFFOLD's hyper-parameter: the global step (FedAvg's key)."""

    server_lr: float = Field(1.0, gt=0.0)
    """η_g: global step size, `x ← x + η_g·Σ_i p_i (y_i − x)` (the control variates move by
    their own rule); 1: the new model is the clients' weighted mean."""


def _flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class ScaffoldServer(FedAvgServer):
    def __init__(self, ctx: ServerContext, hp: Hparams) -> None:
        super().__init__(ctx, hp)
        self.control = torch.zeros_like(_flat_params(ctx.model_factory()))  # c

    def configure(self, rnd: int, clients: list[int]) -> dict[int, Message]:
        broadcast = Message("fit", {**self.global_arrays, SERVER_C: self.control.view(1, -1)})
        return dict.fromkeys(clients, broadcast)

    def aggregate(self, rnd: int, replies: Iterator[tuple[int, Message]]) -> None:
        total = torch.zeros_like(self.control, dtype=torch.float64)  # Σ_{i∈S} Δc_i

        def models() -> Iterator[tuple[int, Message]]:
            for cid, msg in replies:
                arrays = dict(msg.arrays)
                total.add_(arrays.pop(DELTA_C).reshape(-1))
                yield cid, Message(msg.task, arrays, msg.scalars)

        super().aggregate(rnd, models())  # x ← x + η_g·Σ p_i (y_i − x), FedAvg's step
        self.control = (self.control.double() + total / self.ctx.n_clients).to(self.control.dtype)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "control": self.control}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.control = state["control"]


class ScaffoldClient(FedAvgClient):
    """Trains with the corrected gradient g − c_i + c and replies y, Δc_i."""

    def run(self, msg: Message, ctx: ClientContext) -> Message:
        if SERVER_C not in msg.arrays:
            raise ConfigError(
                "scaffold's client part needs scaffold's server (it sends the control variate "
                f"'{SERVER_C}'); it cannot be another aggregator's client part"
            )
        _check_plain_sgd(ctx)
        x = dict(msg.arrays)  # the server model x (a copy of our own: loading it copies again)
        c = x.pop(SERVER_C).reshape(-1)
        params = list(ctx.model.parameters())
        c_i = ctx.state.arrays.get(CLIENT_C)
        if c_i is None:
            c_i = torch.zeros_like(c)
        with gradient_offset(params, c - c_i):  # every gradient becomes g − c_i + c
            stats = ctx.fit(x)
        y = get_arrays(ctx.model)
        x_flat = torch.cat([x[name].reshape(-1) for name, _ in ctx.model.named_parameters()])
        if stats.steps:
            c_new = c_i - c + (x_flat - _flat_params(ctx.model)) / (stats.steps * ctx.lr)
        else:  # no batch: nothing was learnt about this client's gradient
            c_new = c_i
        ctx.state.arrays[CLIENT_C] = c_new
        return Message(
            "fit",
            {**y, DELTA_C: (c_new - c_i).view(1, -1)},
            {"num_examples": len(ctx.train), "loss": stats.mean_loss},
        )

    def uploads(self, n_clients: int) -> Uploads:
        """The trained model, Δc_i (one row: one number per trained parameter), the sample
        count and the mean training loss."""
        return Uploads(
            model=("*",), statistics={DELTA_C: (1, None)}, scalars=("num_examples", "loss")
        )


def _check_plain_sgd(ctx: ClientContext) -> None:
    """A second guard where the config check cannot reach (a client built by hand)."""
    probe = ctx.make_optimizer([torch.nn.Parameter(torch.zeros(1))], ctx.lr)
    if not isinstance(probe, torch.optim.SGD) or any(
        g.get("momentum", 0) for g in probe.param_groups
    ):
        raise ConfigError(
            "scaffold needs plain SGD (train.optimizer: sgd, train.momentum: 0): its control "
            f"variates assume steps y ← y − lr·g, got {type(probe).__name__}"
        )


def check_config(cfg: Any, hp: Hparams) -> None:
    """Plain SGD and a flat federation, refused by key when the config loads."""
    if cfg.train.optimizer != "sgd":
        raise ConfigError(
            f"'train.optimizer': scaffold needs plain SGD, got {cfg.train.optimizer!r}: its "
            "option II control variates c_i = c_i − c + (x − y)/(K·lr) are the mean applied "
            "gradient only for steps y ← y − lr·g (set train.optimizer: sgd)"
        )
    if cfg.train.momentum != 0:
        raise ConfigError(
            f"'train.momentum': scaffold needs plain SGD (momentum 0), got {cfg.train.momentum}"
        )
    if cfg.topology.stations:
        raise ConfigError(
            "'topology.stations': scaffold runs on a flat federation (its server control "
            "variate is the mean of every client's)"
        )


register(
    MethodSpec(
        "scaffold",
        ScaffoldServer,
        ScaffoldClient,
        ScaffoldHparams,
        description=(
            "SCAFFOLD: local SGD corrected by control variates g - c_i + c, option II "
            "(Karimireddy et al., ICML 2020)"
        ),
        check_config=check_config,
    )
)
