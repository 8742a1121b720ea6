"""Source pool -> clients: the partitioner registry.

Every partitioner takes the source pool grouped by domain (``groups[j]`` = global indices of
source domain j, canonical order), a client count and a seed, and returns one sorted index array
per client, holding every sample exactly once. Configs name a partitioner and its parameters;
:func:`partition` resolves and validates them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import numpy as np

from feddomain.data.partitioners.dirichlet import split_dirichlet
from feddomain.data.partitioners.domains_per_client import split_domains_per_client
from feddomain.data.partitioners.lambda_mix import lambda_counts, main_domains, split_lambda
from feddomain.data.partitioners.stations import assign_stations, split_station_dirichlet
from feddomain.data.partitioners.table import (
    count_table,
    render_table,
    station_table,
    write_table_csv,
)
from feddomain.errors import ConfigError

Partitioner = Callable[..., list[np.ndarray]]

PARTITIONERS: dict[str, Partitioner] = {
    "domains_per_client": split_domains_per_client,  # hFedF Alg. 5, parameter d
    "lambda": split_lambda,  # Bai et al., parameter lam
    "dirichlet": split_dirichlet,  # Dir(alpha) over domains, parameters alpha, min_size
}


def _params_of(fn: Partitioner) -> tuple[list[str], list[str]]:
    """(required, optional) parameter names beyond groups, n_clients and seed."""
    fixed = {"groups", "n_clients", "seed"}
    required, optional = [], []
    for name, p in inspect.signature(fn).parameters.items():
        if name not in fixed:
            (required if p.default is inspect.Parameter.empty else optional).append(name)
    return required, optional


def partition(
    name: str, groups: Sequence[np.ndarray], n_clients: int, *, seed: int, **params: object
) -> list[np.ndarray]:
    """Run the partitioner registered as ``name`` with its parameters from a config."""
    if name not in PARTITIONERS:
        raise ConfigError(f"unknown partitioner {name!r}; choose one of {sorted(PARTITIONERS)}")
    fn = PARTITIONERS[name]
    required, optional = _params_of(fn)
    unknown = sorted(set(params) - set(required) - set(optional))
    if unknown:
        raise ConfigError(
            f"partitioner {name!r} has no parameter {unknown[0]!r}; it takes {required + optional}"
        )
    missing = [p for p in required if p not in params]
    if missing:
        raise ConfigError(f"partitioner {name!r} needs parameter {missing[0]!r}")
    return fn(groups, n_clients, seed=seed, **params)


__all__ = [
    "PARTITIONERS",
    "assign_stations",
    "count_table",
    "lambda_counts",
    "main_domains",
    "partition",
    "render_table",
    "split_dirichlet",
    "split_domains_per_client",
    "split_lambda",
    "split_station_dirichlet",
    "station_table",
    "write_table_csv",
]
