"""State categories: how each array of a model's state dict is federated.

The engine sees three categories (``StateLayout``):

* **shared** — every array not named below: trained by the clients, averaged by the server
  (sample-weighted, FedAvg's rule) and broadcast;
* **local** — kept by each client in its persistent ``ctx.state`` (on Flower, by its node) and
  never overwritten by the server (FedBN's BatchNorm layers, SiloBN's BatchNorm statistics).
  Clients upload them so that the server can form their sample-weighted mean for what needs it
  (an unseen-domain model, server-computed buffers); that mean is never loaded into a client;
* **computed** — set by the server every round from the mean of the clients' local arrays and
  pushed with the broadcast (FedFD's global BatchNorm statistics); clients do not send them back.

Names are exact state-dict names or glob patterns. ``batchnorm_arrays`` lists the names of every
BatchNorm layer of any model (ours, torchvision's, EfficientNet-Lite's) by module type, so a
method states "BatchNorm statistics are local" without knowing how the layers are called.
``algorithms/layout.py`` holds the FedAvg-family server, client and station that apply a layout.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from feddomain.federation.messages import Message

Arrays = dict[str, torch.Tensor]

SHARED, LOCAL, COMPUTED = "shared", "local", "computed"
CATEGORIES = (SHARED, LOCAL, COMPUTED)

# A client's local arrays live in its persistent state under this prefix, beside the engine's
# ``optimizer/`` entries and whatever else the method keeps there.
LOCAL_PREFIX = "local/"

# For messages: the registry's models with BatchNorm layers.
BN_MODELS = (
    "small_cnn (norm: batch, its default), resnet18, resnet50, efficientnet_lite0; not frozen"
)

BN_AFFINE = ("weight", "bias")
BN_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


@dataclass(frozen=True)
class StateLayout:
    """Which arrays are ``local`` and which ``computed`` (names or glob patterns); the rest are
    ``shared``. The default layout (nothing local, nothing computed) is FedAvg's."""

    local: tuple[str, ...] = ()
    computed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        both = [n for n in self.local if n in self.computed]
        if both:
            raise ValueError(f"arrays {both[:3]} are declared both local and computed")

    def category(self, name: str) -> str:
        if _matches(name, self.computed):
            return COMPUTED
        if _matches(name, self.local):
            return LOCAL
        return SHARED

    def select(self, arrays: Mapping[str, torch.Tensor], *categories: str) -> Arrays:
        """The entries of ``arrays`` in ``categories``, in their order."""
        return {k: v for k, v in arrays.items() if self.category(k) in categories}

    def split(self, arrays: Mapping[str, torch.Tensor]) -> dict[str, Arrays]:
        """``arrays`` by category: ``{SHARED: ..., LOCAL: ..., COMPUTED: ...}``, orders kept."""
        out: dict[str, Arrays] = {c: {} for c in CATEGORIES}
        for name, value in arrays.items():
            out[self.category(name)][name] = value
        return out


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(name == p or fnmatch.fnmatchcase(name, p) for p in patterns)


def batchnorm_arrays(
    model: nn.Module, *, affine: bool = True, statistics: bool = True
) -> tuple[str, ...]:
    """State-dict names of every BatchNorm layer of ``model``, found by module type
    (``nn.modules.batchnorm._BatchNorm``: BatchNorm1d/2d/3d, SyncBatchNorm, and every subclass),
    in state-dict order: the affine ``weight``/``bias`` and/or the running statistics
    (``running_mean``, ``running_var``, ``num_batches_tracked``), those the layer has."""
    wanted = (BN_AFFINE if affine else ()) + (BN_STATISTICS if statistics else ())
    layers = {
        name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
    }
    names = []
    for key in model.state_dict():
        owner, _, leaf = key.rpartition(".")
        if owner in layers and leaf in wanted:
            names.append(key)
    return tuple(names)


def load_local(state: Message) -> Arrays:
    """A client's local arrays, as ``store_local`` kept them (empty before its first fit)."""
    return {
        k.removeprefix(LOCAL_PREFIX): v
        for k, v in state.arrays.items()
        if k.startswith(LOCAL_PREFIX)
    }


def store_local(state: Message, arrays: Mapping[str, torch.Tensor]) -> None:
    """Keep ``arrays`` (copies) as the client's local arrays in its persistent state."""
    for key in [k for k in state.arrays if k.startswith(LOCAL_PREFIX)]:
        del state.arrays[key]
    for name, value in arrays.items():
        state.arrays[LOCAL_PREFIX + name] = value.detach().clone()
