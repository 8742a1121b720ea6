"""MTGC (Fang, Han, Chen, Wang & Brinton, "Hierarchical Federated Learning with Multi-Timescale
Gradient Correction", NeurIPS 2024): hierarchical FedAvg whose local steps are corrected twice,
towards the station's gradient and towards the global one (a baseline of HFedATM, hfedatm.md §6).

The rule implemented (the paper's Algorithm 1 as its official code, github.com/wenzhifang/MTGC,
runs it; t global rounds, e = 0..E−1 station rounds (``topology.station_rounds``), h local
steps, γ the round's learning rate, client i of station j)::

    global round t:        z_i^{t,0} = 0                                  (reset every round)
    local step:            x_i ← x_i − γ·(∇F_i(x_i; ξ) + z_i^{t,e} + y_j^t)
    station aggregation:   x̄_j^{t,e+1} = Σ_{i∈j} p_i x_i^{t,e,H}             p_i = n_i / Σ_{l∈j} n_l
    client correction:     z_i^{t,e+1} = z_i^{t,e} + β_z·(x_i^{t,e,H} − x̄_j^{t,e+1}) / (H_i γ)
    global aggregation:    x̄^{t+1} = Σ_j γ_j x̄_j^{t,E} / Σ_j γ_j             γ_j = active clients
    station correction:    y_j^{t+1} = y_j^t + β_y·(x̄_j^{t,E} − x̄^{t+1}) / (Σ_e Σ_{i∈j} p_i H_i γ)

y_j^0 = 0. With equal clients (H_i = H) the divisors are the paper's Hγ and EHγ; β_z = β_y = 1
is the paper (its corrections have no step size of their own), and β_z = β_y = 0 keeps both
corrections at zero: hierarchical FedAvg (``hfedavg``) bit for bit. z_i tracks ∇f_j − ∇F_i (the
station's mean gradient minus the client's) and y_j tracks ∇f − ∇f_j, SCAFFOLD's option II
estimate at each tier: (x_before − x_after)/(steps·γ) is the mean applied gradient of plain SGD.

Where it lives (the official code's structure, two parameter-sized vectors per party):

- z_i is the client's state (``ctx.state``: kept by the runner, or by the node on Flower), with
  its model and H_i·γ of the last station round: the client updates z_i when the next station
  round's model x̄_j arrives, so z_i never leaves the client; it is dropped after the last
  station round (it restarts at 0), so only the clients of the station at work hold one.
- y_j is the station's state (checkpointed with the run): it goes down with every station
  round's model (``mtgc_y``), and the station updates it when the next global model arrives,
  from the model it sent up and Σ_e Σ_i p_i H_i γ (each client replies H_i γ as
  ``mtgc_step_length``).
- The server is +Avg's (γ-weighted mean of the station models).

The corrections cover the trained parameters (not buffers), flat in ``model.parameters()``
order, and enter through the shared loop as SCAFFOLD's do: a gradient hook adds z_i + y_j to each
gradient (``train.grad_clip`` clips the corrected gradient; weight decay is part of ∇F_i).

CHOICES: each client divides by its own H_i (clients of unequal size take unequal steps; the
paper's clients are equal); the station's divisor is the p-weighted mean over its clients of
H_i γ summed over the station rounds. Refused when the config loads: a flat federation (there is
no station tier to correct), station sampling (``topology.sample_fraction`` < 1: the paper's and
official code's full participation, which y_j's update assumes), and anything but plain SGD
(the estimate is the mean applied gradient only for steps x ← x − γ·d).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from pydantic import Field
from torch import Tensor

from feddomain.algorithms.base import (
    ClientContext,
    Hparams,
    MethodSpec,
    StationAlgorithm,
    StationContext,
)
from feddomain.algorithms.fedavg import FedAvgClient
from feddomain.algorithms.hfedatm import HFedAvgServer, station_layer
from feddomain.algorithms.registry import register
from feddomain.algorithms.space import Uniform
from feddomain.errors import ConfigError
from feddomain.federation.messages import Message
from feddomain.federation.privacy import Uploads
from feddomain.federation.training import get_arrays, gradient_offset

STATION_Y = "mtgc_y"  # y_j, [1, P], in every downlink of station j
STEP_LENGTH = "mtgc_step_length"  # H_i·γ of the client's training, in its reply
CLIENT_Z = "mtgc_z"  # z_i, in the client's state
CLIENT_LAST = "mtgc_last"  # the client's last trained parameters x_i, in its state
CLIENT_AT = "mtgc_at"  # [global round, station round] of that training, in its state


class MTGCHparams(Hparams):
    """MTGC's step sizes of its two correction updates (1: the paper's)."""

    client_correction: float = Field(1.0, ge=0.0)
    """β_z: z_i ← z_i + β_z·(x_i − x̄_j)/(H_i·γ) after each station aggregation (client-station
    correction, reset to 0 every global round); 0: no client correction."""
    station_correction: float = Field(1.0, ge=0.0)
    """β_y: y_j ← y_j + β_y·(x̄_j − x̄)/(Σ_e mean_i H_i·γ) after each global aggregation
    (station-global correction, kept across rounds); 0: no station correction."""


def parameter_names(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def _flat_params(model: torch.nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _flat(arrays: dict[str, Tensor], names: list[str]) -> Tensor:
    """The named arrays as one vector, in the parameters' order and dtype."""
    return torch.cat([arrays[name].reshape(-1) for name in names])


