"""Bai et al.'s lambda splitter (fisc.md §2.4, hfedatm.md §2.4): exact count tables."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from feddomain.data.partitioners.lambda_mix import (
    lambda_counts,
    main_domain_counts,
    main_domains,
    split_lambda,
)
from feddomain.errors import ConfigError
from tests.pacs_listing import list_pacs


def synthetic(sizes) -> tuple[list[np.ndarray], np.ndarray]:
    bounds = np.cumsum((0, *sizes))
    groups = [np.arange(bounds[j], bounds[j + 1]) for j in range(len(sizes))]
    return groups, np.repeat(np.arange(len(sizes)), sizes)


def table(clients, domain_of, n_domains) -> np.ndarray:
    return np.stack([np.bincount(domain_of[c], minlength=n_domains) for c in clients])


def test_hand_computed_small_case() -> None:
    # sizes [10, 6], N=4, lam=0.5.
    # m: start (1,1); ratios 10,6 -> m=(2,1); ratios 5,6 -> m=(2,2). main = [0,0,1,1].
    # q[:,0] = 10*(0.5/2 + 0.5/4) = 3.75 (main) | 10*0.125 = 1.25  -> floor 3,3,1,1; r=2 -> c0,c1
    # q[:,1] = 6*0.125 = 0.75 | 6*(0.5/2 + 0.125) = 2.25           -> floor 0,0,2,2; r=2 -> c0,c1
    groups, domain_of = synthetic((10, 6))
    clients = split_lambda(groups, 4, 0.5, seed=0)
    assert table(clients, domain_of, 2).tolist() == [[4, 1], [4, 1], [1, 2], [1, 2]]
    assert main_domains(4, [10, 6]).tolist() == [0, 0, 1, 1]


def test_leftovers_skip_clients_with_whole_expected_counts() -> None:
    # sizes [10, 7], N=4, lam=0: m=(2,2); domain 1 has q = 0,0,3.5,3.5 -> floor 0,0,3,3, r=1.
    # Client 0's q is exactly 0, so the leftover goes to client 2 (the reference code would give
    # it to client 0 and break lam=0's single-domain promise).
    assert lambda_counts(4, [10, 7], 0.0).tolist() == [[5, 0], [5, 0], [0, 4], [0, 3]]


def test_more_domains_than_clients_branch() -> None:
    # sizes [5,3,8,2], N=2. P0, largest first: d2(8)->c0, d0(5)->c1, d1(3)->c1 (5<8),
    # d3(2)->c0 (tie 8 vs 8 -> lowest). So c0 owns {2,3}, c1 owns {0,1}.
    # lam=0.5: q = 0.5*n/2 + 0.5*P0
    #   d0: 1.25 | 3.75 -> 1,3 r=1 -> 2,3     d1: 0.75 | 2.25 -> 0,2 r=1 -> 1,2
    #   d2: 6    | 2    -> 6,2 r=0            d3: 1.5  | 0.5  -> 1,0 r=1 -> 2,0
    assert lambda_counts(2, [5, 3, 8, 2], 0.5).tolist() == [[2, 1, 6, 2], [3, 2, 2, 0]]
    assert lambda_counts(2, [5, 3, 8, 2], 0.0).tolist() == [[0, 0, 8, 2], [5, 3, 0, 0]]
    # lam=1: n/2 = 2.5, 1.5, 4, 1 -> floors 2,1,4,1; leftovers to client 0 for d0, d1
    assert lambda_counts(2, [5, 3, 8, 2], 1.0).tolist() == [[3, 2, 4, 1], [2, 1, 4, 1]]
    assert main_domains(2, [5, 3, 8, 2]).tolist() == [2, 0]
    groups, domain_of = synthetic((5, 3, 8, 2))
    clients = split_lambda(groups, 2, 0.5, seed=4)
    assert table(clients, domain_of, 4).tolist() == [[2, 1, 6, 2], [3, 2, 2, 0]]


@pytest.mark.parametrize("n_clients", range(3, 11))
def test_lambda_zero_single_domain(n_clients: int) -> None:
    sizes = (13, 7, 22)
    groups, domain_of = synthetic(sizes)
    counts = table(split_lambda(groups, n_clients, 0.0, seed=1), domain_of, 3)
    assert ((counts > 0).sum(axis=1) == 1).all()
    main = main_domains(n_clients, sizes)
    assert np.array_equal(counts.argmax(axis=1), main)
    assert (np.diff(main) >= 0).all()  # clients are laid out by main domain


@pytest.mark.parametrize("n_clients", [1, 2, 3, 7, 40])
def test_lambda_one_is_the_global_mix(n_clients: int) -> None:
    sizes = np.array([13, 7, 22, 0, 5])
    counts = lambda_counts(n_clients, sizes, 1.0)
    assert np.abs(counts - sizes / n_clients).max() < 1


def test_larger_lambda_is_more_homogeneous() -> None:
    sizes = np.array([300, 500, 900])
    global_mix = sizes / sizes.sum()

    def mean_tv(lam: float) -> float:
        counts = lambda_counts(10, sizes, lam)
        mix = counts / counts.sum(axis=1, keepdims=True)
        return float(0.5 * np.abs(mix - global_mix).sum(axis=1).mean())

    distances = [mean_tv(lam) for lam in (0.0, 0.1, 0.5, 0.9, 1.0)]
    assert distances == sorted(distances, reverse=True)
    assert distances[0] > 0.4 and distances[-1] < 0.01


def test_invalid_lambda() -> None:
    with pytest.raises(ConfigError, match=r"lam must be a number in \[0, 1\], got 1.5"):
        lambda_counts(4, [10, 6], 1.5)
    with pytest.raises(ConfigError, match=r"got True"):
        lambda_counts(4, [10, 6], True)


# ---- PACS, target photo: art 2048, cartoon 2344, sketch 3929 ----------------------------------


def reference_counts(sizes: list[int], n: int, lam: Fraction) -> list[list[int]]:
    """The pseudo-code of fisc.md §2.4 / hfedatm.md §2.4 in plain Python fractions (first
    branch), with this project's leftover rule: skip clients whose expected count is whole."""
    m = [1] * len(sizes)
    while sum(m) < n:
        ratios = [Fraction(s, k) for s, k in zip(sizes, m, strict=True)]
        m[ratios.index(max(ratios))] += 1
    main = [j for j, k in enumerate(m) for _ in range(k)]
    q = [
        [s * ((1 - lam) * (main[i] == j) / m[j] + lam / n) for j, s in enumerate(sizes)]
        for i in range(n)
    ]
    out = [[math.floor(x) for x in row] for row in q]
    for j, s in enumerate(sizes):
        leftover = s - sum(row[j] for row in out)
        for i in [i for i in range(n) if q[i][j] != out[i][j]][:leftover]:
            out[i][j] += 1
    return out


