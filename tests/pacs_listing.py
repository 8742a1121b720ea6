"""PACS as index arrays, from a directory listing only (no image is decoded).

Global indices follow the canonical order: domains, classes and file names sorted. Partition and
split tests need nothing more than which index belongs to which domain and class.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PACS_DOMAINS = ("art_painting", "cartoon", "photo", "sketch")
PACS_SIZES = {"art_painting": 2048, "cartoon": 2344, "photo": 1670, "sketch": 3929}


@dataclass(frozen=True)
class PacsIndex:
    domains: tuple[str, ...]
    classes: tuple[str, ...]
    domain_ids: np.ndarray  # int64 [n]: domain of each global index
    labels: np.ndarray  # int64 [n]: class of each global index

    def indices_of(self, domain: str) -> np.ndarray:
        return np.flatnonzero(self.domain_ids == self.domains.index(domain))

    def groups(self, target: str) -> list[np.ndarray]:
        """Leave-one-domain-out source pool: one index array per other domain, in order."""
        return [self.indices_of(d) for d in self.domains if d != target]


def list_pacs(root: Path) -> PacsIndex:
    pacs = root / "PACS"
    domains = tuple(sorted(d for d in os.listdir(pacs) if d in PACS_DOMAINS))
    classes = tuple(sorted(os.listdir(pacs / domains[0])))
    domain_ids, labels = [], []
    for j, domain in enumerate(domains):
        for c, cls in enumerate(classes):
            n = len(os.listdir(pacs / domain / cls))
            domain_ids.append(np.full(n, j, dtype=np.int64))
            labels.append(np.full(n, c, dtype=np.int64))
    return PacsIndex(domains, classes, np.concatenate(domain_ids), np.concatenate(labels))
