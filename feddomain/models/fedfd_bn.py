"""FedFD's BatchNorm layer (fedfda.md §3.2-§3.3): one layer, several ways to pick the statistics
it normalises with, so FedFD's training paths and every test-time variant of the poster's table
are modes of the same weights.

For an input h (B×C×H×W), with ε the layer's own eps (1e-5 for torch's default):

    instance:  μ_I[b,c] = mean_hw h[b,c],  σ_I[b,c] = sqrt(var_hw h[b,c] + ε)   (biased variance)
    batch:     μ_B[c] = mean_bhw h[:,c],   σ_B[c] = sqrt(var_bhw h[:,c] + ε)
    global:    μ_G = global_mean,          σ_G = sqrt(global_var + ε)           (buffers, constant)
    out = γ ⊙ (h − μ*) / σ* + β,  μ* = a·μ_L + (1 − a)·μ_G,  σ* = a·σ_L + (1 − a)·σ_G

Modes (``BNMode.kind``), with L the local statistics (``local_stats``: instance, or batch):

* ``batch``: torch's BatchNorm2d, unchanged (batch statistics and running-statistic update in
  training, running statistics in eval) — the only mode that touches ``running_mean/var``;
* ``global``: a = 0 (eval-mode BatchNorm with the global statistics);
* ``instance``: a = 1 (TBN, the instance-only ablation);
* ``fixed``: a = ``alpha``;
* ``random``: a ~ U(0,1), one draw per forward shared by the batch, or one per sample with
  ``per_sample`` (FedFD's diversification, CHOICE F2; the "random α" test-time ablation);
* ``adapter``: a[b] = A(concat(μ_I[b] − μ_G, σ_I[b] − σ_G)) per sample, always with instance
  statistics (FedFD-A's instance feature adapter, §3.3: 2C → C/r → 1, ReLU, sigmoid, the output
  layer zero-initialised so that a = 0.5 at the start).

The mix is linear in σ, not in the variance [poster]. Gradients flow through μ_I, σ_I, μ_B, σ_B
(as in InstanceNorm/BatchNorm); μ_G, σ_G are buffers. Every mode but ``batch`` is independent of
the other samples of the batch when L = instance (per-sample inference).

A layer holds two modes: ``train_mode`` (used under ``model.train()``; ``batch`` at rest, which
keeps PreciseBN and plain training BatchNorm's) and ``eval_mode`` (under ``model.eval()``). FedFD's
client switches ``train_mode`` per forward path with ``bn_mode``; the method's test mode is the
``eval_mode``. Random draws come from torch's global RNG on the CPU (the runner seeds it per
client task), so runs are deterministic and the same on any device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from feddomain.errors import ConfigError
from feddomain.models.base import warn_small_instance_map

Kind = Literal["batch", "global", "instance", "fixed", "random", "adapter"]
LocalStats = Literal["instance", "batch"]
KINDS: tuple[str, ...] = ("batch", "global", "instance", "fixed", "random", "adapter")


@dataclass(frozen=True)
class BNMode:
    """How a ``FedFDBatchNorm2d`` picks its statistics (module docstring)."""

    kind: Kind = "batch"
    alpha: float = 0.5  # the weight a of the local statistics in mode "fixed"
    per_sample: bool = False  # mode "random": one draw per sample instead of per forward
    local_stats: LocalStats = "instance"  # L in the mixing modes (not "adapter": instance)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"BN mode {self.kind!r} is not one of {list(KINDS)}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"BN mode alpha={self.alpha} is outside [0, 1]")
        if self.local_stats not in ("instance", "batch"):
            raise ValueError(f"local_stats={self.local_stats!r} is not 'instance' or 'batch'")


BATCH = BNMode("batch")


class InstanceFeatureAdapter(nn.Module):
    """A^l: concat(μ_I − μ_G, σ_I − σ_G) (B×2C) -> α (B), through 2C -> C/r -> 1 (fedfda.md §3.3,
    CHOICE F4). The output layer starts at zero, so α = sigmoid(0) = 0.5 at initialisation."""

    def __init__(self, channels: int, reduction: int = 16) -> None:
        super().__init__()
        hidden = max(1, channels // reduction)
        self.net = nn.Sequential(nn.Linear(2 * channels, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        nn.init.zeros_(self.net[2].weight)
        nn.init.zeros_(self.net[2].bias)

    def forward(self, difference: Tensor) -> Tensor:
        return torch.sigmoid(self.net(difference)).squeeze(1)


class FedFDBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d with global-statistics buffers, an optional instance feature adapter and the
    modes of the module docstring. A subclass of BatchNorm2d, so the engine finds it by type
    (its running statistics are local arrays, like SiloBN's)."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        adapter_reduction: int | None = None,
    ) -> None:
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine)
        self.register_buffer("global_mean", torch.zeros(num_features))
        self.register_buffer("global_var", torch.ones(num_features))
        self.adapter = (
            InstanceFeatureAdapter(num_features, adapter_reduction)
            if adapter_reduction is not None
            else None
        )
        self.train_mode = BATCH
        self.eval_mode = BATCH
        self.where = "a FedFD BatchNorm layer"  # its name in the model, for messages

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, train_mode={self.train_mode}, eval_mode={self.eval_mode}"

    def forward(self, x: Tensor) -> Tensor:
        mode = self.train_mode if self.training else self.eval_mode
        if mode.kind == "batch":
            return super().forward(x)
        if mode.kind == "global":
            return self._global(x)
        if mode.kind == "adapter" and self.adapter is None:
            raise RuntimeError("BN mode 'adapter' on a layer built without an adapter")
        return self._mixed(x, mode)

    def _global(self, x: Tensor) -> Tensor:
        """Eval-mode BatchNorm with the global statistics (a = 0), torch's own kernel."""
        return F.batch_norm(
            x, self.global_mean, self.global_var, self.weight, self.bias, False, 0.0, self.eps
        )

    def _mixed(self, x: Tensor, mode: BNMode) -> Tensor:
        local = "instance" if mode.kind == "adapter" else mode.local_stats
        if local == "instance" and x.shape[2] * x.shape[3] == 1:
            raise ConfigError(
                f"{self.where}: instance statistics of a 1x1 feature map are the features "
                f"themselves (variance 0), so every sample would normalise to the same output; "
                f"give the model larger inputs (dataset.resolution; EfficientNet-Lite0's last "
                f"stages are 1x1 below 64 px) or use algorithm.local_stats: batch with a test "
                f"mode that reads no instance statistics (global, local)"
            )
        if local == "instance":
            warn_small_instance_map(self, self.where, x.shape[2], x.shape[3])
        mu_l, sigma_l = local_statistics(x, local, self.eps)
        mu_g = self.global_mean.view(1, -1, 1, 1)
        sigma_g = (self.global_var + self.eps).sqrt().view(1, -1, 1, 1)
        a = self._weight(mode, x, mu_l, sigma_l, mu_g, sigma_g).view(-1, 1, 1, 1)
        mu = a * mu_l + (1 - a) * mu_g
        sigma = a * sigma_l + (1 - a) * sigma_g
        # γ (x − μ)/σ + β as one pass over x: x·scale + shift, per (sample,) channel
        scale = 1 / sigma
        if self.affine:
            scale = scale * self.weight.view(1, -1, 1, 1)
        shift = -mu * scale
        if self.affine:
            shift = shift + self.bias.view(1, -1, 1, 1)
        return torch.addcmul(shift, x, scale)

    def _weight(
        self, mode: BNMode, x: Tensor, mu_l: Tensor, sigma_l: Tensor, mu_g: Tensor, sigma_g: Tensor
    ) -> Tensor:
        """The weight a of the local statistics: a scalar, or one per sample (B)."""
        if mode.kind == "instance":
            return x.new_ones(())
        if mode.kind == "fixed":
            return x.new_full((), mode.alpha)
        if mode.kind == "random":
            shape = (x.shape[0],) if mode.per_sample else ()
            return torch.rand(shape).to(device=x.device, dtype=x.dtype)
        assert self.adapter is not None
        difference = torch.cat([(mu_l - mu_g).flatten(1), (sigma_l - sigma_g).flatten(1)], dim=1)
        return self.adapter(difference)