@pytest.fixture(scope="module")
def pacs(shared_data):
    return list_pacs(shared_data)


@pytest.mark.parametrize("n_clients", [3, 5, 100])
@pytest.mark.parametrize("lam", ["0", "0.1", "1"])
def test_pacs_counts_follow_the_formula(pacs, n_clients: int, lam: str) -> None:
    groups = pacs.groups("photo")
    clients = split_lambda(groups, n_clients, float(lam), seed=2)
    assert np.array_equal(np.sort(np.concatenate(clients)), np.sort(np.concatenate(groups)))
    counts = table(clients, pacs.domain_ids, 4)
    assert (counts[:, 2] == 0).all()  # photo is the target
    expected = reference_counts([2048, 2344, 3929], n_clients, Fraction(lam))
    assert counts[:, [0, 1, 3]].tolist() == expected


def test_pacs_hundred_clients_by_hand(pacs) -> None:
    sizes = [2048, 2344, 3929]
    # D'Hondt: divisor 81.9 gives floor(n/81.9) = 25, 28, 47 (sum 100)
    assert main_domain_counts(100, sizes).tolist() == [25, 28, 47]
    zero = lambda_counts(100, sizes, 0.0)
    # art 2048/25 = 81.92: 23 clients get 82, 2 get 81; cartoon 2344/28 = 83.71: 20 x 84, 8 x 83;
    # sketch 3929/47 = 83.60: 28 x 84, 19 x 83
    assert zero[:25, 0].tolist() == [82] * 23 + [81] * 2
    assert zero[25:53, 1].tolist() == [84] * 20 + [83] * 8
    assert zero[53:, 2].tolist() == [84] * 28 + [83] * 19
    # lam=0.1: art main q = 2048*(0.9/25 + 0.001) = 75.776, others 2.048, leftover 23;
    # cartoon main 77.69, others 2.344, leftover 44; sketch main 79.16, others 3.929, leftover 57
    tenth = lambda_counts(100, sizes, 0.1)
    assert tenth[0].tolist() == [76, 3, 4]
    assert tenth[30].tolist() == [2, 78, 4]
    assert tenth[99].tolist() == [2, 2, 79]
    clients = split_lambda(pacs.groups("photo"), 100, 0.1, seed=0)
    assert table(clients, pacs.domain_ids, 4)[:, [0, 1, 3]].tolist() == tenth.tolist()


def test_pacs_seeds(pacs) -> None:
    groups = pacs.groups("photo")
    a = split_lambda(groups, 100, 0.1, seed=5)
    b = split_lambda(groups, 100, 0.1, seed=5)
    c = split_lambda(groups, 100, 0.1, seed=6)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not any(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
