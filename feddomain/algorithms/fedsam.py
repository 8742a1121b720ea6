"""FedSAM (Caldarola, Caputo, Ciccone, "Improving generalization in federated learning by seeking
flat minima", ECCV 2022; also Qu et al., "Generalized federated learning via sharpness aware
minimization", ICML 2022): FedAvg whose clients minimise with SAM (Foret et al., ICLR 2021).

The rule implemented (fedfda.md §6, "sharpness-aware local minimisation"), for every batch:

    g  = ∇L(w)                      at the current weights
    ε  = ρ · g / ‖g‖₂               ‖·‖ over all trained parameters together (ε = 0 if g = 0)
    w ← step of the configured optimiser with the gradient ∇L(w + ε), taken at w

The server is FedAvg's (sample-weighted mean, ``server_lr``). ρ ≥ 0; default ρ = 0.05, SAM's
standard radius (Foret et al., ICLR 2021; fedfda.md gives no value for FedSAM); ρ = 0 is FedAvg
exactly (tested).

It runs through the shared loop with no change to it: ``sam_loss`` wraps the loss. Its first pass
computes g with ``torch.autograd.grad`` (``.grad`` untouched), moves the parameters to w + ε,
computes ∇L(w + ε), puts the saved values of w back (a copy, not ``w + ε − ε``), and returns a
surrogate whose value is L(w) and whose gradient is exactly ∇L(w + ε) (``Σ ⟨p, ∇L(w + ε)⟩``
minus its own detached value, plus L(w) detached); the loop's ``backward`` then leaves ∇L(w + ε)
in ``.grad``, clips it if ``train.grad_clip`` is set, and steps the optimiser at w.

CHOICES:

- The perturbed pass reuses the first pass's random draws (dropout): the global RNG is rewound
  before it, so both gradients are of the same stochastic loss, and it ends where the first pass
  left it, so the RNG stream is FedAvg's. (The reference SAM code draws new masks.)
- BatchNorm running statistics are those of the first pass at w: the buffers the perturbed pass
  updates are restored afterwards.
- No 1e-12 is added to ‖g‖ (the reference SAM code does): ε is exactly ρ·g/‖g‖, and 0 when g = 0.
- The reported training loss is L(w), as FedAvg's.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import nn

from feddomain.algorithms.base import ClientContext, MethodSpec
from feddomain.algorithms.fedavg import FedAvgClient, FedAvgHparams, FedAvgServer
from feddomain.algorithms.registry import register
from feddomain.algorithms.space import LogUniform
from feddomain.federation.messages import Message
from feddomain.federation.training import LossFn, cross_entropy_loss


class FedSAMHparams(FedAvgHparams):
    """FedSAM's hyper-parameters: FedAvg's server step and SAM's radius."""

    rho: float = Field(0.05, ge=0.0)
    """ρ: SAM's neighbourhood radius; each step takes the gradient at w + ρ·g/‖g‖₂ (the norm
    over all trained parameters); 0 is FedAvg."""


def sam_loss(loss_fn: LossFn, rho: float) -> LossFn:
    """``loss_fn`` made sharpness-aware: the returned loss has the value of ``loss_fn`` at the
    current weights w and, as its gradient, the gradient of ``loss_fn`` at w + ρ·g/‖g‖."""

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        params = [p for p in model.parameters() if p.requires_grad]
        rng = torch.get_rng_state()
        at_w = loss_fn(model, x, y)
        grads = _grads(at_w, params)
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        saved_params = [p.detach().clone() for p in params]
        saved_buffers = [b.detach().clone() for b in model.buffers()]
        with torch.no_grad():
            if float(norm) > 0:
                scale = rho / norm
                for p, g in zip(params, grads, strict=True):
                    p.add_((g.double() * scale).to(p.dtype))
        # the perturbed pass redraws the first pass's dropout masks, so it also leaves the RNG
        # stream where the first pass left it
        torch.set_rng_state(rng)
        sharp = _grads(loss_fn(model, x, y), params)
        with torch.no_grad():
            for p, value in zip(params, saved_params, strict=True):
                p.copy_(value)
            for b, value in zip(model.buffers(), saved_buffers, strict=True):
                b.copy_(value)
        surrogate = sum((p * g).sum() for p, g in zip(params, sharp, strict=True))
        return surrogate - surrogate.detach() + at_w.detach()

    return loss


def _grads(loss: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor]:
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


class FedSAMClient(FedAvgClient):
    """FedAvg's client with the SAM loss: two forward/backward passes per batch."""

    def loss_fn(self, msg: Message, ctx: ClientContext) -> LossFn:
        return sam_loss(cross_entropy_loss, self.hp.rho)


register(
    MethodSpec(
        "fedsam",
        FedAvgServer,
        FedSAMClient,
        FedSAMHparams,
        description=(
            "FedSAM: FedAvg with sharpness-aware (SAM) local minimisation, radius rho "
            "(Caldarola et al., ECCV 2022; Qu et al., ICML 2022)"
        ),
        space={"rho": LogUniform(5e-3, 0.5)},  # x/10 .. x10 around the papers' 0.05
    )
)
