"""Bai et al.'s heterogeneity splitter: a lambda-blend of "one main domain" and "1/N of each".

``lam = 0`` gives every client a single (main) domain; ``lam = 1`` gives every client the global
domain proportions; larger lambda is more homogeneous (the code's and appendix's reading, see
fisc.md §2.4). The count table is deterministic; the seed only picks which samples fill it.

Two branches, as in the reference splitter:

* at most as many non-empty domains as clients: main-domain client counts ``m_d`` by repeatedly
  incrementing ``argmax_d n_d / m_d`` (ties: lowest index); clients are laid out domain by
  domain, so client order follows main domain (stations rely on this);
  ``q[i,d] = n_d * ((1-lam) * [d == main(i)] / m_d + lam / N)``;
* more non-empty domains than clients: whole domains go greedily (largest first) to the client
  with the fewest samples (``P0``), blended with ``P1[i,d] = n_d / N``.

Counts are ``floor(q)``; each domain's leftover ``r_d = n_d - sum_i floor(q[i,d])`` goes one each
to the first ``r_d`` clients whose expected count ``q[i,d]`` is not a whole number. Deviation
from the reference code, which hands leftovers to clients 0..r_d-1 whatever their main domain:
that gives lam = 0 clients stray samples of other domains whenever ``m_d`` does not divide
``n_d``. Skipping clients whose expected count is exact keeps lam = 0 single-domain and changes
nothing where all fractional parts are non-zero (e.g. lam = 1).

All arithmetic is exact (``fractions.Fraction``); ``lam`` is read as the decimal it prints as,
so ``0.1`` means 1/10 and no floor lands on the wrong side of an integer.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from feddomain.data.partitioners.base import (
    as_groups,
    check_conserved,
    check_count,
    deal,
    sizes_of,
    stream,
)
from feddomain.errors import ConfigError, DataError


def main_domain_counts(n_clients: int, sizes: Sequence[int]) -> np.ndarray:
    """``m_d``: clients whose main domain is d (first branch); 0 for empty domains."""
    sizes = np.asarray(sizes, dtype=np.int64)
    m = (sizes > 0).astype(np.int64)
    while m.sum() < n_clients:
        ratio = np.divide(sizes, m, out=np.full(len(sizes), -1.0), where=m > 0)
        m[int(np.argmax(ratio))] += 1
    return m


def _greedy_owner(n_clients: int, sizes: np.ndarray) -> np.ndarray:
    """Second branch: client that receives each whole domain (largest domain first)."""
    owner = np.zeros(len(sizes), dtype=np.int64)
    load = np.zeros(n_clients, dtype=np.int64)
    for j in np.argsort(-sizes, kind="stable"):
        owner[j] = int(np.argmin(load))
        load[owner[j]] += sizes[j]
    return owner


def _check_sizes(sizes: Sequence[int]) -> np.ndarray:
    array = np.asarray(sizes, dtype=np.int64)
    if array.ndim != 1 or array.size == 0 or array.min() < 0 or array.sum() == 0:
        raise DataError(f"domain sizes must be non-negative with a positive total, got {sizes!r}")
    return array


def _few_domains(n_clients: int, sizes: np.ndarray) -> bool:
    return int((sizes > 0).sum()) <= n_clients


def _holdings(n_clients: int, sizes: np.ndarray) -> tuple[np.ndarray, list[Fraction]]:
    """Which (client, domain) cells get the (1 - lam) share, and that share's size per domain.

    First branch: client i's main domain, share n_d / m_d. Second branch: the whole domains a
    client owns, share n_d.
    """
    n_domains = len(sizes)
    if _few_domains(n_clients, sizes):
        m = main_domain_counts(n_clients, sizes)
        main = np.repeat(np.arange(n_domains), m)
        holds = main[:, None] == np.arange(n_domains)[None, :]
        return holds, [Fraction(int(n), max(int(k), 1)) for n, k in zip(sizes, m, strict=True)]
    owner = _greedy_owner(n_clients, sizes)
    holds = np.arange(n_clients)[:, None] == owner[None, :]
    return holds, [Fraction(int(n)) for n in sizes]


def main_domains(n_clients: int, sizes: Sequence[int]) -> np.ndarray:
    """Each client's main domain: the domain it holds alone at lam = 0.

    In the first branch clients are ordered by main domain (non-decreasing). In the second
    branch a client owns several whole domains; its main domain is the largest of them.
    """
    n_clients = check_count("n_clients", n_clients)
    sizes = _check_sizes(sizes)
    holds, _ = _holdings(n_clients, sizes)
    return np.argmax(np.where(holds, sizes[None, :], -1), axis=1)


def lambda_counts(n_clients: int, sizes: Sequence[int], lam: float) -> np.ndarray:
    """Integer [n_clients, n_domains] table of how many samples of domain d client i gets."""
    n_clients = check_count("n_clients", n_clients)
    if isinstance(lam, bool) or not isinstance(lam, numbers.Real) or not 0 <= lam <= 1:
        raise ConfigError(f"lam must be a number in [0, 1], got {lam!r}")
    lam_q = Fraction(str(lam))
    sizes = _check_sizes(sizes)
    holds, own = _holdings(n_clients, sizes)
    counts = np.zeros(holds.shape, dtype=np.int64)
    for d, n in enumerate(sizes):
        # q[i, d] takes only two values: with and without the (1 - lam) share
        q_out = lam_q * Fraction(int(n), n_clients)
        q_in = q_out + (1 - lam_q) * own[d]
        column = holds[:, d]
        counts[:, d] = np.where(column, math.floor(q_in), math.floor(q_out))
        fractional = np.where(column, q_in.denominator != 1, q_out.denominator != 1)
        leftover = int(n) - int(counts[:, d].sum())
        counts[np.flatnonzero(fractional)[:leftover], d] += 1
    if not np.array_equal(counts.sum(axis=0), sizes):
        raise AssertionError(f"lambda counts {counts.sum(axis=0)} do not add up to sizes {sizes}")
    return counts


def split_lambda(
    groups: Sequence[np.ndarray], n_clients: int, lam: float, *, seed: int
) -> list[np.ndarray]:
    """Deal each domain's shuffled samples to clients in blocks given by :func:`lambda_counts`.

    Client i's indices come back sorted; client order is the splitter's (by main domain, see
    :func:`main_domains`), which ``stations.assign_stations(..., "contiguous")`` relies on.
    """
    groups = as_groups(groups)
    counts = lambda_counts(n_clients, sizes_of(groups), lam)
    perms = [stream(seed, "lambda/shuffle", j).permutation(g) for j, g in enumerate(groups)]
    clients = deal(perms, counts)
    check_conserved(groups, clients)
    return clients
