"""Checks and helpers shared by the partitioners: input validation, seeded streams, dealing.

Every partitioner is a pure function of (index groups, sizes, parameters, seed). The helpers here
keep that contract uniform: the same validation messages, one way to derive an independent random
stream per purpose, and one conservation check that runs on every result.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from feddomain.errors import ConfigError, DataError


def stream(seed: int, *keys: int | str) -> np.random.Generator:
    """A generator for one purpose, independent of the streams for other purposes.

    Keying the stream by purpose (and e.g. domain number) means that changing how many draws one
    step makes never shifts the randomness of another step.
    """
    check_seed(seed)
    words = [seed] + [zlib.crc32(k.encode()) if isinstance(k, str) else int(k) for k in keys]
    return np.random.default_rng(words)


def check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")


def check_count(name: str, value: int, minimum: int = 1) -> int:
    """Validate an integer setting such as n_clients; return it as a plain int."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def as_index_array(values: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
    """Return a 1-D int64 copy of an index array, rejecting floats, negatives and 2-D input."""
    array = np.asarray(values)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise DataError(
            f"{what} must be a 1-D integer index array, got {array.dtype} {array.shape}"
        )
    if array.min() < 0:
        raise DataError(f"{what} holds a negative index ({array.min()})")
    return array.astype(np.int64)


def as_groups(groups: Sequence[Sequence[int] | np.ndarray]) -> list[np.ndarray]:
    """Validate the source pool grouped by domain: int64 arrays, no index in two places."""
    if len(groups) == 0:
        raise DataError("groups is empty: the source pool needs at least one domain")
    arrays = [as_index_array(g, f"groups[{j}]") for j, g in enumerate(groups)]
    pooled = np.concatenate(arrays)
    if pooled.size == 0:
        raise DataError(f"groups hold no samples ({len(arrays)} empty domains)")
    unique, counts = np.unique(pooled, return_counts=True)
    if unique.size != pooled.size:
        twice = int(unique[counts > 1][0])
        raise DataError(f"groups overlap: index {twice} appears more than once")
    return arrays


def sizes_of(groups: Sequence[np.ndarray]) -> np.ndarray:
    return np.array([len(g) for g in groups], dtype=np.int64)


def blocks(perms: Sequence[np.ndarray], counts: np.ndarray) -> list[list[np.ndarray]]:
    """Cut each domain's shuffled indices into consecutive blocks of ``counts[i, j]``.

    ``counts`` is [n_parts, n_domains] and each column must sum to that domain's size. Returns
    ``out[i][j]``: part i's samples of domain j, still in shuffled order.
    """
    cuts = np.cumsum(counts, axis=0)[:-1]
    per_domain = [np.split(perm, cuts[:, j]) for j, perm in enumerate(perms)]
    return [list(part) for part in zip(*per_domain, strict=True)]


def deal(perms: Sequence[np.ndarray], counts: np.ndarray) -> list[np.ndarray]:
    """Like :func:`blocks`, but each part's domains joined into one sorted index array."""
    return [np.sort(np.concatenate(part)) for part in blocks(perms, counts)]


def check_conserved(groups: Sequence[np.ndarray], parts: Sequence[np.ndarray]) -> None:
    """Fail loudly unless ``parts`` hold every index of ``groups`` exactly once.

    A plain ``assert`` would vanish under ``python -O``; this check guards the core promise of
    every partitioner, so it always runs (one sort of the pool).
    """
    pooled = np.sort(np.concatenate(list(groups)))
    dealt = np.sort(np.concatenate(list(parts))) if len(parts) else np.zeros(0, np.int64)
    if not np.array_equal(pooled, dealt):
        raise AssertionError(
            f"partition lost or duplicated samples: {pooled.size} in, {dealt.size} out"
        )
