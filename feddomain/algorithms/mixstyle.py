"""MixStyle (Zhou, Yang, Qiao & Xiang, "Domain Generalization with MixStyle", ICLR 2021), applied
inside each client of FedAvg (fedfda.md §6: "centralised DG applied inside each client").

Rule: after chosen convolutional stages, during training only and with probability ``p`` per
forward pass and stage, each sample's feature map x (B×C×H×W) is re-normalised with statistics
mixed with those of another sample of the batch:

    μ, σ = per-sample, per-channel mean and std over H×W,  σ = sqrt(var + ε)   (detached)
    λ ~ Beta(α, α) per sample,  perm a random permutation of the batch
    μ_mix = λ·μ + (1−λ)·μ[perm],  σ_mix = λ·σ + (1−λ)·σ[perm]
    x̂ = σ_mix · (x − μ)/σ + μ_mix

μ and σ are detached, as in the paper's code, so gradients flow through (x − μ)/σ only. In
evaluation mode MixStyle is the identity. Everything else is FedAvg (sample-weighted, the client
sends its whole model), so with ``p = 0`` a run equals FedAvg exactly: nothing is drawn then.

Randomness: the draws (apply or not, λ, the permutation) come from torch's global RNG on the CPU,
which the runner seeds per client task from (seed, purpose, round, client): runs are
deterministic, resume exactly and equal on Flower, and the same on any device.

Insertion (CHOICE): MixStyle registers a forward hook on the modules the model declares as the
ends of its convolutional stages (``FeatureClassifier.stages``), so no parameter name changes.
``blocks`` picks them (1-based); the default ``None`` is every stage but the last, the paper's
rule (early layers carry style, the last one semantics; for ResNet-18 that is res1-res3, the
paper's choice): after conv blocks 1 and 2 of ``small_cnn``'s 3, after conv block 1
(conv1-tanh-pool1) of ``lenet5``'s 2, after layer1-layer3 of ResNet, after block groups 1-6 of
EfficientNet-Lite0's 7 (``blocks: [2, 3, 4]`` matches ResNet's res1-res3 in resolution). A model
declaring no stages (a frozen-feature head) or too few is refused when the config loads. On the
trainable tail of a model cut after stage k (``model.frozen_prefix: k``), MixStyle may follow
stage k: the output of the cut is the tail's input (the cached map), so the layer mixes it as the
tail's featurizer reads it (a forward pre-hook), at the same place in the network as on the whole
model; a stage before k lies inside the cached prefix and is refused.

Hyper-parameters: p = 0.5, α = 0.1 (the paper's defaults), ε = 1e-6 (its code's). The variance
is the paper's (Eq. 2: biased, 1/(HW)·Σ(x − μ)²); its code's unbiased ``torch.var`` scales every
σ by the same sqrt(HW/(HW−1)), which cancels between σ and σ_mix, so both give the same x̂ up
to ε. The paper's "random" mixing is implemented (its "cross-domain" variant needs domain
labels in a batch, which a client does not have).
"""

from __future__ import annotations

from typing import Annotated

import torch
from pydantic import Field, field_validator
from torch import nn

from feddomain.algorithms.base import Hparams, MethodSpec, model_requirement
from feddomain.algorithms.fedavg import FedAvgClient, FedAvgHparams, FedAvgServer
from feddomain.algorithms.registry import register
from feddomain.algorithms.space import LogUniform, Uniform
from feddomain.errors import ConfigError
from feddomain.models.base import warn_small_instance_map


