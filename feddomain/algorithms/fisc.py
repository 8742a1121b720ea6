"""FISC / PARDON (Nguyen, Johnson, Leach, arXiv 2410.22622): interpolative style transfer and
contrastive learning. Spec: fisc.md.

Round 0 (``algorithms/styled.py``): every client uploads one style, the mean of its FINCH
clusters' styles; the server takes the element-wise lower median of the FINCH cluster means of
the clients' styles (the *interpolation style*) and sends it to every client once. Each round,
a sampled client re-renders every batch in that style (AdaIN, α = 0.5, no gradient) and trains

    L = CE(C(G(x)), y) + λ_con · triplet(G(x), G(x̃), G(x̃_neg)) + λ_reg · mean(G(x)² + G(x̃)²)

with anchors the originals, positives their re-styled selves and one uniformly drawn re-styled
negative of another class per anchor, all L2-normalised (margin 0.3). The server is FedAvg.
Terms with weight 0 are not computed (no forward of x̃, no draw of negatives), so λ_con = λ_reg
= 0 is FedAvg bit for bit. BatchNorm running statistics stay frozen (``freeze_bn``).

Ablations (fisc.md Table 11): v1 ``local_clustering: mean``, v2 ``server_clustering: mean``,
v3 ``styled_loss: cross_entropy`` (the re-styled images as extra CE data instead of the
triplet term). v4 is not implemented.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from feddomain.algorithms.base import Arrays, ClientContext, Hparams, MethodSpec, ServerContext
from feddomain.algorithms.registry import register
from feddomain.algorithms.space import LogUniform
from feddomain.algorithms.styled import (
    MEAN,
    STD,
    StyleClient,
    StyleHparams,
    StyleServer,
    check_style_config,
)
from feddomain.federation.messages import Message
from feddomain.federation.training import LossFn
from feddomain.style.statistics import Clustering, interpolation_style, style_shift


class FISCHparams(StyleHparams):
    lambda_con: float = Field(0.75, ge=0.0)
    """Weight λ_con of the triplet (contrastive) term (FISC's code: 0.75)."""
    lambda_reg: float = Field(0.2, ge=0.0)
    """Weight λ_reg of the feature L2 penalty (PACS 0.2; Office-Home, IWildCam 0.1)."""
    margin: float = Field(0.3, ge=0.0)
    """Triplet margin m on L2-normalised features."""
    styled_loss: Literal["triplet", "cross_entropy"] = "triplet"
    """How re-styled images enter the loss: `triplet` (FISC) or `cross_entropy` (ablation v3:
    extra CE data with weight 1, no contrastive term)."""
    server_clustering: Clustering = "finch"
    """Interpolation style: `finch` (lower median of the FINCH cluster means of the clients'
    styles) or `mean` (plain mean of the clients' styles; ablation v2)."""
    freeze_bn: bool = True
    """Keep every BatchNorm layer's running statistics frozen during training (pretrained
    backbones; a from-scratch BN model should set false)."""
    projection: bool = False
    """Append Linear(F, F) to the featurizer, as FISC's ResNet-50 replaces fc by
    Linear(2048, 2048); the losses use its output."""


def fisc_model(model: nn.Module, hp: Hparams) -> nn.Module:
    """The projection layer (``projection``) and frozen BatchNorm statistics (``freeze_bn``)."""
    if hp.projection:
        n = model.n_features
        model.featurizer = nn.Sequential(model.featurizer, nn.Linear(n, n))
    if hp.freeze_bn:
        model.freeze_bn_stats = True
    return model


def triplet_term(
    f: torch.Tensor, f_styled: torch.Tensor, y: torch.Tensor, margin: float, gen: torch.Generator
) -> torch.Tensor:
    """mean_i max(0, ‖a_i − p_i‖ − ‖a_i − n_i‖ + m) over anchors with another class in the
    batch: a = f/‖f‖, p = f̃/‖f̃‖ (same image), n = f̃_j/‖f̃_j‖ with j drawn uniformly among the
    batch's other-class images (from ``gen``). 0 for a single-class batch (nothing drawn)."""
    other = y[:, None] != y[None, :]
    valid = other.any(1)
    if not bool(valid.any()):
        return f.new_zeros(())
    draws = torch.rand(other.shape, generator=gen).to(f.device)
    negative = torch.where(other, draws, -1.0).argmax(1)  # uniform over other-class images
    a = F.normalize(f[valid], dim=1)
    p = F.normalize(f_styled[valid], dim=1)
    n = F.normalize(f_styled[negative[valid]], dim=1)
    return F.triplet_margin_loss(a, p, n, margin=margin, p=2, eps=1e-7)


BARELY_RESTYLED = 0.25  # a style shift below this leaves a client's images nearly as they are


class FISCServer(StyleServer):
    """FedAvg with the round-0 interpolation style."""

    def __init__(self, ctx: ServerContext, hp: Hparams) -> None:
        super().__init__(ctx, hp)
        self.clusters = 0  # FINCH clusters of the client styles the median was taken over
        self.shift: dict[int, float] = {}  # each client's distance to the interpolation style

    def derive(self, clients: list[int], rows: torch.Tensor) -> dict[int, Arrays]:
        mean, std, self.clusters = interpolation_style(rows, self.hp.server_clustering)
        shifts = style_shift(rows, torch.cat([mean, std]))
        self.shift = {c: round(float(d), 4) for c, d in zip(clients, shifts, strict=True)}
        style = {MEAN: mean, STD: std}
        return {c: style for c in range(self.ctx.n_clients)}

    def diagnostics(self) -> dict[str, Any]:
        return {"style_clusters": self.clusters}

    def run_summary(self) -> dict[str, Any]:
        """Where the interpolation style sits (FISC's premise: it differs from every client's
        own style): each client's distance to it in units of the median distance between two
        clients' styles, and the share of clients below 0.25 (their images barely change)."""
        if not self.shift:
            return super().run_summary()
        barely = sum(d < BARELY_RESTYLED for d in self.shift.values()) / len(self.shift)
        return {**super().run_summary(), "style_shift": {str(c): d for c, d in self.shift.items()},
                "barely_restyled_share": barely}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "clusters": self.clusters, "shift": self.shift}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.clusters = state["clusters"]
        self.shift = state["shift"]


