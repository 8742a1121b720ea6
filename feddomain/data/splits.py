"""Which domains train, validate and test, and the index-level splits inside them.

Domain roles: leave-one-domain-out (hFedF, HFedATM, FISC's LODO table) and FISC's
"train-val-test" letter schemes such as ``ac-p-s`` (train art + cartoon, validate on photo,
test on sketch). Index splits: a per-client validation hold-out (hfedf.md §2.4), its stratified
variant, few-shot target samples per client (hfedf.md §2.6), and a target domain's unlabeled
pilot set (fedvr.md §3.6). All are seeded and conserve every index exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from feddomain.data.partitioners.base import as_index_array, check_count, stream
from feddomain.errors import ConfigError, DataError


@dataclass(frozen=True)
class DomainSplit:
    """Domain names by role. ``val`` is empty in leave-one-domain-out. ``label`` names a split
    that is not built from domain roles alone (``wilds``: the official splits, whose ``val`` and
    ``test`` are the pooled official sets, not domains)."""

    train: tuple[str, ...]
    val: tuple[str, ...]
    test: tuple[str, ...]
    label: str = ""

    def __post_init__(self) -> None:
        if not self.train or not self.test:
            raise ConfigError(f"a domain split needs train and test domains, got {self}")
        roles = [*self.train, *self.val, *self.test]
        repeated = sorted({d for d in roles if roles.count(d) > 1})
        if repeated:
            raise ConfigError(f"domain {repeated[0]!r} has more than one role in {self}")

    @property
    def name(self) -> str:
        """``lodo-<target>`` without a validation domain, else initials like ``ac-p-s``.

        Initials are used only when they are distinct within the split; otherwise the full names
        are joined with ``+``.
        """
        if self.label:
            return self.label
        if not self.val and len(self.test) == 1:
            return f"lodo-{self.test[0]}"
        roles = (self.train, self.val, self.test)
        initials = [d[0].lower() for d in (*self.train, *self.val, *self.test)]
        if len(set(initials)) == len(initials):
            return "-".join("".join(d[0].lower() for d in role) for role in roles)
        return "-".join("+".join(role) for role in roles)


def leave_one_domain_out(domains: Sequence[str]) -> list[DomainSplit]:
    """One split per domain, that domain the target and all others (in order) the sources."""
    domains = tuple(domains)
    if len(domains) < 2:
        raise ConfigError(f"leave-one-domain-out needs at least 2 domains, got {list(domains)}")
    return [
        DomainSplit(train=tuple(d for d in domains if d != target), val=(), test=(target,))
        for target in domains
    ]


def _domain_for_letter(letter: str, domains: Sequence[str], scheme: str) -> str:
    matches = [d for d in domains if d[:1].lower() == letter]
    if len(matches) == 1:
        return matches[0]
    problem = "matches no domain" if not matches else f"is ambiguous ({', '.join(matches)})"
    raise ConfigError(f"letter {letter!r} in scheme {scheme!r} {problem}; domains: {list(domains)}")


def parse_scheme(scheme: str, domains: Sequence[str]) -> DomainSplit:
    """``"ac-p-s"`` -> train (art, cartoon), val (photo), test (sketch), by first letters.

    ``"lodo-<domain>"`` gives that domain's leave-one-domain-out split, so the names of
    leave-one-domain-out splits and of letter schemes read back to the same split.
    """
    domains = tuple(domains)
    if scheme.startswith("lodo-"):
        target = scheme.removeprefix("lodo-")
        if target not in domains:
            raise ConfigError(
                f"unknown target {target!r} in scheme {scheme!r}; domains: {list(domains)}"
            )
        return next(s for s in leave_one_domain_out(domains) if s.test == (target,))
    fields = scheme.lower().split("-")
    if len(fields) != 3 or not all(fields):
        raise ConfigError(
            f"scheme {scheme!r} must read <train letters>-<val letter(s)>-<test letter(s)> "
            "like 'ac-p-s', or lodo-<domain>"
        )
    train, val, test = (tuple(_domain_for_letter(c, domains, scheme) for c in f) for f in fields)
    return DomainSplit(train=train, val=val, test=test)


def _as_index_set(values: np.ndarray, what: str) -> np.ndarray:
    """Index array without repeats: a split of a set must not see a sample twice."""
    array = as_index_array(values, what)
    if np.unique(array).size != array.size:
        raise DataError(f"{what} holds repeated indices")
    return array


def _no_train_left(fraction: float, n: int) -> ConfigError:
    return ConfigError(f"hold-out fraction {fraction} of {n} samples leaves none to train")


def _check_fraction(fraction: float) -> None:
    if not 0 <= fraction < 1:
        raise ConfigError(f"hold-out fraction must be in [0, 1), got {fraction!r}")


def holdout(
    indices: np.ndarray, fraction: float = 0.1, *, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded unstratified (train, val) split with ``round(fraction * n)`` validation samples.

    ``round`` is Python's (halves to even), as in hfedf.md §2.4. Both arrays come back sorted.
    """
    indices = _as_index_set(indices, "indices")
    _check_fraction(fraction)
    n_val = round(fraction * indices.size)
    if indices.size and n_val == indices.size:
        raise _no_train_left(fraction, indices.size)
    shuffled = stream(seed, "holdout").permutation(indices)
    return np.sort(shuffled[n_val:]), np.sort(shuffled[:n_val])