class MixStyleHparams(FedAvgHparams):
    """MixStyle's hyper-parameters: FedAvg's server step and the MixStyle layers'."""

    p: float = Field(0.5, ge=0.0, le=1.0)
    """p: probability that MixStyle mixes, per training forward pass and stage; 0 is FedAvg."""
    alpha: float = Field(0.1, gt=0.0)
    """α: the mixing weight λ ~ Beta(α, α) per sample (small α: λ near 0 or 1)."""
    eps: float = Field(1e-6, gt=0.0)
    """ε: added to the variance before the square root, σ = sqrt(var + ε)."""
    blocks: tuple[Annotated[int, Field(ge=1)], ...] | None = None
    """Convolutional stages MixStyle follows, 1-based (e.g. `[1, 2]`); null: every stage but
    the last (the paper's rule; ResNet-18's res1-res3)."""

    @field_validator("blocks")
    @classmethod
    def _distinct_blocks(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("list at least one stage (or leave it unset: all but the last)")
        if len(set(value)) != len(value):
            raise ValueError(f"stages are listed more than once: {list(value)}")
        return tuple(sorted(value))


def mix_styles(x: torch.Tensor, lam: torch.Tensor, perm: torch.Tensor, eps: float) -> torch.Tensor:
    """x (B×C×H×W) re-normalised with each sample's statistics mixed with those of sample
    ``perm[b]`` by weight ``lam[b]`` (the module docstring's formula; μ, σ detached)."""
    mu = x.mean(dim=(2, 3), keepdim=True)
    var = x.var(dim=(2, 3), keepdim=True, correction=0)
    sig = (var + eps).sqrt()
    mu, sig = mu.detach(), sig.detach()
    lam = lam.to(device=x.device, dtype=x.dtype).view(-1, 1, 1, 1)
    perm = perm.to(x.device)
    mu_mix = lam * mu + (1 - lam) * mu[perm]
    sig_mix = lam * sig + (1 - lam) * sig[perm]
    return (x - mu) / sig * sig_mix + mu_mix


class MixStyle(nn.Module):
    """The MixStyle layer: ``mix_styles`` with probability ``p`` in training, else identity."""

    def __init__(self, p: float, alpha: float, eps: float = 1e-6, where: str = "MixStyle") -> None:
        super().__init__()
        self.p, self.alpha, self.eps = p, alpha, eps
        self.where = where  # for messages

    def extra_repr(self) -> str:
        return f"p={self.p}, alpha={self.alpha}, eps={self.eps}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        warn_small_instance_map(self, self.where, x.shape[2], x.shape[3])
        if self.p < 1.0 and float(torch.rand(())) >= self.p:
            return x
        batch = x.shape[0]
        alpha = torch.tensor(self.alpha, dtype=torch.float64)
        lam = torch.distributions.Beta(alpha, alpha).sample((batch,))
        perm = torch.randperm(batch)
        return mix_styles(x, lam, perm, self.eps)

    def after(self, module: nn.Module, inputs: object, output: torch.Tensor) -> torch.Tensor:
        """Forward hook: MixStyle applied to ``module``'s output."""
        return self(output)

    def before(self, module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple:
        """Forward pre-hook: MixStyle applied to ``module``'s input."""
        return (self(inputs[0]), *inputs[1:])


AT_THE_CUT = ""  # chosen_stages' name for the stage a frozen prefix ends with (the tail's input)


def chosen_stages(model: nn.Module, hp: MixStyleHparams) -> tuple[str, ...]:
    """The names of the stages MixStyle follows in ``model`` (``AT_THE_CUT`` for the last stage
    of its frozen prefix); ConfigError if it cannot."""
    problem = stage_problem(model, hp)
    if problem:
        raise ConfigError(f"mixstyle {problem}")
    stages = tuple(getattr(model, "stages", ()))
    cut = getattr(model, "frozen_stages", 0)  # a frozen prefix's tail numbers stages on from it
    return tuple(
        AT_THE_CUT if b == cut else stages[b - cut - 1] for b in stage_numbers(model, hp.blocks)
    )


def stage_numbers(model: nn.Module, blocks: tuple[int, ...] | None) -> tuple[int, ...]:
    """The whole model's stage numbers MixStyle follows: ``blocks``, or by default every stage
    but the last (on a frozen prefix's tail: counted from the whole model's first)."""
    n_stages = getattr(model, "frozen_stages", 0) + len(tuple(getattr(model, "stages", ())))
    return tuple(blocks or range(1, n_stages))


def stage_problem(model: nn.Module, hp: Hparams) -> str | None:
    """Why MixStyle cannot be inserted into ``model`` as configured, or None."""
    stages = tuple(getattr(model, "stages", ()))
    blocks = getattr(hp, "blocks", None)
    known = "small_cnn, lenet5, resnet18, resnet50 and efficientnet_lite0 declare them; not frozen"
    cut = getattr(model, "frozen_stages", 0)  # a frozen prefix's tail: the model's stages cut+1..
    inside = [b for b in stage_numbers(model, blocks) if b < cut]
    if inside:
        return (
            f"has MixStyle after stages {inside}, inside the frozen prefix "
            f"(model.frozen_prefix = {cut}): its random mixing there cannot be cached; set "
            f"algorithm.blocks to stage {cut} (the tail's input) or later"
        )
    if not stages:
        return (
            "inserts MixStyle after the model's convolutional stages, and this model declares "
            f"none ({known})"
        )
    if blocks is None and cut + len(stages) < 2:
        return (
            f"inserts MixStyle after every convolutional stage but the last, and this model has "
            f"only {len(stages)}: set algorithm.blocks"
        )
    if blocks is not None and max(blocks) > cut + len(stages):
        listed = ", ".join(stages) + (f" after the first {cut}" if cut else "")
        return (
            f"has algorithm.blocks = {list(blocks)}, and this model has {cut + len(stages)} "
            f"convolutional stages ({listed})"
        )
    return None


def insert_mixstyle(model: nn.Module, hp: Hparams) -> nn.Module:
    """The model hook: a MixStyle layer after each chosen stage (a forward hook; at a frozen
    prefix's cut a pre-hook on the featurizer). The layers are kept in ``model.mixstyle`` so that
    ``train()``/``eval()`` reach them; no arrays added."""
    assert isinstance(hp, MixStyleHparams)
    layers = nn.ModuleList()
    for name in chosen_stages(model, hp):
        at_cut = name == AT_THE_CUT
        where = "MixStyle on the tail's input" if at_cut else f"MixStyle after {name!r}"
        layer = MixStyle(hp.p, hp.alpha, hp.eps, where=where)
        if at_cut:  # hooked on the featurizer, which every method's forward reads
            model.featurizer.register_forward_pre_hook(layer.before)
        else:
            model.get_submodule(name).register_forward_hook(layer.after)
        layers.append(layer)
    model.mixstyle = layers
    return model


class MixStyleClient(FedAvgClient):
    """FedAvg's client: the model hook makes its local training MixStyle's."""


register(
    MethodSpec(
        "mixstyle",
        FedAvgServer,
        MixStyleClient,
        MixStyleHparams,
        description="MixStyle: FedAvg whose clients mix instance feature statistics across "
        "samples after early conv stages (Zhou et al., ICLR 2021)",
        model_hook=insert_mixstyle,
        check_config=model_requirement("mixstyle", stage_problem),
        space={"p": Uniform(0.1, 0.9), "alpha": LogUniform(0.01, 1.0)},  # MixStyle: 0.5, 0.1
        image_only="mixes the channel statistics of convolutional feature maps",
    )
)
