"""FedGMA (Tenison et al., "Gradient masked averaging for federated learning", TMLR 2023;
arXiv:2201.11986): FedAvg whose server step keeps, per coordinate, only the part of the mean
update on whose sign the clients agree.

The rule implemented (hfedf.md §6 and fisc.md §6, the paper's rule — not the released FISC
aggregation, whose ``0 - mask`` reads as an ``__rsub__`` bug), per round over the K clients whose
replies were accepted:

    Δ_k = w_k − w                               every floating array, every coordinate
    A   = |Σ_k sign(Δ_k)| / K                   sign agreement, in [0, 1]
    m   = 1 where A ≥ τ, else A                 the mask
    w  ← w + η_s · m ⊙ Σ_k p_k Δ_k              p_k = n_k / Σ_j n_j (training-set sizes)

The sign agreement is the PLAIN mean over clients, not sample-weighted: hfedf.md writes
``|mean_i sign(Δ_i)|`` and fisc.md ``|Σ_k sign(Δ_k)|/K``, which are the same thing (the FISC code
also counts every sampled client once). sign(0) = 0, so a client that did not move a coordinate
lowers its agreement.

CHOICES:

- ``Σ_k p_k Δ_k`` is computed as ``mean − w`` with FedAvg's sample-weighted mean (accumulated in
  float64 by ``weighted_mean``): the same number up to rounding, and where the mask is 1 the new
  value is computed by FedAvg's very expression (``mean`` at η_s = 1, ``w + η_s·(mean − w)``
  otherwise). So τ = 0 (every mask is 1) is FedAvg with ``server_lr = η_s`` bit for bit, and
  masked coordinates (m = A < 1) take ``w + η_s·A·(mean − w)``, computed in float64 and rounded
  once to float32 (``flatten``'s working type, as FedAvg's mean).
- Every floating array is masked, BatchNorm running statistics included (the FISC code masks the
  whole state dict); integer buffers (``num_batches_tracked``) take FedAvg's mean.
- The server step is streaming: each reply's signs are folded into a running count as it
  arrives, so memory does not grow with the number of clients.

Defaults: τ = 0.4 and η_s = 1 (FISC's setting, fisc.md §6); hFedF's Table 10 values (PACS
τ = 0.7, η_s = 1; Office-Home τ = 0.3, η_s = 1e-2; VLCS τ = 0.5, η_s = 1e-2) are in
``configs/baselines/fedgma.yaml``. The client part is FedAvg's (E local epochs, uploads the model).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from pydantic import Field

from feddomain.algorithms.base import MethodSpec, ServerContext
from feddomain.algorithms.fedavg import FedAvgClient, FedAvgHparams, FedAvgServer
from feddomain.algorithms.registry import register
from feddomain.algorithms.space import LogUniform, Uniform
from feddomain.federation.messages import Message, flatten, unflatten, weighted_mean


class FedGMAHparams(FedAvgHparams):
    """FedGMA's hyper-parameters: FedAvg's server step and the sign-agreement threshold."""

    server_lr: float = Field(1.0, gt=0.0)
    """η_s: server step size, `w ← w + η_s·m ⊙ (weighted mean of the client models − w)` with m
    the sign-agreement mask (see `tau`)."""
    tau: float = Field(0.4, ge=0.0, le=1.0)
    """τ: sign-agreement threshold; a coordinate whose agreement A = |Σ_k sign(Δ_k)|/K is ≥ τ
    keeps its whole update, one below it is scaled by A; 0 is FedAvg."""


class FedGMAServer(FedAvgServer):
    def __init__(self, ctx: ServerContext, hp: FedGMAHparams) -> None:
        super().__init__(ctx, hp)
        self.last: dict[str, float] = {}  # the latest round's mask statistics (diagnostics)

    def aggregate(self, rnd: int, replies: Iterator[tuple[int, Message]]) -> None:
        w = self.global_arrays
        keys = [k for k, v in w.items() if v.is_floating_point()]
        base = flatten(w, keys)
        signs = torch.zeros_like(base)  # Σ_k sign(Δ_k): integers, exact in float32 below 2**24
        count = 0

        def counted() -> Iterator[Message]:
            nonlocal count
            for _, msg in replies:
                signs.add_(flatten(msg.arrays, keys).sub_(base).sign_())
                count += 1
                yield msg

        mean, _ = weighted_mean(counted())
        if mean is None:  # every update of the round was rejected: keep the model
            return
        # A = |Σ sign|/K takes K + 1 values: m for each, in float64, then looked up per coordinate
        table = [1.0 if s / count >= self.hp.tau else s / count for s in range(count + 1)]
        mask = torch.tensor(table, dtype=torch.float64)[signs.abs_().long()]
        lr = self.hp.server_lr
        new = flatten(  # FedAvg's step, expression for expression, where m = 1
            mean if lr == 1.0 else {k: w[k] + lr * (mean[k] - w[k]) for k in keys}, keys
        )
        scaled = (mask < 1.0).nonzero().squeeze(1)  # where m = A < 1: w + η·A·(mean − w)
        w64, mean64 = base[scaled].double(), flatten(mean, keys)[scaled].double()
        new[scaled] = (w64 + lr * mask[scaled] * (mean64 - w64)).to(new.dtype)
        out = unflatten(new, {k: w[k] for k in keys})
        self.global_arrays = {k: out[k] if k in out else mean[k] for k in w}
        self.last = {
            "masked_fraction": scaled.numel() / max(mask.numel(), 1),
            "mean_mask": float(mask.mean()),
        }

    def diagnostics(self) -> dict[str, Any]:
        """The share of coordinates whose update was scaled down (m < 1) and the mean mask, in
        the latest round."""
        return {"gma": dict(self.last)} if self.last else {}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last": dict(self.last)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.last = dict(state["last"])


register(
    MethodSpec(
        "fedgma",
        FedGMAServer,
        FedAvgClient,
        FedGMAHparams,
        description=(
            "FedGMA: FedAvg with the server step masked by the clients' per-coordinate sign "
            "agreement (Tenison et al., TMLR 2023)"
        ),
        # hfedf.md Table 10 grids {0.3, 0.5, 0.7} and {1e-2, 1e-1, 1} (fisc.md §6: 0.4, 1)
        space={"tau": Uniform(0.3, 0.7), "server_lr": LogUniform(1e-2, 1.0)},
    )
)
