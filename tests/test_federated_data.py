"""From config to per-client data on real PACS: official lists, validation split, few-shot."""

from __future__ import annotations

import numpy as np
import pytest

from feddomain.config import validate_config
from feddomain.data.federated import build_federated_data, experiment_splits
from feddomain.data.sources import load_dataset, official_split_indices


@pytest.fixture(scope="module")
def pacs(shared_data, cache_dir):
    return load_dataset("PACS", shared_data, 32, cache_dir)


def _cfg(shared_data, cache_dir, **split):
    return validate_config(
        {
            "dataset": {"name": "pacs", "root": str(shared_data), "cache_dir": str(cache_dir)},
            "split": {"scheme": "lodo", "targets": ["photo"], **split},
            "partition": {"n_clients": 3, "d": 1},
        }
    )


def _rows(data) -> set[bytes]:
    """Identify samples by their pixels and label (clients hold copies, not indices)."""
    return {
        img.numpy().tobytes() + bytes([int(y)])
        for img, y in zip(data.inputs, data.labels, strict=True)
    }


def test_each_client_holds_one_source_domain_with_a_ten_percent_validation_split(
    pacs, shared_data, cache_dir
):
    cfg = _cfg(shared_data, cache_dir)
    split = experiment_splits(cfg, pacs)[0]
    fed = build_federated_data(cfg, pacs, split)
    sizes = {"art_painting": 2048, "cartoon": 2344, "sketch": 3929}
    seen = set()
    for c in range(3):
        (domain_id,) = np.flatnonzero(fed.client_domain_counts[c])
        domain = pacs.domains[domain_id]
        seen.add(domain)
        n = sizes[domain]
        assert len(fed.val[c]) == round(0.1 * n)
        assert len(fed.train[c]) + len(fed.val[c]) == n
    assert seen == set(sizes)
    assert len(fed.targets["photo"]) == 1670


def test_official_lists_give_each_client_its_domains_train_and_crossval(
    pacs, shared_data, cache_dir
):
    cfg = _cfg(shared_data, cache_dir, official_lists=True)
    fed = build_federated_data(cfg, pacs, experiment_splits(cfg, pacs)[0])
    for c in range(3):
        (domain_id,) = np.flatnonzero(fed.client_domain_counts[c])
        domain = pacs.domains[domain_id]
        train = official_split_indices(pacs, shared_data, domain, "train")
        val = official_split_indices(pacs, shared_data, domain, "crossval")
        assert len(fed.train[c]) == len(train) and len(fed.val[c]) == len(val)
        expected = pacs.images[train].numpy()
        assert np.array_equal(
            np.sort(fed.train[c].inputs.numpy().reshape(len(train), -1), 0),
            np.sort(expected.reshape(len(train), -1), 0),
        )


def test_few_shot_moves_k_per_class_target_images_into_each_client(pacs, shared_data, cache_dir):
    base = build_federated_data(
        _cfg(shared_data, cache_dir), pacs, experiment_splits(_cfg(shared_data, cache_dir), pacs)[0]
    )
    cfg = _cfg(shared_data, cache_dir, few_shot=2)
    fed = build_federated_data(cfg, pacs, experiment_splits(cfg, pacs)[0])
    n_classes = len(pacs.classes)
    assert len(fed.targets["photo"]) == 1670 - 3 * 2 * n_classes
    target_rows = _rows(base.targets["photo"])
    shots = []
    for c in range(3):
        assert len(fed.train[c]) == len(base.train[c]) + 2 * n_classes
        added = _rows(fed.train[c]) - _rows(base.train[c])
        assert added <= target_rows
        shots.append(added)
        labels = fed.train[c].labels[len(base.train[c]) :]
        assert np.bincount(labels.numpy(), minlength=n_classes).tolist() == [2] * n_classes
    assert not (shots[0] & shots[1]) and not (shots[1] & shots[2])
    assert not (set().union(*shots) & _rows(fed.targets["photo"]))
