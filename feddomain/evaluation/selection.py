"""Model selection: which evaluated round of a run stands for that run in a table.

The rules are named, as in DomainBed's ``model_selection.py``, so every table can say how its
numbers were chosen:

- ``source_val`` (default): the round with the highest ``id_acc``, i.e. accuracy on the clients'
  held-out source validation data. No target data is looked at.
- ``last``: the final evaluated round (hFedF's protocol reports final-round values).
- ``oracle``: the round with the highest ``target_val_acc`` when the run has a target validation
  split, else the highest ``ood_acc``. It peeks at the target domain, so outputs must label it
  "oracle".

Ties go to the latest round: validation accuracy on a few hundred images moves in coarse steps
and often plateaus, and among equally good rounds the latest is the one that trained longest,
which is also what ``last`` would pick once validation has saturated.
"""

from __future__ import annotations

from collections import Counter

from feddomain.errors import ConfigError, DataError

RULES = ("source_val", "last", "oracle")


def _ordered(records: list[dict]) -> list[dict]:
    """Records sorted by round; a missing or repeated round makes the choice ambiguous."""
    if not records:
        raise DataError("no evaluated rounds to select from (empty metrics)")
    for i, rec in enumerate(records):
        if "round" not in rec:
            raise DataError(f"metrics record #{i} has no 'round' key: {sorted(rec)}")
    repeated = sorted(r for r, n in Counter(rec["round"] for rec in records).items() if n > 1)
    if repeated:
        raise DataError(
            f"metrics records repeat round(s) {repeated}; which one counts is ambiguous"
        )
    return sorted(records, key=lambda rec: rec["round"])


def _best(records: list[dict], key: str) -> dict:
    for rec in records:
        if key not in rec:
            raise DataError(f"metrics record of round {rec['round']} has no {key!r} key")
    best = max(rec[key] for rec in records)
    return [rec for rec in records if rec[key] == best][-1]


def _oracle_key(records: list[dict]) -> str:
    having = [rec["round"] for rec in records if "target_val_acc" in rec]
    if not having:
        return "ood_acc"
    if len(having) != len(records):
        raise DataError(
            f"'target_val_acc' is logged for rounds {having} only; the oracle needs it on every "
            "evaluated round or on none"
        )
    return "target_val_acc"


def select(records: list[dict], rule: str = "source_val") -> dict:
    """The record chosen by ``rule``, copied, with ``selection`` and ``selected_round`` added."""
    if rule not in RULES:
        raise ConfigError(f"unknown selection rule {rule!r}; choose one of {list(RULES)}")
    ordered = _ordered(records)
    if rule == "last":
        chosen = ordered[-1]
    elif rule == "source_val":
        chosen = _best(ordered, "id_acc")
    else:
        chosen = _best(ordered, _oracle_key(ordered))
    return {**chosen, "selection": rule, "selected_round": chosen["round"]}
