"""The in-memory form every data source produces: all images (or token ids) of a dataset,
decoded once."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class DomainDataset:
    """A multi-domain labelled image (or text) set held as one tensor.

    Samples are addressed by their global index ``0..len-1``; splits and partitions are index
    arrays into this object, so no image is ever copied to build a client's data. A text dataset
    holds token ids instead of pixels (``is_text``): int32 ``[N, L]``, padded with ``pad_id``.
    ``official_splits`` is each sample's official split name where the source defines one
    (WILDS: ``train``, ``val``, ``test``, ``id_val``, ``id_test``), else empty.
    """

    name: str
    domains: tuple[str, ...]
    classes: tuple[str, ...]
    images: torch.Tensor  # uint8 [N, 3, H, W] or int32 token ids [N, L] (may be memory-mapped)
    labels: torch.Tensor  # int64 [N], 0-based class index
    domain_ids: torch.Tensor  # int64 [N], index into ``domains``
    paths: tuple[str, ...] = ()  # "<domain>/<class>/<file>" per sample for folder sources
    skipped: tuple[str, ...] = field(default=())  # unreadable files skipped on request
    pad_id: int = 0  # text: the token id of padding (its attention mask is 0)
    official_splits: tuple[str, ...] = ()  # official split name per sample (WILDS), or empty

    def __post_init__(self) -> None:
        n = self.images.shape[0]
        image = self.images.dtype == torch.uint8 and self.images.ndim == 4
        text = self.images.dtype == torch.int32 and self.images.ndim == 2
        if not (image or text):
            raise ValueError(
                f"images must be uint8 [N,C,H,W] (or int32 token ids [N,L]), got "
                f"{self.images.dtype} {tuple(self.images.shape)}"
            )
        if self.labels.shape != (n,) or self.domain_ids.shape != (n,):
            raise ValueError("labels and domain_ids must have one entry per image")
        if self.paths and len(self.paths) != n:
            raise ValueError("paths must have one entry per image when given")
        if self.official_splits and len(self.official_splits) != n:
            raise ValueError("official_splits must have one entry per image when given")

    @property
    def is_text(self) -> bool:
        """Whether the samples are token ids (a text dataset) rather than images."""
        return self.images.ndim == 2

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