def pilot_split(
    indices: np.ndarray, fraction: float, domain: str, *, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded (evaluated, pilot) split of target ``domain``: ``round(fraction * n)`` images
    become its unlabeled pilot set and leave evaluation. Drawn without labels (the pilot is
    unlabeled) from the seed and the domain's name only, so every method, split and node scores
    the same remaining images."""
    indices = _as_index_set(indices, "indices")
    _check_fraction(fraction)
    n_pilot = round(fraction * indices.size)
    if fraction > 0 and not 0 < n_pilot < indices.size:
        raise ConfigError(
            f"split.pilot_fraction {fraction} of a target domain's {indices.size} images gives "
            f"{n_pilot} pilot image(s); it needs at least one, and one left to evaluate"
        )
    shuffled = stream(seed, "pilot", domain).permutation(indices)
    return np.sort(shuffled[n_pilot:]), np.sort(shuffled[:n_pilot])


def share_like(
    groups: Sequence[np.ndarray], parts: Sequence[np.ndarray], group_of: np.ndarray, *, seed: int
) -> list[np.ndarray]:
    """Divide each group's indices among clients in proportion to how many samples of that group
    each client's ``parts`` entry holds (``group_of[i]``: the group of sample i).

    WILDS' in-domain validation (``id_val``) follows each client's training mix this way: at
    lambda = 0 a client's validation is its own location's. Shares are rounded by largest
    remainder (ties: the lower client), each group is shuffled with its own seeded stream and
    cut into consecutive blocks; a group no client trains on is left out. Sorted arrays.
    """
    out: list[list[np.ndarray]] = [[] for _ in parts]
    for j, group in enumerate(groups):
        group = _as_index_set(group, f"group {j}")
        weights = np.array([np.count_nonzero(group_of[p] == j) for p in parts], dtype=np.float64)
        if not group.size or not weights.sum():
            continue
        quota = weights / weights.sum() * group.size
        sizes = np.floor(quota).astype(np.int64)
        order = np.argsort(-(quota - sizes), kind="stable")
        sizes[order[: group.size - sizes.sum()]] += 1
        shuffled = stream(seed, "share_like", f"group {j}").permutation(group)
        for c, block in enumerate(np.split(shuffled, np.cumsum(sizes)[:-1])):
            out[c].append(block)
    return [np.sort(np.concatenate(b)) if b else np.zeros(0, np.int64) for b in out]


def _aligned_labels(indices: np.ndarray, labels: Sequence[int] | np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.shape != indices.shape:
        raise DataError(
            f"labels must hold one label per index: {labels.shape} labels, {indices.shape} indices"
        )
    return labels


def stratified_holdout(
    indices: np.ndarray, labels: Sequence[int] | np.ndarray, fraction: float = 0.1, *, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Like :func:`holdout` but per class: ``round(fraction * n_c)`` of class c are validation.

    ``labels[i]`` is the class of ``indices[i]``.
    """
    indices = _as_index_set(indices, "indices")
    labels = _aligned_labels(indices, labels)
    _check_fraction(fraction)
    val_parts = []
    for c in np.unique(labels):
        members = stream(seed, "stratified_holdout", f"class {c}").permutation(indices[labels == c])
        val_parts.append(members[: round(fraction * members.size)])
    val = np.sort(np.concatenate(val_parts)) if val_parts else np.zeros(0, np.int64)
    train = np.setdiff1d(indices, val)
    if indices.size and train.size == 0:
        raise _no_train_left(fraction, indices.size)
    return train, val


def few_shot(
    target_indices: np.ndarray,
    labels: Sequence[int] | np.ndarray,
    k: int,
    n_clients: int,
    *,
    seed: int,
    per_class: bool = True,
) -> tuple[list[np.ndarray], np.ndarray]:
    """Give each client k labelled target samples per class (or k in total); return the rest.

    Samples are drawn without replacement and are disjoint across clients; they leave the
    evaluation set (``remaining``). When a class has fewer than ``k * n_clients`` samples, all
    of them are dealt round-robin, so clients' shares differ by at most one. ``labels[i]`` is the
    class of ``target_indices[i]``.
    """
    indices = _as_index_set(target_indices, "target_indices")
    labels = _aligned_labels(indices, labels)
    k = check_count("k", k, minimum=0)
    n_clients = check_count("n_clients", n_clients)
    if per_class:
        pools = {f"class {c}": indices[labels == c] for c in np.unique(labels)}
    else:
        pools = {"all": indices}
    shots: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
    for key, pool in pools.items():
        drawn = stream(seed, "few_shot", key).permutation(pool)[: k * n_clients]
        for i in range(n_clients):
            shots[i].append(drawn[i::n_clients])
    per_client = [np.sort(np.concatenate(s)) if s else np.zeros(0, np.int64) for s in shots]
    given = np.concatenate(per_client)
    remaining = np.setdiff1d(indices, given)
    if given.size + remaining.size != indices.size:
        raise AssertionError("few-shot sampling lost or duplicated target samples")
    return per_client, remaining
