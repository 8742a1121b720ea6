"""Dirichlet over domains: conservation, seeding, concentration, the min_size re-draw loop."""

from __future__ import annotations

import numpy as np
import pytest

from feddomain.data.partitioners.dirichlet import split_dirichlet
from feddomain.errors import ConfigError
from tests.pacs_listing import list_pacs

SIZES = (200, 300, 400)


def synthetic(sizes=SIZES) -> tuple[list[np.ndarray], np.ndarray]:
    bounds = np.cumsum((0, *sizes))
    groups = [np.arange(bounds[j], bounds[j + 1]) for j in range(len(sizes))]
    return groups, np.repeat(np.arange(len(sizes)), sizes)


def table(clients, domain_of, n_domains) -> np.ndarray:
    return np.stack([np.bincount(domain_of[c], minlength=n_domains) for c in clients])


@pytest.mark.parametrize("alpha", [0.05, 1.0, 1000.0])
@pytest.mark.parametrize("n_clients", [1, 4, 30])
def test_conserves_every_sample(alpha: float, n_clients: int) -> None:
    groups, _ = synthetic()
    # min_size=0: with alpha=0.05 and 30 clients most clients are empty, which is allowed here
    clients = split_dirichlet(groups, n_clients, alpha, seed=3, min_size=0)
    assert len(clients) == n_clients
    assert np.array_equal(np.sort(np.concatenate(clients)), np.arange(sum(SIZES)))


def test_seeded() -> None:
    groups, _ = synthetic()
    a = split_dirichlet(groups, 6, 0.5, seed=11)
    b = split_dirichlet(groups, 6, 0.5, seed=11)
    c = split_dirichlet(groups, 6, 0.5, seed=12)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_small_alpha_concentrates_domains() -> None:
    """Mean over domains of the largest client share, averaged over 30 seeds.

    Equal shares over 5 clients give 0.2; Dir(0.1) puts most of a domain on one client.
    """
    groups, domain_of = synthetic()

    def mean_max_share(alpha: float) -> float:
        shares = []
        for seed in range(30):
            counts = table(split_dirichlet(groups, 5, alpha, seed=seed), domain_of, 3)
            shares.append((counts.max(axis=0) / counts.sum(axis=0)).mean())
        return float(np.mean(shares))

    concentrated, middle, spread = (mean_max_share(a) for a in (0.1, 1.0, 100.0))
    assert concentrated > middle > spread
    assert concentrated > 0.6
    assert 0.2 <= spread < 0.26


def test_min_size_is_enforced_by_redrawing() -> None:
    groups, _ = synthetic()
    clients = split_dirichlet(groups, 10, 0.3, seed=0, min_size=40)
    assert min(len(c) for c in clients) >= 40
    assert np.array_equal(np.sort(np.concatenate(clients)), np.arange(sum(SIZES)))


def test_impossible_requests_fail_clearly() -> None:
    groups, _ = synthetic()
    with pytest.raises(ConfigError, match=r"900 samples cannot give 10 parts min_size=100"):
        split_dirichlet(groups, 10, 1.0, seed=0, min_size=100)
    # Dir(0.001) over 3 domains feeds at most ~3 clients: 10 clients never all get a sample
    with pytest.raises(ConfigError, match=r"no Dir\(alpha=0.001\) draw gave all 10 parts"):
        split_dirichlet(groups, 10, 0.001, seed=0)
    for bad in (0, -1.0, float("inf"), float("nan"), None):
        with pytest.raises(ConfigError, match=r"alpha must be a positive finite number"):
            split_dirichlet(groups, 4, bad, seed=0)


@pytest.fixture(scope="module")
def pacs(shared_data):
    return list_pacs(shared_data)


@pytest.mark.parametrize("n_clients", [3, 5, 100])
def test_pacs_conserves_and_is_seeded(pacs, n_clients: int) -> None:
    groups = pacs.groups("photo")
    a = split_dirichlet(groups, n_clients, 0.5, seed=0)
    b = split_dirichlet(groups, n_clients, 0.5, seed=0)
    c = split_dirichlet(groups, n_clients, 0.5, seed=1)
    assert np.array_equal(np.sort(np.concatenate(a)), np.sort(np.concatenate(groups)))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    counts = table(a, pacs.domain_ids, 4)
    assert (counts[:, 2] == 0).all()  # photo is the target
    assert counts.sum(axis=0)[[0, 1, 3]].tolist() == [2048, 2344, 3929]
