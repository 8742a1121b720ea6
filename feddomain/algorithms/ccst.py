"""CCST (Chen et al., WACV 2023): cross-client style transfer. Spec: fisc.md §6 (as FISC's
comparison runs it).

Round 0 (``algorithms/styled.py``, shared with FISC): every client uploads its overall style —
the channel mean and std of all its images' feature maps pooled (one cluster, no FINCH) — and
the server draws, once and seeded, ``styles_per_client`` (K = 1) styles of *other* clients for
each client and sends them to it. Each round a client trains with
``CE(x) + (1/K) Σ_k CE(x̃_k)``, x̃_k its batch re-rendered in style k (AdaIN, α = 0.5) on the
fly: the style bank augmentation of CCST without storing the augmented images. The server is
FedAvg.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from feddomain.algorithms.base import Arrays, ClientContext, MethodSpec
from feddomain.algorithms.registry import register
from feddomain.algorithms.space import Int, Uniform
from feddomain.algorithms.styled import (
    MEAN,
    STD,
    StyleClient,
    StyleHparams,
    StyleServer,
    check_style_config,
)
from feddomain.errors import ConfigError
from feddomain.federation.messages import Message
from feddomain.federation.topology import derive_seed
from feddomain.federation.training import LossFn
from feddomain.style.statistics import Clustering

CCST_STYLES = 61  # seed purpose of the server's style draw (apart from the runner's purposes)


class CCSTHparams(StyleHparams):
    local_clustering: Clustering = "mean"
    """CCST's overall domain style: `mean` (all images pooled); `finch` gives FISC's style."""
    styles_per_client: int = Field(1, ge=1)
    """K: how many other clients' styles each client renders its batches in (CCST: 1)."""


class CCSTServer(StyleServer):
    """FedAvg with CCST's style bank: each client gets K other clients' styles, drawn once."""

    def derive(self, clients: list[int], rows: torch.Tensor) -> dict[int, Arrays]:
        k = self.hp.styles_per_client
        if k > len(clients) - 1:
            raise ConfigError(
                f"'algorithm.styles_per_client' = {k}: ccst gives each client styles of other "
                f"clients, and only {len(clients) - 1} other client(s) sent one"
            )
        gen = torch.Generator().manual_seed(derive_seed(self.ctx.seed, CCST_STYLES))
        out = {}
        for i, cid in enumerate(clients):
            others = torch.tensor([j for j in range(len(clients)) if j != i])
            picked = rows[others[torch.randperm(len(others), generator=gen)[:k]]]
            mean, std = picked.chunk(2, dim=1)
            out[cid] = {MEAN: mean.contiguous(), STD: std.contiguous()}
        return out


class CCSTClient(StyleClient):
    def loss_fn(self, msg: Message, ctx: ClientContext) -> LossFn:
        self.kept(ctx)  # fails early, naming the client, if the styles never came

        def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            x, styled = self.views(x, ctx)
            total = F.cross_entropy(model(x), y)
            return total + sum(F.cross_entropy(model(v), y) for v in styled) / len(styled)

        return loss


register(
    MethodSpec(
        "ccst",
        CCSTServer,
        CCSTClient,
        CCSTHparams,
        description=(
            "CCST: cross-client style transfer, K other clients' styles fixed before training "
            "(Chen et al., WACV 2023)"
        ),
        check_config=check_style_config,
        space={"styles_per_client": Int(1, 3), "alpha": Uniform(0.2, 1.0)},  # CCST's K, AdaIN α
        image_only="transfers image styles (channel statistics of convolutional feature maps)",
    )
)
