"""Clients -> stations (hfedatm.md §2.5) and the two-level station Dirichlet partition."""

from __future__ import annotations

import numpy as np
import pytest

from feddomain.data.partitioners.lambda_mix import split_lambda
from feddomain.data.partitioners.stations import (
    SCHEMES,
    assign_stations,
    split_station_dirichlet,
)
from feddomain.data.partitioners.table import count_table, station_table
from feddomain.errors import ConfigError
from tests.pacs_listing import list_pacs


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_client_in_one_station_and_sizes_balanced(scheme: str) -> None:
    for n_clients in range(1, 26):
        for n_stations in range(1, n_clients + 1):
            stations = assign_stations(n_clients, n_stations, scheme, seed=n_clients)
            assert len(stations) == n_stations
            assert np.array_equal(np.sort(np.concatenate(stations)), np.arange(n_clients))
            sizes = [len(s) for s in stations]
            assert max(sizes) - min(sizes) <= 1


def test_contiguous_is_consecutive_blocks() -> None:
    stations = assign_stations(100, 10, "contiguous", seed=0)
    assert [s.tolist() for s in stations] == [list(range(10 * k, 10 * k + 10)) for k in range(10)]
    uneven = assign_stations(7, 3, "contiguous", seed=0)
    assert [s.tolist() for s in uneven] == [[0, 1, 2], [3, 4], [5, 6]]


def test_round_robin_interleaves() -> None:
    stations = assign_stations(7, 3, "round_robin", seed=0)
    assert [s.tolist() for s in stations] == [[0, 3, 6], [1, 4], [2, 5]]


def test_random_balanced_is_seeded_and_not_contiguous() -> None:
    a = assign_stations(100, 10, "random_balanced", seed=0)
    b = assign_stations(100, 10, "random_balanced", seed=0)
    c = assign_stations(100, 10, "random_balanced", seed=1)
    contiguous = assign_stations(100, 10, "contiguous", seed=0)
    assert [s.tolist() for s in a] == [s.tolist() for s in b]
    assert [s.tolist() for s in a] != [s.tolist() for s in c]
    assert [s.tolist() for s in a] != [s.tolist() for s in contiguous]


def test_bad_station_settings() -> None:
    with pytest.raises(ConfigError, match=r"n_stations=11 exceeds n_clients=10"):
        assign_stations(10, 11, seed=0)
    with pytest.raises(ConfigError, match=r"unknown station scheme 'blocks'.*'contiguous'"):
        assign_stations(10, 2, "blocks", seed=0)


def synthetic(sizes) -> tuple[list[np.ndarray], np.ndarray]:
    bounds = np.cumsum((0, *sizes))
    groups = [np.arange(bounds[j], bounds[j + 1]) for j in range(len(sizes))]
    return groups, np.repeat(np.arange(len(sizes)), sizes)


def test_station_dirichlet_conserves_and_labels_stations() -> None:
    groups, _ = synthetic((120, 200, 333))
    clients, station_of = split_station_dirichlet(groups, 3, 4, 0.5, 0.5, seed=0)
    assert len(clients) == 12
    assert station_of.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert np.array_equal(np.sort(np.concatenate(clients)), np.arange(653))
    assert min(len(c) for c in clients) >= 1


def test_station_dirichlet_even_client_split() -> None:
    groups, domain_of = synthetic((120, 200, 333))
    for alpha_client in (None, float("inf")):
        clients, station_of = split_station_dirichlet(groups, 3, 4, 0.5, alpha_client, seed=2)
        counts = count_table(clients, domain_of, 3)
        for s in range(3):
            block = counts[station_of == s]
            # per domain and in total, a station's clients differ by at most one sample
            assert (block.max(axis=0) - block.min(axis=0) <= 1).all()
            assert np.ptp(block.sum(axis=1)) <= 1


def test_station_dirichlet_alpha_controls_station_mixtures() -> None:
    groups, domain_of = synthetic((300, 300, 300))

    def mean_max_share(alpha_station: float) -> float:
        shares = []
        for seed in range(20):
            clients, _ = split_station_dirichlet(groups, 3, 2, alpha_station, None, seed=seed)
            per_station = station_table(
                count_table(clients, domain_of, 3), [[0, 1], [2, 3], [4, 5]]
            )
            shares.append((per_station.max(axis=0) / 300).mean())
        return float(np.mean(shares))

    assert mean_max_share(0.1) > 0.6 > 0.4 > mean_max_share(100.0)


def test_station_dirichlet_seeded_and_validated() -> None:
    groups, _ = synthetic((120, 200, 333))
    a, _ = split_station_dirichlet(groups, 2, 3, 1.0, 1.0, seed=4)
    b, _ = split_station_dirichlet(groups, 2, 3, 1.0, 1.0, seed=4)
    c, _ = split_station_dirichlet(groups, 2, 3, 1.0, 1.0, seed=5)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    with pytest.raises(ConfigError, match=r"alpha_station must be a positive finite number"):
        split_station_dirichlet(groups, 2, 3, None, 1.0, seed=0)
    with pytest.raises(ConfigError, match=r"alpha_client must be a positive number or None/inf"):
        split_station_dirichlet(groups, 2, 3, 1.0, 0, seed=0)


@pytest.fixture(scope="module")
def pacs(shared_data):
    return list_pacs(shared_data)


def test_pacs_contiguous_stations_after_lambda_zero(pacs) -> None:
    # m = (25, 28, 47) main clients for art, cartoon, sketch (see test_partition_lambda), so
    # blocks of 10 are single-domain except station 2 (clients 20-29: art|cartoon) and
    # station 5 (clients 50-59: cartoon|sketch).
    clients = split_lambda(pacs.groups("photo"), 100, 0.0, seed=0)
    stations = assign_stations(100, 10, "contiguous", seed=0)
    per_station = station_table(count_table(clients, pacs.domain_ids, 4), stations)
    n_domains = (per_station > 0).sum(axis=1)
    assert n_domains.tolist() == [1, 1, 2, 1, 1, 2, 1, 1, 1, 1]
    assert per_station.sum() == 2048 + 2344 + 3929


def test_pacs_station_dirichlet(pacs) -> None:
    groups = pacs.groups("photo")
    clients, station_of = split_station_dirichlet(groups, 10, 10, 0.5, 1.0, seed=0)
    again, _ = split_station_dirichlet(groups, 10, 10, 0.5, 1.0, seed=0)
    other, _ = split_station_dirichlet(groups, 10, 10, 0.5, 1.0, seed=1)
    assert np.array_equal(np.sort(np.concatenate(clients)), np.sort(np.concatenate(groups)))
    assert all(np.array_equal(x, y) for x, y in zip(clients, again, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(clients, other, strict=True))
    assert np.bincount(station_of).tolist() == [10] * 10
