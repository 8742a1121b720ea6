"""Domain roles (LODO, FISC letter schemes) and index splits (hold-out, few-shot)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from feddomain.data.splits import (
    DomainSplit,
    few_shot,
    holdout,
    leave_one_domain_out,
    parse_scheme,
    stratified_holdout,
)
from feddomain.errors import ConfigError, DataError
from tests.pacs_listing import PACS_DOMAINS, PACS_SIZES, list_pacs

OFFICE_HOME = ("Art", "Clipart", "Product", "Real_World")


@pytest.fixture(scope="module")
def pacs(shared_data):
    return list_pacs(shared_data)


def test_pacs_listing_matches_the_documented_sizes(pacs) -> None:
    assert pacs.domains == PACS_DOMAINS
    assert len(pacs.classes) == 7
    assert {d: len(pacs.indices_of(d)) for d in pacs.domains} == PACS_SIZES


def test_leave_one_domain_out_on_pacs(pacs) -> None:
    splits = leave_one_domain_out(pacs.domains)
    assert [s.test for s in splits] == [(d,) for d in PACS_DOMAINS]
    assert all(s.val == () for s in splits)
    photo = splits[2]
    assert photo.train == ("art_painting", "cartoon", "sketch")
    assert photo.name == "lodo-photo"
    assert [parse_scheme(s.name, pacs.domains) for s in splits] == splits
    with pytest.raises(ConfigError, match=r"at least 2 domains"):
        leave_one_domain_out(["photo"])


def test_fisc_pacs_schemes(pacs) -> None:
    split = parse_scheme("ac-p-s", pacs.domains)
    assert split == DomainSplit(("art_painting", "cartoon"), ("photo",), ("sketch",))
    assert split.name == "ac-p-s"
    for scheme in ("cs-a-p", "ps-c-a", "pa-s-c"):
        s = parse_scheme(scheme, pacs.domains)
        assert Counter(s.train + s.val + s.test) == Counter(PACS_DOMAINS)
        assert s.name == scheme


def test_scheme_letters_are_case_insensitive_first_letters() -> None:
    split = parse_scheme("PR-c-a", OFFICE_HOME)
    assert split == DomainSplit(("Product", "Real_World"), ("Clipart",), ("Art",))


def test_scheme_errors_name_the_problem() -> None:
    with pytest.raises(ConfigError, match=r"letter 'x' in scheme 'ax-p-s' matches no domain"):
        parse_scheme("ax-p-s", PACS_DOMAINS)
    with pytest.raises(ConfigError, match=r"letter 's' .* is ambiguous \(sketch, sun09\)"):
        parse_scheme("a-l-s", ("art", "labelme", "sketch", "sun09"))
    with pytest.raises(ConfigError, match=r"'photo' has more than one role"):
        parse_scheme("ap-p-s", PACS_DOMAINS)
    with pytest.raises(ConfigError, match=r"scheme 'acps' must read"):
        parse_scheme("acps", PACS_DOMAINS)
    with pytest.raises(ConfigError, match=r"unknown target 'clipart'"):
        parse_scheme("lodo-clipart", PACS_DOMAINS)


def test_split_name_falls_back_to_full_names_when_initials_clash() -> None:
    split = DomainSplit(("sketch", "art"), ("sun09",), ("labelme",))
    assert split.name == "sketch+art-sun09-labelme"


@pytest.mark.parametrize(("n", "n_val"), [(2048, 205), (2344, 234), (3929, 393), (7, 1), (4, 0)])
def test_holdout_sizes_and_conservation(n: int, n_val: int) -> None:
    # round(0.1 n): 204.8 -> 205, 234.4 -> 234, 392.9 -> 393, 0.7 -> 1, 0.4 -> 0
    indices = np.arange(1000, 1000 + n) * 3
    train, val = holdout(indices, seed=0)
    assert len(val) == n_val
    assert len(np.intersect1d(train, val)) == 0
    assert np.array_equal(np.sort(np.concatenate([train, val])), indices)


def test_holdout_is_seeded() -> None:
    indices = np.arange(500)
    assert np.array_equal(holdout(indices, seed=3)[1], holdout(indices, seed=3)[1])
    assert not np.array_equal(holdout(indices, seed=3)[1], holdout(indices, seed=4)[1])


def test_holdout_rejects_bad_input() -> None:
    with pytest.raises(ConfigError, match=r"fraction must be in \[0, 1\), got 1.0"):
        holdout(np.arange(10), 1.0, seed=0)
    with pytest.raises(ConfigError, match=r"fraction 0.9 of 1 samples leaves none to train"):
        holdout(np.arange(1), 0.9, seed=0)
    with pytest.raises(DataError, match=r"indices holds repeated indices"):
        holdout(np.array([1, 2, 2]), seed=0)


def test_stratified_holdout_per_class() -> None:
    labels = np.repeat([0, 1, 2], [10, 25, 7])
    indices = np.arange(42) + 100
    train, val = stratified_holdout(indices, labels, 0.2, seed=0)
    # round(0.2 n_c): 2, 5, 1 (1.4)
    val_labels = labels[val - 100]
    assert np.bincount(val_labels).tolist() == [2, 5, 1]
    assert np.array_equal(np.sort(np.concatenate([train, val])), indices)
    with pytest.raises(DataError, match=r"one label per index"):
        stratified_holdout(indices, labels[:-1], seed=0)


def test_few_shot_per_class_with_a_short_class() -> None:
    labels = np.repeat([0, 1, 2], [10, 10, 3])
    target = np.arange(23) + 500
    shots, remaining = few_shot(target, labels, 2, 3, seed=0)
    per_client = [np.bincount(labels[s - 500], minlength=3).tolist() for s in shots]
    # classes 0, 1: 2 each; class 2 has 3 images for 3 clients x 2 shots: one each
    assert per_client == [[2, 2, 1]] * 3
    given = np.concatenate(shots)
    assert len(np.unique(given)) == len(given) == 15  # disjoint across clients
    assert len(np.intersect1d(given, remaining)) == 0  # removed from the evaluation set
    assert np.array_equal(np.sort(np.concatenate([given, remaining])), target)


def test_few_shot_total_and_shortage() -> None:
    target = np.arange(30)
    labels = np.zeros(30, dtype=np.int64)
    shots, remaining = few_shot(target, labels, 4, 3, seed=1, per_class=False)
    assert [len(s) for s in shots] == [4, 4, 4]
    assert len(remaining) == 18
    shots, remaining = few_shot(np.arange(5), np.zeros(5), 2, 3, seed=1, per_class=False)
    assert sorted(len(s) for s in shots) == [1, 2, 2]
    assert len(remaining) == 0
    shots, remaining = few_shot(target, labels, 0, 3, seed=1)
    assert [len(s) for s in shots] == [0, 0, 0]
    assert np.array_equal(remaining, target)


def test_few_shot_on_pacs_photo(pacs) -> None:
    target = pacs.indices_of("photo")
    labels = pacs.labels[target]
    shots, remaining = few_shot(target, labels, 1, 3, seed=0)
    for s in shots:
        assert sorted(pacs.labels[s].tolist()) == list(range(7))  # one image of every class
    assert len(remaining) == 1670 - 21
    a, _ = few_shot(target, labels, 1, 3, seed=0)
    b, _ = few_shot(target, labels, 1, 3, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(shots, a, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(shots, b, strict=True))
