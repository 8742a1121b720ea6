"""The in-memory form every data source produces: all images of a dataset, decoded once."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class DomainDataset:
    """A multi-domain labelled image set held as one uint8 tensor.

    Samples are addressed by their global index ``0..len-1``; splits and partitions are index
    arrays into this object, so no image is ever copied to build a client's data.
    """

    name: str
    domains: tuple[str, ...]
    classes: tuple[str, ...]
    images: torch.Tensor  # uint8 [N, 3, H, W] (may be backed by a memory-mapped cache file)
    labels: torch.Tensor  # int64 [N], 0-based class index
    domain_ids: torch.Tensor  # int64 [N], index into ``domains``
    paths: tuple[str, ...] = ()  # "<domain>/<class>/<file>" per sample for folder sources
    skipped: tuple[str, ...] = field(default=())  # unreadable files skipped on request

    def __post_init__(self) -> None:
        n = self.images.shape[0]
        if self.images.dtype != torch.uint8 or self.images.ndim != 4:
            raise ValueError(
                f"images must be uint8 [N,C,H,W], got {self.images.dtype} "
                f"{tuple(self.images.shape)}"
            )
        if self.labels.shape != (n,) or self.domain_ids.shape != (n,):
            raise ValueError("labels and domain_ids must have one entry per image")
        if self.paths and len(self.paths) != n:
            raise ValueError("paths must have one entry per image when given")

    def __len__(self) -> int:
        return self.images.shape[0]

    @property
    def resolution(self) -> int:
        return int(self.images.shape[-1])

    def domain_index(self, domain: str) -> int:
        try:
            return self.domains.index(domain)
        except ValueError:
            raise KeyError(
                f"unknown domain {domain!r}; {self.name} has {list(self.domains)}"
            ) from None

    def indices_of(self, domain: str | int) -> np.ndarray:
        """Global indices of one domain's samples, in storage order."""
        d = self.domain_index(domain) if isinstance(domain, str) else int(domain)
        return np.flatnonzero(self.domain_ids.numpy() == d)

    def counts(self) -> np.ndarray:
        """Images per (domain, class): int64 array [n_domains, n_classes]."""
        table = np.zeros((len(self.domains), len(self.classes)), dtype=np.int64)
        np.add.at(table, (self.domain_ids.numpy(), self.labels.numpy()), 1)
        return table
