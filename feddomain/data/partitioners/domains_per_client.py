"""hFedF's allocation (Alg. 5): every client holds equal-size parts of exactly ``d`` domains.

With K source domains, ``a = floor(N*d / K)`` parts are cut from every domain and ``b = N*d mod K``
of the largest domains give one extra part, so exactly ``N*d`` parts exist. Listing the parts
domain by domain and giving client i the elements i, i+N, i+2N, ... hands each client d parts
that are N positions apart; since no domain has more than N parts, they come from d different
domains. A seeded permutation then maps the bundles to client ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from feddomain.data.partitioners.base import (
    as_groups,
    check_conserved,
    check_count,
    sizes_of,
    stream,
)
from feddomain.errors import ConfigError


def parts_per_domain(sizes: Sequence[int], n_clients: int, d: int) -> np.ndarray:
    """How many parts Alg. 5 cuts from each domain: a, plus one for the b largest.

    Ties in size go to the domain that comes first in canonical order.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    k = len(sizes)
    a, b = divmod(n_clients * d, k)
    parts = np.full(k, a, dtype=np.int64)
    largest = np.argsort(-sizes, kind="stable")[:b]
    parts[largest] += 1
    return parts


def split_domains_per_client(
    groups: Sequence[np.ndarray], n_clients: int, d: int, *, seed: int
) -> list[np.ndarray]:
    """Give each of ``n_clients`` clients equal-size parts of ``d`` distinct source domains.

    ``groups[j]`` holds the global indices of source domain j. Returns client i's indices
    (sorted). Requires ``d <= K`` and ``n_clients * d >= K`` (otherwise some domain would get no
    part and its samples would be lost).
    """
    groups = as_groups(groups)
    n_clients = check_count("n_clients", n_clients)
    d = check_count("d", d)
    k = len(groups)
    check_domain_counts(n_clients, d, k)
    sizes = sizes_of(groups)
    n_parts = parts_per_domain(sizes, n_clients, d)
    too_small = np.flatnonzero(sizes < n_parts)
    if too_small.size:
        j = int(too_small[0])
        raise ConfigError(
            f"source domain {j} has {sizes[j]} samples, too few for {n_parts[j]} parts "
            f"(n_clients={n_clients}, d={d}, {k} domains)"
        )

    parts: list[np.ndarray] = []
    part_domain: list[int] = []
    for j, group in enumerate(groups):
        shuffled = stream(seed, "domains_per_client/shuffle", j).permutation(group)
        parts.extend(np.array_split(shuffled, n_parts[j]))
        part_domain.extend([j] * int(n_parts[j]))

    bundles = [list(range(i, len(parts), n_clients)) for i in range(n_clients)]
    for bundle in bundles:
        if len({part_domain[p] for p in bundle}) != d:
            raise AssertionError(f"Alg. 5 gave a client parts {bundle} from repeated domains")
    order = stream(seed, "domains_per_client/assign").permutation(n_clients)
    clients = [np.sort(np.concatenate([parts[p] for p in bundles[b]])) for b in order]
    check_conserved(groups, clients)
    return clients


def check_domain_counts(n_clients: int, d: int, k: int) -> None:
    """Whether ``n_clients`` clients of ``d`` distinct domains each can cover ``k`` source
    domains; checked from the config alone, before any data is read."""
    if d > k:
        raise ConfigError(
            f"d={d} domains per client is impossible with {k} source domains "
            f"(n_clients={n_clients}); d must be <= {k}"
        )
    if n_clients * d < k:
        raise ConfigError(
            f"n_clients={n_clients} with d={d} gives {n_clients * d} parts for {k} source domains: "
            "some domain would be left out; need n_clients * d >= number of domains"
        )
