"""Clients -> stations for hierarchical federations (client -> station -> server).

``assign_stations`` groups an existing client list; every scheme gives station sizes that differ
by at most one. ``contiguous`` (HFedATM's default, hfedatm.md §2.5) cuts the client list into
consecutive blocks: on the lambda splitter's output, which orders clients by main domain, that
makes stations (nearly) single-domain at lam = 0.

``split_station_dirichlet`` instead builds clients and stations together from a two-level
Dirichlet mixture: each domain is spread over stations with Dir(alpha_station) shares, then each
station's share of each domain over its clients with Dir(alpha_client) shares (or evenly).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from feddomain.data.partitioners.base import (
    as_groups,
    blocks,
    check_conserved,
    check_count,
    deal,
    sizes_of,
    stream,
)
from feddomain.data.partitioners.dirichlet import check_alpha, dirichlet_counts
from feddomain.errors import ConfigError

SCHEMES = ("contiguous", "round_robin", "random_balanced")


def assign_stations(
    n_clients: int, n_stations: int, scheme: str = "contiguous", *, seed: int
) -> list[np.ndarray]:
    """Client ids (sorted) of each station; ``seed`` matters only for ``random_balanced``."""
    n_clients = check_count("n_clients", n_clients)
    n_stations = check_count("n_stations", n_stations)
    if n_stations > n_clients:
        raise ConfigError(f"n_stations={n_stations} exceeds n_clients={n_clients}")
    clients = np.arange(n_clients, dtype=np.int64)
    if scheme == "contiguous":
        stations = np.array_split(clients, n_stations)
    elif scheme == "round_robin":
        stations = [clients[s::n_stations] for s in range(n_stations)]
    elif scheme == "random_balanced":
        shuffled = stream(seed, "stations/random_balanced").permutation(clients)
        stations = [np.sort(part) for part in np.array_split(shuffled, n_stations)]
    else:
        raise ConfigError(f"unknown station scheme {scheme!r}; choose one of {list(SCHEMES)}")
    check_conserved([clients], stations)
    return stations


def split_station_dirichlet(
    groups: Sequence[np.ndarray],
    n_stations: int,
    clients_per_station: int,
    alpha_station: float,
    alpha_client: float | None,
    *,
    seed: int,
    min_size: int = 1,
) -> tuple[list[np.ndarray], np.ndarray]:
    """Two-level Dirichlet partition: returns (client index arrays, station id of each client).

    Clients are numbered station by station: station s holds clients
    ``s*clients_per_station .. (s+1)*clients_per_station - 1``. ``alpha_client`` None or inf
    splits every station's share of each domain evenly over its clients. Every client gets at
    least ``min_size`` samples (Dirichlet draws are repeated a bounded number of times).
    """
    groups = as_groups(groups)
    n_stations = check_count("n_stations", n_stations)
    per_station = check_count("clients_per_station", clients_per_station)
    min_size = check_count("min_size", min_size, minimum=0)
    alpha_station = check_alpha("alpha_station", alpha_station)
    alpha_client = check_alpha("alpha_client", alpha_client, allow_inf=True)

    station_counts = dirichlet_counts(
        sizes_of(groups),
        n_stations,
        alpha_station,
        stream(seed, "station_dirichlet/stations"),
        per_station * min_size,
        f"station level (n_stations={n_stations}, alpha_station={alpha_station})",
    )
    perms = [
        stream(seed, "station_dirichlet/shuffle", j).permutation(g) for j, g in enumerate(groups)
    ]
    clients: list[np.ndarray] = []
    # a station's block of each shuffled domain is itself a random sample in random order
    for s, local in enumerate(blocks(perms, station_counts)):
        counts = dirichlet_counts(
            sizes_of(local),
            per_station,
            alpha_client,
            stream(seed, "station_dirichlet/clients", s),
            min_size,
            f"station {s} (clients_per_station={per_station}, alpha_client={alpha_client})",
        )
        clients.extend(deal(local, counts))
    check_conserved(groups, clients)
    station_of_client = np.repeat(np.arange(n_stations, dtype=np.int64), per_station)
    return clients, station_of_client
