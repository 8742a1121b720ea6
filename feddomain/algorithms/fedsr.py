"""FedSR (Nguyen, Torr & Lim, "FedSR: A Simple and Effective Domain Generalization Method for
Federated Learning", NeurIPS 2022): a probabilistic representation, regularised locally; FedAvg
aggregation.

The model hook turns any featurizer/classifier model into
``featurizer → Linear(·, 2·z_dim) → (μ, σ = softplus(·)) → z → classifier(z_dim → C)`` and adds
the class-conditional priors ``r_mu`` [C, z_dim] (init 0), ``r_sigma`` [C, z_dim] (init 1, used
through softplus) and, in the scaled KL form, the scalar ``C`` (init 1). They are model
parameters, trained by the client optimiser and averaged like every weight (FedAvg). Each client
minimises, per batch,

    CE(classifier(z), y) + α_L2R · L2R(z) + α_CMI · mean_b Σ_d KL_bd

    z = μ + σ ⊙ ε, ε ~ N(0, I)                               (reparameterised; ``sample``)
    L2R = mean_b ‖z_b‖₂          (``l2r: norm``, the official code, FL-bench, hfedatm.md §6)
        = mean_b ‖z_b‖₂²         (``l2r: squared``, the paper's E‖z‖², hfedf.md §6)
    KL  = KL(N(C·μ, C·σ) ‖ N(r_μ[y], softplus(r_σ)[y]))    (``kl: scaled``, official code,
                                                             FL-bench, hfedatm.md §6)
        = KL(N(μ, σ) ‖ N(r_μ[y], softplus(r_σ)[y]))        (``kl: plain``, hfedf.md §6; no C)

with the closed form KL(N(a, s²) ‖ N(m, r²)) = log r − log s + (s² + (a − m)²)/(2r²) − ½ per
dimension. A term whose coefficient is 0 is not computed (as in the official code).

Spec forms, as named options (defaults: the FL-bench form of hfedatm.md §6 and §4, which is also
the authors' released code):

- ``head``: ``append`` adds the Linear(n_features → 2·z_dim) after the featurizer (FL-bench,
  hfedatm.md; on cached frozen features it is FedVR's adapter, fedvr.md §6: ``z_dim: 512``);
  ``replace`` swaps the featurizer's last Linear for one with 2·z_dim outputs (hfedf.md §6's
  CHOICE for its CNN: 2592 → 2·256 replaces 2592 → 256); ``auto`` (default) replaces when the
  featurizer ends with a Linear (the hFedF CNN) and appends otherwise (LeNet-5 ends with tanh,
  the small BN CNN with a pooled flatten).
- ``z_dim``: default the model's feature width (FL-bench; hfedf.md's 256 for its CNN).
- ``eval_z``: ``mean`` (default; hfedf.md §6: predict with z = μ, deterministic) or ``sample``
  (hfedatm.md §5's CHOICE: one z drawn per image, from a generator reset to a fixed seed each
  time the model enters eval mode, so evaluation stays deterministic and resumable).
- FISC's two optimiser settings (fisc.md §6: "as released", Adam lr 3e-5, wd 0; "as intended",
  SGD lr 0.002, momentum 0.9, wd 5e-4; α = (0.01, 0.001)) are ``train:`` settings, shipped as
  ``configs/baselines/fedsr_fisc_{released,intended}.yaml``.

CHOICEs: no ReLU around the (μ, σ) layer (the authors' code has none; FL-bench's two ReLUs clamp
μ ≥ 0 and are in no spec). Training noise ε comes from torch's RNG, which the runner seeds per
(seed, round, client) before every task, so runs (and Flower nodes) are deterministic. The
official code averages the softmax of 20 samples at test time; neither spec asks for it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from feddomain.algorithms.base import ClientContext, Hparams, MethodSpec
from feddomain.algorithms.fedavg import FedAvgClient, FedAvgHparams, FedAvgServer
from feddomain.algorithms.registry import register
from feddomain.algorithms.space import LogUniform
from feddomain.errors import ConfigError, FeddomainError
from feddomain.federation.messages import Message
from feddomain.federation.training import LossFn
from feddomain.models.base import FeatureClassifier

EVAL_SEED = 0  # the eval-mode noise stream of ``eval_z: sample`` restarts here at every eval()


class FedSRHparams(FedAvgHparams):
    """FedSR's hyper-parameters: FedAvg's server step, the representation and its regularisers
    (defaults FL-bench's; hfedf.md Table 10 has α_L2R = 0.1 on PACS, FISC's code α_CMI = 1e-3)."""

    z_dim: int | None = Field(None, ge=1)
    """Dimension of the representation z; null: the model's feature width."""
    alpha_l2r: float = Field(1e-2, ge=0.0)
    """α_L2R: weight of the L2 representation regulariser (the batch mean of ‖z‖₂, see `l2r`);
    0: off."""
    alpha_cmi: float = Field(5e-4, ge=0.0)
    """α_CMI: weight of the conditional mutual information regulariser (KL from p(z|x) to the
    learned class-conditional prior r(z|y)); 0: off."""
    l2r: Literal["norm", "squared"] = "norm"
    """L2R's form: `norm` (mean ‖z‖₂, the authors' code) or `squared` (mean ‖z‖₂², the paper's
    E‖z‖²)."""
    kl: Literal["scaled", "plain"] = "scaled"
    """CMI's KL: `scaled` (the authors' code: p(z|x)'s mean and scale multiplied by a learned
    scalar C) or `plain` (no C)."""
    head: Literal["auto", "append", "replace"] = "auto"
    """Where the (μ, σ) layer goes: `append` a Linear(features → 2·z_dim) after the featurizer,
    `replace` the featurizer's last Linear, or `auto` (replace when it ends with a Linear)."""
    sample: bool = True
    """Train on a sampled z = μ + σ·ε (reparameterised); false: z = μ (a deterministic
    ablation)."""
    eval_z: Literal["mean", "sample"] = "mean"
    """z at evaluation: `mean` (z = μ) or `sample` (one seeded draw per image, deterministic
    across evaluations)."""


