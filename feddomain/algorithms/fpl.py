"""FPL (Huang et al., CVPR 2023, "Rethinking federated learning with domain shift: a prototype
view"): federated prototype learning. Spec: fisc.md §6; details from the authors' RethinkFL code.

After local training each client sends, with its model, its class prototypes (the mean feature
of each class it holds). The server clusters each class's prototypes of the round's clients with
FINCH (the shared ``feddomain.clustering``; last partition, early exit off as in RethinkFL) and
keeps the cluster means as that class's *cluster prototypes*; their mean is the class's
*unbiased prototype*. Next round every client trains

    L = CE + λ · (1/B) Σ_i [ InfoNCE_τ(f_i; cluster prototypes of y_i vs. all others)
                            + MSE(f_i, unbiased prototype of y_i) ]

over the anchors whose class has prototypes (τ = 0.02, cosine similarity). The first round, with
no prototypes yet, is FedAvg. Models are averaged as FedAvg's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from feddomain.algorithms.base import ClientContext, Hparams, MethodSpec, ServerContext
from feddomain.algorithms.fedavg import FedAvgClient, FedAvgServer
from feddomain.algorithms.registry import register
from feddomain.algorithms.space import LogUniform
from feddomain.clustering import cluster_means, finch_partitions
from feddomain.federation.messages import Message, weighted_mean
from feddomain.federation.privacy import Uploads
from feddomain.federation.training import LossFn, get_arrays

PROTOS, PROTO_LABELS = "fpl/prototypes", "fpl/prototype_labels"  # server -> clients
LOCAL, PRESENT = "prototypes", "prototype_present"  # client -> server


class FPLHparams(Hparams):
    temperature: float = Field(0.02, gt=0.0)
    """InfoNCE temperature τ over cosine similarities (FPL: 0.02)."""
    weight: float = Field(1.0, ge=0.0)
    """λ: weight of the prototype term (InfoNCE + MSE) added to the CE (FPL: 1)."""


def cluster_prototypes(
    per_class: dict[int, list[torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each class's FINCH cluster means (last partition; one prototype passes through), stacked
    [P, F] with their class labels [P]."""
    protos, labels = [], []
    for c in sorted(per_class):
        rows = torch.stack(per_class[c]).double()
        parts = finch_partitions(rows, early_exit=False)[:, -1]
        means = cluster_means(rows, parts).float()
        protos.append(means)
        labels += [c] * len(means)
    return torch.cat(protos), torch.tensor(labels, dtype=torch.long)


def prototype_term(
    f: torch.Tensor, y: torch.Tensor, protos: torch.Tensor, labels: torch.Tensor, tau: float
) -> torch.Tensor:
    """(1/B) Σ over anchors whose class has prototypes of InfoNCE (positives: the class's cluster
    prototypes; negatives: every other prototype) + MSE to the class's mean cluster prototype."""
    protos = protos.to(f.dtype)
    labels = labels.to(y.device)
    positive = labels[None, :] == y[:, None]  # [B, P]
    valid = positive.any(1)
    if not bool(valid.any()):
        return f.new_zeros(())
    anchors, positive = f[valid], positive[valid]  # rows without a positive would give inf
    sim = F.cosine_similarity(anchors[:, None, :], protos[None, :, :], dim=2) / tau
    infonce = torch.logsumexp(sim, 1) - torch.logsumexp(sim.masked_fill(~positive, -torch.inf), 1)
    unbiased = (positive.to(f.dtype) @ protos) / positive.sum(1, keepdim=True)
    mse = (anchors - unbiased).pow(2).mean(1)
    return (infonce + mse).sum() / f.shape[0]


class FPLServer(FedAvgServer):
    def __init__(self, ctx: ServerContext, hp: Hparams) -> None:
        super().__init__(ctx, hp)
        self.protos = torch.zeros(0, 0)
        self.proto_labels = torch.zeros(0, dtype=torch.long)

    def configure(self, rnd: int, clients: list[int]) -> dict[int, Message]:
        arrays = {**self.global_arrays, PROTOS: self.protos, PROTO_LABELS: self.proto_labels}
        return dict.fromkeys(clients, Message("fit", arrays))

    def aggregate(self, rnd: int, replies: Iterator[tuple[int, Message]]) -> None:
        per_class: dict[int, list[torch.Tensor]] = {}

        def models() -> Iterator[Message]:
            for _, msg in replies:
                present = msg.arrays.pop(PRESENT)
                local = msg.arrays.pop(LOCAL)
                for c in torch.nonzero(present).flatten().tolist():
                    per_class.setdefault(c, []).append(local[c])
                yield msg

        mean, _ = weighted_mean(models())
        if mean is None:
            return
        self.global_arrays = mean
        self.protos, self.proto_labels = cluster_prototypes(per_class)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "protos": self.protos, "labels": self.proto_labels}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.protos, self.proto_labels = state["protos"], state["labels"]


class FPLClient(FedAvgClient):
    def run(self, msg: Message, ctx: ClientContext) -> Message:
        arrays = dict(msg.arrays)
        protos, labels = arrays.pop(PROTOS), arrays.pop(PROTO_LABELS)
        stats = ctx.fit(arrays, loss_fn=self.fpl_loss(protos, labels))
        local, present = local_prototypes(ctx)
        reply = {**get_arrays(ctx.model), LOCAL: local, PRESENT: present}
        return Message("fit", reply, {"num_examples": len(ctx.train), "loss": stats.mean_loss})

    def fpl_loss(self, protos: torch.Tensor, labels: torch.Tensor) -> LossFn:
        tau, weight = self.hp.temperature, self.hp.weight

        def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            f = model.featurizer(x)
            ce = F.cross_entropy(model.classifier(f), y)
            if len(labels) == 0 or weight == 0:
                return ce
            return ce + weight * prototype_term(f, y, protos, labels, tau)

        return loss

    def uploads(self, n_clients: int) -> Uploads:
        """The trained model, and per class the mean feature of this client's images of that
        class (zero rows for absent classes, flagged by ``prototype_present``)."""
        return Uploads(
            model=("*",),
            statistics={LOCAL: (None, None), PRESENT: (None,)},
            scalars=("num_examples", "loss"),
        )


@torch.no_grad()
def local_prototypes(ctx: ClientContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class mean features [K, F] of the client's training images with the trained model
    (eval mode, the training transform) and which classes it holds [K]."""
    model = ctx.model
    model.eval()
    n_classes = [m for m in model.classifier.modules() if isinstance(m, nn.Linear)][-1].out_features
    feats, ys = [], []
    for x, y in ctx.train.batches(ctx.batch_size, ctx.generator, shuffle=False):
        feats.append(model.featurizer(x).float())
        ys.append(y)
    f, y = torch.cat(feats), torch.cat(ys)
    k = n_classes
    sums = torch.zeros(k, f.shape[1], device=f.device).index_add_(0, y, f)
    counts = torch.bincount(y, minlength=k).to(f.dtype)
    return (sums / counts.clamp_min(1)[:, None]).cpu(), (counts > 0).to(torch.float32).cpu()


register(
    MethodSpec(
        "fpl",
        FPLServer,
        FPLClient,
        FPLHparams,
        description=(
            "FPL: FINCH-clustered class prototypes, InfoNCE + MSE to them (Huang et al., CVPR 2023)"
        ),
        space={"temperature": LogUniform(2e-3, 0.2)},  # x/10 .. x10 around fisc.md §6's 0.02
    )
)