class FISCClient(StyleClient):
    def loss_fn(self, msg: Message, ctx: ClientContext) -> LossFn:
        self.kept(ctx)  # fails early, naming the client, if the style never came
        hp = self.hp
        styled_ce = hp.styled_loss == "cross_entropy"
        needs_styled = styled_ce or hp.lambda_con > 0 or hp.lambda_reg > 0

        def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            x, (x_styled,) = self.views(x, ctx)  # computed even if unused
            f = model.featurizer(x)
            total = F.cross_entropy(model.classifier(f), y)
            if not needs_styled:
                return total
            f_styled = model.featurizer(x_styled)
            if styled_ce:
                total = total + F.cross_entropy(model.classifier(f_styled), y)
            elif hp.lambda_con > 0:
                total = total + hp.lambda_con * triplet_term(
                    f, f_styled, y, hp.margin, ctx.generator
                )
            if hp.lambda_reg > 0:
                total = total + hp.lambda_reg * (f.pow(2).mean() + f_styled.pow(2).mean())
            return total

        return loss


register(
    MethodSpec(
        "fisc",
        FISCServer,
        FISCClient,
        FISCHparams,
        description=(
            "FISC/PARDON: FINCH-median interpolation style, on-the-fly AdaIN, triplet + L2 "
            "(Nguyen et al., arXiv 2410.22622)"
        ),
        model_hook=fisc_model,
        check_config=check_style_config,
        space={  # x/10 .. x10 around fisc.md §4 (PACS), which gives values and no grid
            "lambda_con": LogUniform(0.075, 7.5),
            "lambda_reg": LogUniform(0.02, 2.0),
            "margin": LogUniform(0.03, 2.0),  # 2: the largest distance of unit vectors
        },
        image_only="transfers image styles (channel statistics of convolutional feature maps)",
    )
)
