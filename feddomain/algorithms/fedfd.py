"""FedFD (Yang, Choi, Park, Choi, Chang & Yun, "Feature Diversification and Adaptation for
Federated Domain Generalization", ECCV 2024): federated feature diversification. Only the
paper's poster was available; where it leaves a choice open, the choice is an option here.

Rule. Every BatchNorm2d becomes a ``FedFDBatchNorm2d`` (``models/fedfd_bn.py``; the model hook).
The state is federated SiloBN-style through the engine's layout categories
(``federation/layout.py``): the running statistics are **local** (each client keeps its own and
uploads them), the global statistics ``global_mean``/``global_var`` of every layer are
**computed** by the server — the sample-weighted mean of the clients' running mean and running
variance (§3.5; CHOICE: the plain mean of the variances, what FedAvg does to BN buffers) — and
pushed every round; everything else (convolutions, BN affine γ/β, classifier) is **shared**
(FedAvg'd). Before round 1 the global statistics are the initial model's running statistics
(ImageNet's for a pretrained backbone); ``warmup`` replaces them by a statistics pass (§3.5):
every client runs its data once through the model (PreciseBN's exact mean over batches, no
gradient step) and the server averages the results.

Client loss per batch (§3.4), x a batch, E the featurizer, C the classifier:

    f   = E(x) with BatchNorm in mode "batch"                      (running statistics update)
    f_Δ = E(x) with every layer mixing local and global statistics, a = u per layer
    L   = CE(C(f), y) + λ_F · mean_b ||f[b] − f_Δ[b]||² + λ_C · CE(C(f_Δ), y)

``u`` = None draws u ~ U(0,1) per layer per forward (the method); a number fixes it (the
poster's mixing ablation: 0 global only, 1 instance only, 0.5). ``local_stats`` (CHOICE F1):
instance statistics (default) or batch statistics. ``u_per_sample`` (F2): one u per sample.
λ_F = λ_C = 1 (F3). F3's documented fallback when CAFL dominates, λ_F = 1/d (a per-dimension
mean over the d feature dimensions), is ``feature_loss: mean``, for any width d; λ_F then
weighs that mean (a search over λ_F covers either form). F3 asks to monitor CAFL against CE:
each client reports the mean of each (unweighted) term over its steps, and the server logs
their sample-weighted means and CAFL/CE with every evaluated round (``diagnostics.loss_terms``
in metrics.jsonl; CAFL as the loss reads it, summed or averaged).

Evaluation (id and unseen domain): ``test_mode`` picks the layers' eval mode — ``global`` (FedFD's
inference, §3.6: eval-mode BatchNorm with the global statistics), ``local`` (each client's own
running statistics; for the unseen domain their sample-weighted mean: SiloBN's), or the
test-time variants of the poster's table (§6): ``instance`` (TBN), ``fixed`` (a =
``test_alpha``), ``random`` (a ~ U(0,1) per layer and test sample). Training does not depend on
``test_mode``. Only ``local`` reads a client's running statistics: in every other mode the
clients predict with one shared model, scored once per evaluation. With λ_F = λ_C = 0 and
``test_mode: local`` FedFD is SiloBN, number for number.

Refused when the config loads: a model without BatchNorm statistics, a backbone whose BatchNorm
statistics are frozen (``freeze_bn_stats``: the local statistics would never be estimated), u or
alpha outside [0, 1].
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, ValidationInfo, field_validator
from torch import nn

from feddomain.algorithms.base import (
    ClientAlgorithm,
    ClientContext,
    Hparams,
    MethodSpec,
    ServerContext,
    model_requirement,
)
from feddomain.algorithms.layout import LayoutClient, LayoutServer, LayoutStation
from feddomain.algorithms.registry import register
from feddomain.algorithms.silobn import needs_batchnorm_statistics
from feddomain.algorithms.space import LogUniform
from feddomain.federation.layout import (
    LOCAL,
    StateLayout,
    batchnorm_arrays,
    load_local,
    store_local,
)
from feddomain.federation.messages import Message, weighted_mean
from feddomain.federation.privacy import Uploads
from feddomain.federation.training import (
    LossFn,
    TrainStats,
    get_arrays,
    recalibrate_batchnorm,
    set_arrays,
)
from feddomain.models.fedfd_bn import (
    BNMode,
    bn_mode,
    convert_batchnorm,
    fedfd_layers,
    set_bn_mode,
)

Arrays = dict[str, torch.Tensor]
GLOBAL_STATISTICS = {"global_mean": "running_mean", "global_var": "running_var"}
OTHER_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm3d, nn.SyncBatchNorm)  # left as they are


class FedFDHparams(Hparams):
    """FedFD's hyper-parameters; the spec's open choices (F1-F3) are options."""

    local_stats: Literal["instance", "batch"] = "instance"
    """Local statistics the diversified path mixes with the global ones: each sample's
    `instance` statistics or the `batch`'s (the paper's poster leaves this open)."""
    u: float | None = Field(None, ge=0.0, le=1.0)
    """u: weight of the local statistics in the diversified path's mix (0: global only, 1: local
    only); null: drawn u ~ U(0, 1) per layer and forward pass (the method)."""
    u_per_sample: bool = False
    """With `u: null`, each layer draws one u per sample instead of one shared by the batch."""
    lambda_feature: float = Field(1.0, ge=0.0)
    """λ_F: weight of the client-agnostic feature loss (CAFL, mean squared distance between the
    ordinary and the diversified features); 0: off."""
    feature_loss: Literal["sum", "mean"] = "sum"
    """CAFL over the feature dimensions: their `sum` (the poster's squared L2 norm) or their
    `mean` (the spec's fallback λ_F = 1/d, for features so wide that the sum swamps CE)."""
    lambda_classifier: float = Field(1.0, ge=0.0)
    """λ_C: weight of the client-agnostic classifier loss (CACL, cross-entropy of the
    diversified features); 0: off."""
    test_mode: Literal["global", "local", "instance", "fixed", "random"] = "global"
    """BatchNorm statistics at evaluation: `global` (FedFD's inference), `local` (each client's
    own; the unseen domain gets their sample-weighted mean, SiloBN's), `instance` (the test
    sample's), `fixed` (mix with weight `test_alpha`) or `random` (weight ~ U(0, 1) per layer
    and sample)."""
    test_alpha: float = Field(0.5, ge=0.0, le=1.0)
    """Weight of the test sample's instance statistics against the global ones under
    `test_mode: fixed`."""
    warmup: bool = False
    """Before round 1, set the global statistics from one pass of every client's data (no
    gradient step) instead of the initial model's (for a model trained from scratch)."""

    @field_validator("u_per_sample")
    @classmethod
    def _per_sample_needs_random_u(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("u") is not None:
            raise ValueError("draws u per sample, so algorithm.u must be unset (random u)")
        return value


# fedfda.md §4 fixes both loss weights at 1 (a CHOICE, no grid): x/10 .. x10 around it
FEDFD_SPACE = {"lambda_feature": LogUniform(0.1, 10.0), "lambda_classifier": LogUniform(0.1, 10.0)}
# which statistics a scored model's layers use: nothing training reads (`feddomain rescore`)
TEST_TIME = ("test_mode", "test_alpha")


def diversify_mode(hp: FedFDHparams) -> BNMode:
    """The BatchNorm mode of the diversified path f_Δ."""
    if hp.u is None:
        return BNMode("random", per_sample=hp.u_per_sample, local_stats=hp.local_stats)
    return BNMode("fixed", alpha=hp.u, local_stats=hp.local_stats)


def evaluation_mode(hp: Hparams) -> BNMode:
    """The layers' eval mode for ``hp.test_mode`` (``random``: one a per layer and sample)."""
    kind = "batch" if hp.test_mode == "local" else hp.test_mode
    return BNMode(kind, alpha=hp.test_alpha, per_sample=True)


def reads_running_statistics(hp: Hparams) -> bool:
    """Whether evaluation reads the layers' running statistics (a client's local arrays):
    only eval mode ``batch`` does (``test_mode: local``)."""
    return evaluation_mode(hp).kind == "batch"


def prepare_model(model: nn.Module, hp: Hparams, adapter_reduction: int | None) -> nn.Module:
    """Convert every BatchNorm2d and set the evaluation mode."""
    convert_batchnorm(model, adapter_reduction)
    set_bn_mode(model, evaluation_mode(hp), training=False)
    return model


def fedfd_model(model: nn.Module, hp: Hparams) -> nn.Module:
    """The model hook of FedFD (no adapters)."""
    return prepare_model(model, hp, None)


def global_statistics_arrays(model: nn.Module) -> tuple[str, ...]:
    """State-dict names of every FedFD layer's global statistics."""
    return tuple(
        f"{_prefix(name)}{leaf}" for name, _ in fedfd_layers(model) for leaf in GLOBAL_STATISTICS
    )


def fedfd_layout(model: nn.Module, hp: Hparams) -> StateLayout:
    """Running statistics local, global statistics server-computed, the rest shared."""
    return StateLayout(
        local=batchnorm_arrays(model, affine=False), computed=global_statistics_arrays(model)
    )


def global_statistics(computed: tuple[str, ...], local_mean: Arrays) -> Arrays:
    """μ_G, σ²_G of every layer: the mean of the clients' running mean and running variance."""
    out = {}
    for name in computed:
        owner, _, leaf = name.rpartition(".")
        out[name] = local_mean[f"{_prefix(owner)}{GLOBAL_STATISTICS[leaf]}"].clone()
    return out


def _prefix(module_name: str) -> str:
    return f"{module_name}." if module_name else ""


Terms = dict[str, list[torch.Tensor]]  # each loss term's per-step values (detached)
TERMS = ("ce", "cafl", "cacl")
ADAPTER_TERMS = ("adapter_ce",)  # FedFD-A's L_A


def fedfd_loss(hp: FedFDHparams, terms: Terms | None = None) -> LossFn:
    """CE on the ordinary path plus the client-agnostic feature and classifier losses on the
    diversified path (module docstring); each step's unweighted terms go to ``terms``."""
    diversified_mode = diversify_mode(hp)

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        features = model.featurizer(x)  # train mode "batch": the layers' rest mode
        ce = F.cross_entropy(model.classifier(features), y)
        with bn_mode(model, diversified_mode):
            diversified = model.featurizer(x)
        squared = (features - diversified).pow(2)
        cafl = (squared.sum(dim=1) if hp.feature_loss == "sum" else squared.mean(dim=1)).mean()
        cacl = F.cross_entropy(model.classifier(diversified), y)
        if terms is not None:
            for name, value in zip(TERMS, (ce, cafl, cacl), strict=True):
                terms.setdefault(name, []).append(value.detach())
        return ce + hp.lambda_feature * cafl + hp.lambda_classifier * cacl

    return loss


def mean_terms(terms: Terms) -> dict[str, float]:
    """Each term's mean over the steps (the scalars a client reports)."""
    return {name: float(torch.stack(values).mean()) for name, values in terms.items() if values}


def weighted_terms(replies: list[Message]) -> dict[str, float]:
    """Sample-weighted mean of each loss term the replies report."""
    total = sum(float(m.scalars["num_examples"]) for m in replies)
    names = [k for k in replies[0].scalars if k in (*TERMS, *ADAPTER_TERMS)]
    return {
        k: sum(float(m.scalars["num_examples"]) * float(m.scalars[k]) for m in replies) / total
        for k in names
    }


class FedFDServer(LayoutServer):
    layout = staticmethod(fedfd_layout)

    def __init__(self, ctx: ServerContext, hp: Hparams) -> None:
        super().__init__(ctx, hp)
        self.terms: dict[str, float] = {}  # the latest round's sample-weighted loss terms

    def compute(self, local_mean: Arrays) -> Arrays:
        return global_statistics(self.categories.computed, local_mean)

    def eval_arrays(self, cid: int | None) -> Arrays | None:
        """SiloBN's unseen-domain model (the mean running statistics) under ``test_mode:
        local``; in any other mode the clients' one shared model is it (``FedFDClient``)."""
        if cid is None and not reads_running_statistics(self.hp):
            return None
        return super().eval_arrays(cid)

    def aggregate(self, rnd: int, replies: Iterator[tuple[int, Message]]) -> None:
        seen: list[Message] = []

        def tee() -> Iterator[tuple[int, Message]]:
            for cid, msg in replies:
                seen.append(Message(msg.task, {}, msg.scalars))
                yield cid, msg

        super().aggregate(rnd, tee())
        if seen:
            self.terms = weighted_terms(seen)

    def diagnostics(self) -> dict[str, Any]:
        """The latest round's mean loss terms (unweighted by λ) and CAFL/CE, the ratio to watch
        (fedfda.md F3: the fallback ``feature_loss: mean`` when CAFL dominates)."""
        if not self.terms.get("ce"):
            return {}
        ratio = self.terms["cafl"] / self.terms["ce"]
        return {"loss_terms": {**self.terms, "cafl_over_ce": ratio}}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "terms": dict(self.terms)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.terms = dict(state["terms"])

    def collect(self, clients: list[int]) -> dict[int, Message]:
        """The statistics warm-up task (``warmup``), before round 1."""
        if not self.hp.warmup:
            return {}
        return dict.fromkeys(clients, Message("collect", self.global_arrays))

    def on_collect(self, replies: dict[int, Message]) -> None:
        """Global statistics from the clients' warm-up statistics (sample-weighted)."""
        mean, _ = weighted_mean(replies.values())
        if mean is None:
            return
        self.local_mean = {**self.local_mean, **self.categories.select(mean, LOCAL)}
        self.global_arrays = {**self.global_arrays, **self.compute(self.local_mean)}


class FedFDClient(LayoutClient):
    layout = staticmethod(fedfd_layout)

    term_names: tuple[str, ...] = TERMS  # the loss terms a reply reports (their means)
    terms: Terms | None = None  # this fit's loss terms, per step

    def run(self, msg: Message, ctx: ClientContext) -> Message:
        if msg.task == "collect":
            return self.warm_up(msg, ctx)
        reply = super().run(msg, ctx)
        reply.scalars.update(mean_terms(self.terms or {}))
        return reply

    def train(self, arrays: Arrays, msg: Message, ctx: ClientContext) -> TrainStats:
        self.terms = {}
        return super().train(arrays, msg, ctx)

    def warm_up(self, msg: Message, ctx: ClientContext) -> Message:
        """One pass of the client's data in mode "batch", no gradient step: its running
        statistics (kept as its local arrays, and sent for the global statistics)."""
        set_arrays(ctx.model, {**msg.arrays, **load_local(ctx.state)})
        recalibrate_batchnorm(ctx.model, ctx.train, ctx.batch_size, ctx.generator)
        local = self.categories(ctx.model).select(get_arrays(ctx.model), LOCAL)
        store_local(ctx.state, local)
        return Message("collect", local, {"num_examples": len(ctx.train)})

    def loss_fn(self, msg: Message, ctx: ClientContext) -> LossFn:
        return fedfd_loss(self.hp, self.terms)

    def eval_arrays(self, arrays: Arrays | None, ctx: ClientContext) -> Arrays:
        """The offer with this client's running statistics under ``test_mode: local``, the
        only mode that reads them. Any other mode predicts the same from the offer alone, so
        every client returns the offer itself: one shared model, whose target domains are
        scored once per evaluation instead of once per client (``random``: one draw of the
        mixing weights, not one per client)."""
        if reads_running_statistics(self.hp):
            return super().eval_arrays(arrays, ctx)
        return ClientAlgorithm.eval_arrays(self, arrays, ctx)

    def uploads(self, n_clients: int) -> Uploads:
        """The trained shared arrays and the running statistics (per-channel means and
        variances, no per-sample data), never the global statistics the server computed; the
        sample count, mean training loss and the mean of each loss term."""
        return Uploads(
            model=("*",),
            withheld=tuple(f"*{leaf}" for leaf in GLOBAL_STATISTICS),
            scalars=("num_examples", "loss", *self.term_names),
        )


class FedFDStation(LayoutStation):
    layout = staticmethod(fedfd_layout)


def frozen_statistics(model: nn.Module, hp: Hparams) -> str | None:
    """Why FedFD cannot train ``model`` (no BatchNorm statistics, frozen ones, or a BatchNorm
    layer it does not convert, whose running statistics every test mode would read), or
    None."""
    problem = needs_batchnorm_statistics(model, hp)
    if problem is None and getattr(model, "freeze_bn_stats", False):
        return (
            "estimates each client's BatchNorm statistics, and this model freezes them "
            "(model.options.freeze_bn_stats: set it false)"
        )
    unconverted = [name for name, module in model.named_modules()
                   if isinstance(module, OTHER_BATCHNORMS)]  # fmt: skip
    if problem is None and unconverted:
        return (
            "mixes the statistics of BatchNorm2d layers only, and this model has other "
            f"BatchNorm layers ({', '.join(unconverted)})"
        )
    return problem


def check(method: str) -> Callable:
    return model_requirement(method, frozen_statistics)


register(
    MethodSpec(
        "fedfd",
        FedFDServer,
        FedFDClient,
        FedFDHparams,
        station=FedFDStation,
        description="FedFD: SiloBN whose clients diversify features by mixing instance and "
        "global BatchNorm statistics, with client-agnostic losses (Yang et al., ECCV 2024)",
        model_hook=fedfd_model,
        check_config=check("fedfd"),
        space=FEDFD_SPACE,
        evaluation_only=TEST_TIME,
        image_only="diversifies BatchNorm statistics, which text models do not have",
    )
)
