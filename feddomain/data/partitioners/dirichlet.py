"""Dirichlet over domains: the usual label-Dirichlet scheme with domains in place of labels.

For every domain, client shares are drawn from ``Dir(alpha, ..., alpha)`` and the domain's
shuffled samples are cut at those cumulative shares. Small alpha concentrates a domain on few
clients (heterogeneous); large alpha approaches equal shares. The whole draw is repeated until
every client has at least ``min_size`` samples, a bounded number of times.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np

from feddomain.data.partitioners.base import (
    as_groups,
    check_conserved,
    check_count,
    deal,
    sizes_of,
    stream,
)
from feddomain.errors import ConfigError

MAX_TRIES = 1000


def check_alpha(name: str, alpha: float | None, *, allow_inf: bool = False) -> float:
    """Validate a concentration; ``None`` means infinity (equal shares) where that is allowed."""
    value = math.inf if alpha is None else alpha
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0
    if not ok or (math.isinf(value) and not allow_inf):
        allowed = "a positive number or None/inf" if allow_inf else "a positive finite number"
        raise ConfigError(f"{name} must be {allowed}, got {alpha!r}")
    return float(value)


def dirichlet_counts(
    sizes: np.ndarray,
    n_parts: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int,
    what: str,
) -> np.ndarray:
    """[n_parts, n_domains] counts from Dir(alpha) shares per domain, redrawn until every part
    has ``min_size`` samples. ``alpha = inf`` deals each domain as evenly as possible instead.
    """
    if sizes.sum() < n_parts * min_size:
        raise ConfigError(
            f"{what}: {sizes.sum()} samples cannot give {n_parts} parts min_size={min_size} each"
        )
    if math.isinf(alpha):
        return _even_counts(sizes, n_parts)
    for _ in range(MAX_TRIES):
        shares = rng.dirichlet(np.full(n_parts, alpha), size=len(sizes))  # [n_domains, n_parts]
        cuts = np.floor(np.cumsum(shares, axis=1)[:, :-1] * sizes[:, None]).astype(np.int64)
        bounds = np.concatenate([np.zeros((len(sizes), 1), np.int64), cuts, sizes[:, None]], 1)
        counts = np.diff(bounds, axis=1).T
        if counts.sum(axis=1).min() >= min_size:
            return counts
    raise ConfigError(
        f"{what}: no Dir(alpha={alpha}) draw gave all {n_parts} parts >= min_size={min_size} "
        f"samples in {MAX_TRIES} tries; raise alpha or lower min_size"
    )


def _even_counts(sizes: np.ndarray, n_parts: int) -> np.ndarray:
    """Deal domain after domain round-robin, continuing where the last one stopped.

    Per domain the counts differ by at most one, and so do the parts' totals.
    """
    counts = np.zeros((n_parts, len(sizes)), dtype=np.int64)
    start = 0
    for d, n in enumerate(sizes):
        counts[:, d] = np.bincount((start + np.arange(n)) % n_parts, minlength=n_parts)
        start = (start + int(n)) % n_parts
    return counts


def split_dirichlet(
    groups: Sequence[np.ndarray], n_clients: int, alpha: float, *, seed: int, min_size: int = 1
) -> list[np.ndarray]:
    """Spread every source domain over ``n_clients`` clients with Dir(alpha) shares."""
    groups = as_groups(groups)
    n_clients = check_count("n_clients", n_clients)
    min_size = check_count("min_size", min_size, minimum=0)
    alpha = check_alpha("alpha", alpha)
    rng = stream(seed, "dirichlet/shares")
    what = f"dirichlet partition (n_clients={n_clients}, alpha={alpha})"
    counts = dirichlet_counts(sizes_of(groups), n_clients, alpha, rng, min_size, what)
    perms = [stream(seed, "dirichlet/shuffle", j).permutation(g) for j, g in enumerate(groups)]
    clients = deal(perms, counts)
    check_conserved(groups, clients)
    return clients