class MTGCClient(FedAvgClient):
    """Trains with the gradient ∇F_i + z_i + y_j; keeps z_i, replies its model and H_i·γ."""

    def run(self, msg: Message, ctx: ClientContext) -> Message:
        if STATION_Y not in msg.arrays:
            raise ConfigError(
                f"mtgc's client part needs mtgc's stations (they send y_j as '{STATION_Y}'); it "
                "cannot be another aggregator's client part"
            )
        arrays = dict(msg.arrays)
        y = arrays.pop(STATION_Y).reshape(-1)
        station_model = _flat(arrays, parameter_names(ctx.model))  # x̄_j of this station round
        z = self._client_correction(ctx, station_model)
        with gradient_offset(list(ctx.model.parameters()), z + y):
            stats = ctx.fit(arrays)
        length = stats.steps * ctx.lr  # H_i·γ
        self._keep(ctx, z, length)
        return Message(
            "fit",
            get_arrays(ctx.model),
            {"num_examples": len(ctx.train), "loss": stats.mean_loss, STEP_LENGTH: length},
        )

    def _keep(self, ctx: ClientContext, z: Tensor, length: float) -> None:
        """What the next station round's z_i needs: z_i, x_i, H_i·γ and when they were made;
        nothing after the last station round (z_i restarts at 0), so between global rounds
        (and in checkpoints) a client holds no correction."""
        if ctx.station_round == ctx.station_rounds - 1:
            for key in (CLIENT_Z, CLIENT_LAST):
                ctx.state.arrays.pop(key, None)
            for key in (CLIENT_AT, STEP_LENGTH):
                ctx.state.scalars.pop(key, None)
            return
        ctx.state.arrays[CLIENT_Z] = z
        ctx.state.arrays[CLIENT_LAST] = _flat_params(ctx.model)
        ctx.state.scalars[CLIENT_AT] = [ctx.rnd, ctx.station_round]
        ctx.state.scalars[STEP_LENGTH] = length

    def _client_correction(self, ctx: ClientContext, station_model: Tensor) -> Tensor:
        """z_i for this station round: 0 in the first of a global round, else the last one's
        z_i moved by β_z·(x_i − x̄_j)/(H_i·γ), x̄_j being the model just received."""
        if ctx.station_round == 0:
            return torch.zeros_like(station_model)
        at = ctx.state.scalars.get(CLIENT_AT)
        if at != [ctx.rnd, ctx.station_round - 1]:
            raise RuntimeError(
                f"mtgc: client {ctx.cid} did not train in station round {ctx.station_round - 1} "
                f"of round {ctx.rnd} (its last training: {at}); z_i needs every station round"
            )
        z, last = ctx.state.arrays[CLIENT_Z], ctx.state.arrays[CLIENT_LAST]
        length = float(ctx.state.scalars[STEP_LENGTH])
        if not length:  # no step was taken: nothing was learnt about the client's gradient
            return z
        step = self.hp.client_correction / length
        return (z.double() + step * (last.double() - station_model.double())).to(z.dtype)

    def uploads(self, n_clients: int) -> Uploads:
        """The trained model, its sample count, mean training loss and H_i·γ (z_i stays)."""
        return Uploads(model=("*",), scalars=("num_examples", "loss", STEP_LENGTH))


