"""Data layer: sources -> decode-once cache -> splits -> client partitions -> augmentation."""

from feddomain.data.dataset import DomainDataset

__all__ = ["DomainDataset"]
