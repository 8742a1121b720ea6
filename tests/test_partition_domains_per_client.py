"""hFedF Alg. 5 (hfedf.md §2.3): acceptance check A2 (§8) plus the documented PACS mixtures."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from feddomain.data.partitioners.domains_per_client import (
    parts_per_domain,
    split_domains_per_client,
)
from feddomain.errors import ConfigError
from tests.pacs_listing import list_pacs

SIZES = (40, 70, 55)  # unequal: largest is domain 1, then 2, then 0


def synthetic(sizes=SIZES) -> tuple[list[np.ndarray], np.ndarray]:
    """Domain j owns a contiguous block of global indices; also return index -> domain."""
    bounds = np.cumsum((0, *sizes))
    groups = [np.arange(bounds[j], bounds[j + 1]) for j in range(len(sizes))]
    return groups, np.repeat(np.arange(len(sizes)), sizes)


def client_counts(clients, domain_of, n_domains) -> np.ndarray:
    return np.stack([np.bincount(domain_of[c], minlength=n_domains) for c in clients])


def expected_parts(n_clients: int, d: int, sizes) -> np.ndarray:
    """a parts for every domain, one more for each of the b largest (ranked by hand below)."""
    a, b = divmod(n_clients * d, len(sizes))
    by_size = sorted(range(len(sizes)), key=lambda j: -sizes[j])
    return np.array([a + (j in by_size[:b]) for j in range(len(sizes))])


@pytest.mark.parametrize("n_clients", range(2, 13))
@pytest.mark.parametrize("d", [1, 2, 3])
def test_acceptance_a2(n_clients: int, d: int) -> None:
    groups, domain_of = synthetic()
    if n_clients * d < 3:
        # N=2, d=1: Alg. 5 would cut 2 parts from 3 domains and drop the smallest one
        with pytest.raises(ConfigError, match=r"n_clients=2 with d=1 gives 2 parts for 3"):
            split_domains_per_client(groups, n_clients, d, seed=0)
        return
    clients = split_domains_per_client(groups, n_clients, d, seed=0)
    assert len(clients) == n_clients
    # disjoint and complete
    assert np.array_equal(np.sort(np.concatenate(clients)), np.arange(sum(SIZES)))
    counts = client_counts(clients, domain_of, 3)
    # every client holds exactly d distinct domains (one part of each)
    assert ((counts > 0).sum(axis=1) == d).all()
    # a domain cut into p parts is held by p clients: N*d parts, b largest domains get a+1
    parts = (counts > 0).sum(axis=0)
    assert np.array_equal(parts, expected_parts(n_clients, d, SIZES))
    assert parts.sum() == n_clients * d
    # equal-size parts: sizes floor or ceil of n_j / p_j
    for j, n in enumerate(SIZES):
        held = counts[counts[:, j] > 0, j]
        assert set(held.tolist()) <= {n // parts[j], -(-n // parts[j])}


def test_fig2b_largest_domain_halved_others_whole() -> None:
    groups, domain_of = synthetic()
    counts = client_counts(split_domains_per_client(groups, 2, 2, seed=3), domain_of, 3)
    assert sorted(counts[:, 1].tolist()) == [35, 35]  # domain 1 (70) is cut in two
    assert sorted(counts[:, 0].tolist()) == [0, 40]  # the others stay whole
    assert sorted(counts[:, 2].tolist()) == [0, 55]
    assert counts[:, 0].argmax() != counts[:, 2].argmax()  # ... and go to different clients


def test_three_clients_three_domains_get_a_third_of_everything() -> None:
    groups, domain_of = synthetic()
    counts = client_counts(split_domains_per_client(groups, 3, 3, seed=0), domain_of, 3)
    for j, n in enumerate(SIZES):
        assert set(counts[:, j].tolist()) <= {n // 3, n // 3 + 1}


def test_worked_example_n3_d2_pairs() -> None:
    # hfedf.md §2.3: c1={A1,B2}, c2={A2,C1}, c3={B1,C2} up to the client permutation
    groups, domain_of = synthetic()
    counts = client_counts(split_domains_per_client(groups, 3, 2, seed=0), domain_of, 3)
    pairs = Counter(frozenset(np.flatnonzero(row).tolist()) for row in counts)
    assert pairs == Counter([frozenset({0, 1}), frozenset({0, 2}), frozenset({1, 2})])


def test_seeded_determinism_and_seed_sensitivity() -> None:
    groups, _ = synthetic()
    first = split_domains_per_client(groups, 5, 2, seed=7)
    again = split_domains_per_client(groups, 5, 2, seed=7)
    other = split_domains_per_client(groups, 5, 2, seed=8)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_size_ties_go_to_the_first_domain() -> None:
    # N=4, d=1, 3 domains: a=1, b=1; domains 0 and 1 tie for largest -> domain 0 gets 2 parts
    assert parts_per_domain([50, 50, 10], 4, 1).tolist() == [2, 1, 1]


def test_invalid_settings_name_the_values() -> None:
    groups, _ = synthetic()
    with pytest.raises(ConfigError, match=r"d=4 domains per client .* 3 source domains"):
        split_domains_per_client(groups, 5, 4, seed=0)
    with pytest.raises(ConfigError, match=r"d must be an integer >= 1, got 0"):
        split_domains_per_client(groups, 5, 0, seed=0)
    tiny, _ = synthetic((2, 10, 10))
    with pytest.raises(ConfigError, match=r"source domain 0 has 2 samples, too few for 9 parts"):
        split_domains_per_client(tiny, 9, 3, seed=0)


# PACS, target photo: sources art 2048 (A), cartoon 2344 (C), sketch 3929 (S).
# Expected per (N, d): parts per domain (A, C, S) and the multiset of client domain sets, derived
# by hand from the part list [A.., C.., S..] where client i takes elements i, i+N, i+2N.
PACS_EXPECTED = {
    (3, 1): ((1, 1, 1), {"A": 1, "C": 1, "S": 1}),
    (3, 2): ((2, 2, 2), {"AC": 1, "AS": 1, "CS": 1}),
    (3, 3): ((3, 3, 3), {"ACS": 3}),
    (5, 1): ((1, 2, 2), {"A": 1, "C": 2, "S": 2}),  # a=1, b=2: C and S are the largest
    (5, 2): ((3, 3, 4), {"AC": 1, "AS": 2, "CS": 2}),  # a=3, b=1: S gets 4 parts
    (5, 3): ((5, 5, 5), {"ACS": 5}),
    (100, 1): ((33, 33, 34), {"A": 33, "C": 33, "S": 34}),
    # 200 parts: A at 0-65, C at 66-132, S at 133-199; client i holds i and i+100
    (100, 2): ((66, 67, 67), {"AC": 33, "AS": 33, "CS": 34}),
    (100, 3): ((100, 100, 100), {"ACS": 100}),
}


@pytest.fixture(scope="module")
def pacs(shared_data):
    return list_pacs(shared_data)


@pytest.mark.parametrize(("n_clients", "d"), sorted(PACS_EXPECTED))
def test_pacs_documented_mixtures(pacs, n_clients: int, d: int) -> None:
    groups = pacs.groups("photo")
    sizes = [len(g) for g in groups]
    assert sizes == [2048, 2344, 3929]
    clients = split_domains_per_client(groups, n_clients, d, seed=1)
    pooled = np.concatenate(groups)
    assert np.array_equal(np.sort(np.concatenate(clients)), np.sort(pooled))
    full = client_counts(clients, pacs.domain_ids, 4)  # art, cartoon, photo, sketch
    assert (full[:, 2] == 0).all()  # the target never leaks into a client
    counts = full[:, [0, 1, 3]]

    n_parts, sets = PACS_EXPECTED[(n_clients, d)]
    held = Counter("".join("ACS"[j] for j in np.flatnonzero(row)) for row in counts)
    assert held == Counter(sets)
    assert tuple((counts > 0).sum(axis=0).tolist()) == n_parts
    for j, n in enumerate(sizes):
        nonzero = counts[counts[:, j] > 0, j]
        assert np.abs(nonzero - n / n_parts[j]).max() < 1


def test_pacs_seeds(pacs) -> None:
    groups = pacs.groups("photo")
    a = split_domains_per_client(groups, 5, 2, seed=0)
    b = split_domains_per_client(groups, 5, 2, seed=0)
    c = split_domains_per_client(groups, 5, 2, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not any(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_pacs_impossible_d(pacs) -> None:
    groups = pacs.groups("photo")
    with pytest.raises(ConfigError, match=r"n_clients=2 with d=1 gives 2 parts for 3"):
        split_domains_per_client(groups, 2, 1, seed=0)
    with pytest.raises(ConfigError, match=r"d=4 .*n_clients=100"):
        split_domains_per_client(groups, 100, 4, seed=0)