class MTGCStation(StationAlgorithm):
    """HFedAvg's station (sample-weighted mean of its clients) that keeps y_j, sends it down
    with every station round's model and updates it when the next global model arrives."""

    def __init__(self, ctx: StationContext, hp: Hparams) -> None:
        super().__init__(ctx, hp)
        if ctx.model_factory is None:
            raise ValueError("mtgc's station needs the model's structure (model_factory)")
        model = ctx.model_factory()
        self.names = parameter_names(model)
        self.y = torch.zeros_like(_flat_params(model))  # y_j
        self.length = 0.0  # Σ_e mean_i H_i·γ of this global round so far
        self.sent: Tensor | None = None  # x̄_j sent up last round, flat
        self.sent_length = 0.0  # ... and the length of its training

    def begin(self, rnd: int, msg: Message) -> None:
        """The new global model x̄: y_j ← y_j + β_y·(x̄_j − x̄)/length, then the round starts."""
        if self.sent is not None and self.sent_length:
            global_model = _flat(msg.arrays, self.names).double()
            step = self.hp.station_correction / self.sent_length
            self.y = (self.y.double() + step * (self.sent.double() - global_model)).to(self.y.dtype)
        self.sent, self.sent_length, self.length = None, 0.0, 0.0
        super().begin(rnd, msg)

    def downlink(self, rnd: int, r: int) -> Message:
        msg = super().downlink(rnd, r)
        return Message(msg.task, {**msg.arrays, STATION_Y: self.y.view(1, -1)}, msg.scalars)

    def aggregate(self, rnd: int, r: int, replies: Iterator[tuple[int, Message]]) -> None:
        weighted, total = 0.0, 0.0

        def lengths() -> Iterator[tuple[int, Message]]:
            nonlocal weighted, total
            for cid, msg in replies:
                n = float(msg.scalars["num_examples"])
                weighted += n * float(msg.scalars[STEP_LENGTH])
                total += n
                yield cid, msg

        super().aggregate(rnd, r, lengths())
        if total:
            self.length += weighted / total

    def uplink(self, rnd: int) -> Message | None:
        up = super().uplink(rnd)
        if up is not None:
            self.sent, self.sent_length = _flat(up.arrays, self.names), self.length
        return up

    def state_dict(self) -> dict[str, Any]:
        return {"y": self.y, "sent": self.sent, "sent_length": self.sent_length}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.y, self.sent, self.sent_length = state["y"], state["sent"], state["sent_length"]


def check_config(cfg: Any, hp: Hparams) -> None:
    """Stations, all of them every round, and plain SGD, refused by key when the config loads."""
    if not cfg.topology.stations:
        raise ConfigError(
            "'topology.stations': mtgc is hierarchical (clients → stations → server); set "
            "topology.stations to at least 1"
        )
    if cfg.topology.sample_fraction != 1.0:
        raise ConfigError(
            f"'topology.sample_fraction' = {cfg.topology.sample_fraction}: mtgc needs every "
            "station in every round (y_j is corrected towards the next global model)"
        )
    if cfg.train.optimizer != "sgd" or cfg.train.momentum != 0:
        raise ConfigError(
            f"'train.optimizer' = {cfg.train.optimizer!r}, 'train.momentum' = "
            f"{cfg.train.momentum}: mtgc needs plain SGD (train.optimizer: sgd, momentum 0): "
            "its corrections (x_before − x_after)/(steps·lr) are the mean applied gradient only "
            "for steps x ← x − lr·g"
        )


register(
    MethodSpec(
        "mtgc",
        HFedAvgServer,
        MTGCClient,
        MTGCHparams,
        station=MTGCStation,
        description="MTGC: hierarchical FedAvg with local steps corrected towards the station's "
        "gradient (z_i) and the station's towards the global one (y_j) (Fang et al., NeurIPS 2024)",
        check_config=check_config,
        # the full correction (1, the official code's) down to none (0: hierarchical FedAvg)
        space={"client_correction": Uniform(0.0, 1.0), "station_correction": Uniform(0.0, 1.0)},
        station_wrapper=station_layer,
    )
)