def local_statistics(x: Tensor, kind: LocalStats, eps: float) -> tuple[Tensor, Tensor]:
    """(μ, σ = sqrt(biased var + eps)) per sample and channel (B×C×1×1, ``instance``) or per
    channel over the batch (1×C×1×1, ``batch``)."""
    dims = (2, 3) if kind == "instance" else (0, 2, 3)
    mu = x.mean(dim=dims, keepdim=True)
    centred = x - mu  # two passes: torch.var_mean is several times slower on CPU
    var = (centred * centred).mean(dim=dims, keepdim=True)
    return mu, (var + eps).sqrt()


def fedfd_layers(model: nn.Module) -> Iterator[tuple[str, FedFDBatchNorm2d]]:
    """Every ``FedFDBatchNorm2d`` of ``model`` with its name, in module order."""
    for name, module in model.named_modules():
        if isinstance(module, FedFDBatchNorm2d):
            yield name, module


def convert_batchnorm(model: nn.Module, adapter_reduction: int | None = None) -> nn.Module:
    """Replace every BatchNorm2d of ``model`` (ours, torchvision's, EfficientNet-Lite's: found by
    type, at any depth) by a ``FedFDBatchNorm2d`` with the same eps, momentum, affine parameters
    and running statistics, whose global statistics start as its running statistics; with
    ``adapter_reduction`` each gets an instance feature adapter. In place; returns ``model``."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.BatchNorm2d) and not isinstance(child, FedFDBatchNorm2d):
                where = f"{name}.{child_name}" if name else child_name
                setattr(module, child_name, _converted(child, adapter_reduction, where))
    return model


def _converted(bn: nn.BatchNorm2d, adapter_reduction: int | None, where: str) -> FedFDBatchNorm2d:
    if not bn.track_running_stats:
        raise ValueError(f"BatchNorm layer {where!r} keeps no running statistics")
    new = FedFDBatchNorm2d(
        bn.num_features, bn.eps, bn.momentum, bn.affine, adapter_reduction=adapter_reduction
    )
    new = new.to(device=bn.running_mean.device, dtype=bn.running_mean.dtype)
    with torch.no_grad():
        if bn.affine:
            new.weight.copy_(bn.weight)
            new.bias.copy_(bn.bias)
        new.running_mean.copy_(bn.running_mean)
        new.running_var.copy_(bn.running_var)
        new.num_batches_tracked.copy_(bn.num_batches_tracked)
        new.global_mean.copy_(bn.running_mean)
        new.global_var.copy_(bn.running_var)
    new.train(bn.training)
    new.where = f"BatchNorm layer {where!r}"
    return new


def set_bn_mode(model: nn.Module, mode: BNMode, *, training: bool = True) -> None:
    """Set every FedFD layer's ``train_mode`` (``training``) or ``eval_mode`` to ``mode``."""
    for _, layer in fedfd_layers(model):
        if training:
            layer.train_mode = mode
        else:
            layer.eval_mode = mode


@contextmanager
def bn_mode(model: nn.Module, mode: BNMode) -> Iterator[None]:
    """Forward passes in training run in ``mode`` inside the block; ``batch`` again after it."""
    set_bn_mode(model, mode)
    try:
        yield
    finally:
        set_bn_mode(model, BATCH)


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The instance feature adapters' parameters (empty without adapters)."""
    return [
        p for _, layer in fedfd_layers(model) if layer.adapter for p in layer.adapter.parameters()
    ]