class FedSRModel(FeatureClassifier):
    """``classifier(z)`` with z drawn from N(μ(x), σ(x)²) in training, z = μ in eval mode (or a
    seeded draw with ``eval_z="sample"``). ``featurizer`` is the backbone (its last Linear
    replaced in ``replace`` mode); ``map_layer`` the appended (μ, σ) layer (an Identity in
    ``replace`` mode); ``n_features`` is z_dim."""

    def __init__(
        self,
        featurizer: nn.Module,
        map_layer: nn.Module,
        classifier: nn.Module,
        *,
        z_dim: int,
        num_classes: int,
        scaled: bool,
        sample: bool,
        eval_z: str,
        freeze_bn_stats: bool = False,
    ) -> None:
        super().__init__(featurizer, classifier, z_dim, freeze_bn_stats=freeze_bn_stats)
        self.map_layer = map_layer
        self.z_dim = z_dim
        self.r_mu = nn.Parameter(torch.zeros(num_classes, z_dim))
        self.r_sigma = nn.Parameter(torch.ones(num_classes, z_dim))
        self.C = nn.Parameter(torch.ones(())) if scaled else None
        self.sample = sample
        self.eval_z = eval_z
        self._eval_generator = torch.Generator().manual_seed(EVAL_SEED)

    def distribution(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(μ, σ) of p(z | x), each [B, z_dim]; σ = softplus of the second half."""
        h = self.map_layer(self.featurizer(x))
        return h[:, : self.z_dim], F.softplus(h[:, self.z_dim :])

    def represent(self, mu: Tensor, sigma: Tensor) -> Tensor:
        """The z the classifier sees: a reparameterised draw in training (μ with
        ``sample=False``); μ in eval mode, or a draw from the eval generator."""
        if self.training:
            return mu + sigma * torch.randn_like(mu) if self.sample else mu
        if self.eval_z == "mean":
            return mu
        eps = torch.randn(mu.shape, generator=self._eval_generator, dtype=mu.dtype)
        return mu + sigma * eps.to(mu.device)

    def forward(self, x: Tensor) -> Tensor:
        mu, sigma = self.distribution(x)
        return self.classifier(self.represent(mu, sigma))

    def train(self, mode: bool = True) -> FedSRModel:
        super().train(mode)
        if not mode:  # every evaluation draws the same noise stream (eval_z: sample)
            self._eval_generator = torch.Generator().manual_seed(EVAL_SEED)
        return self


def probabilistic_head(model: nn.Module, hp: Hparams) -> FedSRModel:
    """FedSR's model hook: the (μ, σ) layer, the z-space classifier and the priors."""
    name = type(model).__name__
    featurizer = getattr(model, "featurizer", None)
    classifier = getattr(model, "classifier", None)
    if not isinstance(model, FeatureClassifier) or featurizer is None or classifier is None:
        raise ConfigError(
            f"fedsr needs a model split into featurizer and classifier (a FeatureClassifier); "
            f"{name} has no such split"
        )
    if not isinstance(classifier, nn.Linear):
        raise ConfigError(
            f"fedsr: the classifier of {name} is a {type(classifier).__name__}, not one Linear "
            "layer, so it cannot be rebuilt on z"
        )
    num_classes = classifier.out_features
    last = list(featurizer.children())[-1] if isinstance(featurizer, nn.Sequential) else None
    replace = hp.head == "replace" or (hp.head == "auto" and isinstance(last, nn.Linear))
    if replace:
        if not isinstance(last, nn.Linear):
            ends = type(last if last is not None else featurizer).__name__
            raise ConfigError(
                f"'algorithm.head': replace needs a featurizer ending with a Linear layer; "
                f"{name}'s ends with {ends} (use head: append)"
            )
        z_dim = hp.z_dim or last.out_features
        children = list(featurizer.named_children())
        *keep, (last_name, _) = children
        layer = nn.Linear(last.in_features, 2 * z_dim, bias=last.bias is not None)
        featurizer = nn.Sequential(OrderedDict([*keep, (last_name, layer)]))
        map_layer: nn.Module = nn.Identity()
    else:
        z_dim = hp.z_dim or model.n_features
        map_layer = nn.Linear(model.n_features, 2 * z_dim)
    if classifier.in_features != z_dim:
        classifier = nn.Linear(z_dim, num_classes)
    wrapped = FedSRModel(
        featurizer,
        map_layer,
        classifier,
        z_dim=z_dim,
        num_classes=num_classes,
        scaled=hp.kl == "scaled",
        sample=hp.sample,
        eval_z=hp.eval_z,
        freeze_bn_stats=model.freeze_bn_stats,
    )
    wrapped.arch = model.arch
    return wrapped


def l2r_term(z: Tensor, form: str = "norm") -> Tensor:
    """mean_b ‖z_b‖₂ (``norm``) or mean_b ‖z_b‖₂² (``squared``)."""
    return z.norm(dim=1).mean() if form == "norm" else z.pow(2).sum(dim=1).mean()


def cmi_term(model: FedSRModel, mu: Tensor, sigma: Tensor, y: Tensor) -> Tensor:
    """mean over the batch of KL(N(C·μ, C·σ) ‖ N(r_μ[y], softplus(r_σ)[y])), summed over z's
    dimensions (C = 1 in the plain form)."""
    r_mu = model.r_mu[y]
    r_sigma = F.softplus(model.r_sigma)[y]
    if model.C is not None:
        mu, sigma = mu * model.C, sigma * model.C
    kl = (
        torch.log(r_sigma)
        - torch.log(sigma)
        + (sigma.pow(2) + (mu - r_mu).pow(2)) / (2 * r_sigma.pow(2))
        - 0.5
    )
    return kl.sum(dim=1).mean()


def fedsr_loss(hp: FedSRHparams):
    """The per-batch objective CE + α_L2R·L2R + α_CMI·CMI (a ``ctx.fit`` loss function)."""

    def loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        mu, sigma = model.distribution(x)
        z = model.represent(mu, sigma)
        out = F.cross_entropy(model.classifier(z), y)
        if hp.alpha_l2r != 0.0:
            out = out + hp.alpha_l2r * l2r_term(z, hp.l2r)
        if hp.alpha_cmi != 0.0:
            out = out + hp.alpha_cmi * cmi_term(model, mu, sigma, y)
        return out

    return loss


class FedSRClient(FedAvgClient):
    """FedAvg's client with FedSR's objective; it sends the whole model (priors included)."""

    def loss_fn(self, msg: Message, ctx: ClientContext) -> LossFn:
        if not isinstance(ctx.model, FedSRModel):
            raise FeddomainError(
                "fedsr's client needs fedsr's model hook (the probabilistic head); the model "
                f"is a plain {type(ctx.model).__name__}"
            )
        return fedsr_loss(self.hp)


register(
    MethodSpec(
        "fedsr",
        FedAvgServer,
        FedSRClient,
        FedSRHparams,
        description="FedSR: probabilistic representation with L2R and CMI regularisers, FedAvg "
        "aggregation (Nguyen, Torr & Lim, NeurIPS 2022)",
        model_hook=probabilistic_head,
        # L2R: hfedf.md Table 10 grid {1e-3, 1e-2, 1e-1}; CMI: x/10 .. x10 around 5e-4
        space={"alpha_l2r": LogUniform(1e-3, 1e-1), "alpha_cmi": LogUniform(5e-5, 5e-3)},
        evaluation_only=("eval_z",),
    )
)
