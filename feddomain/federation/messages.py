"""The only thing that crosses between server, stations and clients: named arrays and scalars.

``Message`` has the shape of Flower's ``Message`` content (an ``ArrayRecord`` of tensors plus a
``ConfigRecord``/``MetricRecord`` of scalars), so an algorithm written against it runs unchanged on
Flower. The simulator hands over ``copy()``s, so no party can alias another party's tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

Scalar = int | float | str | bool | list[int] | list[float] | list[str]


@dataclass
class Message:
    """A task name plus named tensors and scalars."""

    task: str = "fit"
    arrays: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, Scalar] = field(default_factory=dict)

    def copy(self) -> Message:
        """A deep copy: the receiver can modify it without touching the sender's state."""
        return Message(
            self.task,
            {k: v.detach().clone() for k, v in self.arrays.items()},
            {k: list(v) if isinstance(v, list) else v for k, v in self.scalars.items()},
        )

    @property
    def nbytes(self) -> int:
        """Payload size of the arrays (what a transport would send), in bytes."""
        return sum(t.numel() * t.element_size() for t in self.arrays.values())

    def has_non_finite(self) -> list[str]:
        """Names of floating arrays holding NaN or Inf (rejected by the runner)."""
        return [
            k
            for k, t in self.arrays.items()
            if t.is_floating_point() and not bool(torch.isfinite(t).all())
        ]


def flatten(arrays: Mapping[str, torch.Tensor], names: Iterable[str] | None = None) -> torch.Tensor:
    """Concatenate arrays (in ``names`` order, default insertion order) into one float vector."""
    keys = list(arrays) if names is None else list(names)
    return torch.cat([arrays[k].detach().reshape(-1).float() for k in keys])


def unflatten(vector: torch.Tensor, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of ``flatten``: cut a vector back into tensors shaped (and typed) like ``like``."""
    out, offset = {}, 0
    for name, ref in like.items():
        n = ref.numel()
        out[name] = vector[offset : offset + n].view(ref.shape).to(ref.dtype)
        offset += n
    if offset != vector.numel():
        raise ValueError(f"vector has {vector.numel()} entries, the arrays need {offset}")
    return out


def weighted_mean(
    messages: Iterable[Message], weight_key: str = "num_examples"
) -> tuple[dict[str, torch.Tensor] | None, float]:
    """Sample-weighted mean of the messages' arrays, accumulated on flat vectors (streaming).

    Returns the mean arrays and the total weight, or ``(None, 0.0)`` when there is no message.
    Each message is folded in and can be dropped at once. Integer buffers (e.g. BatchNorm's
    ``num_batches_tracked``) are averaged in float and rounded back to their dtype.
    """
    total, acc, like = 0.0, None, None
    for msg in messages:
        w = float(msg.scalars[weight_key])
        flat = flatten(msg.arrays).double()
        acc = flat * w if acc is None else acc.add_(flat, alpha=w)
        like = like or msg.arrays
        total += w
    if acc is None or like is None:
        return None, 0.0
    if total <= 0:
        raise ValueError(f"total weight '{weight_key}' must be positive, got {total}")
    mean = acc / total
    out = {}
    for name, t in unflatten(mean, {k: v.double() for k, v in like.items()}).items():
        ref = like[name]
        out[name] = t.round().to(ref.dtype) if not ref.is_floating_point() else t.to(ref.dtype)
    return out, total
