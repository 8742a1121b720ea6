"""A client's local data: contiguous in-memory tensors, batched by slicing — no per-batch I/O."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from feddomain.models.frozen import PixelVariant

Transform = Callable[[torch.Tensor, torch.Generator | None], torch.Tensor]
UNLABELED = -1  # the label of every image whose label is withheld (a target's pilot set)


@dataclass(frozen=True)
class Pixels:
    """In a cached mode (frozen prefix or frozen backbone), the images a client's cached inputs
    (prefix maps or backbone features) were computed from, and the way to more of them: a method
    that changes pixels deterministically before the frozen part (FISC's and CCST's fixed styles)
    gets ``maps(images, variant=...)`` of its changed images, computed once per variant and
    cached like the plain ones; a method that summarises its data (FedRC) reads ``images``."""

    source: torch.Tensor  # uint8 [M, 3, H, W]: the dataset's images (not copied per client)
    index: torch.Tensor  # int64 [N]: this client's, in the order of its ClientData's inputs
    maps: Callable[..., torch.Tensor]  # (uint8 images, variant=PixelVariant) -> cached inputs

    @property
    def images(self) -> torch.Tensor:
        return self.source[self.index]

    def variant_maps(self, variant: PixelVariant) -> torch.Tensor:
        """The prefix's maps of this client's images changed by ``variant`` (cached)."""
        return self.maps(self.images, variant=variant)


@dataclass
class ClientData:
    """Inputs (uint8 images or float features) and labels of one client split.

    ``transform`` turns a sliced batch into model input (augmentation + normalisation for training,
    normalisation only for evaluation); ``None`` passes float features through unchanged.
    ``pixels``: in a cached mode, where the inputs (prefix maps, backbone features) came from.
    """

    inputs: torch.Tensor
    labels: torch.Tensor
    transform: Transform | None = None
    pixels: Pixels | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def batches(
        self,
        batch_size: int,
        generator: torch.Generator | None = None,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One epoch of (x, y) batches; the order (and augmentation) is drawn from ``generator``.
        ``drop_last`` skips a final partial batch (its loss would be noisier than the others)."""
        n = len(self)
        order = torch.randperm(n, generator=generator) if shuffle else None
        if order is not None:  # drawn on the CPU generator: the same order on every device
            order = order.to(self.inputs.device)
        stop = n - n % batch_size if drop_last else n
        for start in range(0, stop, batch_size):
            if order is None:
                x, y = (
                    self.inputs[start : start + batch_size],
                    self.labels[start : start + batch_size],
                )
            else:
                idx = order[start : start + batch_size]
                x, y = self.inputs[idx], self.labels[idx]
            yield (self.transform(x, generator) if self.transform else x), y

    def to(self, device: torch.device) -> ClientData:
        """This split on ``device`` (itself when it is there already)."""
        if self.inputs.device == device and self.labels.device == device:
            return self
        return ClientData(
            self.inputs.to(device), self.labels.to(device), self.transform, self.pixels
        )

    @staticmethod
    def concat(parts: list[ClientData]) -> ClientData:
        return ClientData(
            torch.cat([p.inputs for p in parts]),
            torch.cat([p.labels for p in parts]),
            parts[0].transform if parts else None,
        )
