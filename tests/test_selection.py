"""Model-selection rules on handcrafted per-round records."""

from __future__ import annotations

import pytest

from feddomain.errors import ConfigError, DataError
from feddomain.evaluation.selection import RULES, select


def _records(with_target_val: bool = False) -> list[dict]:
    # round:   5     10    15    20
    # id_acc: .60   .70   .70   .65   -> source_val: tie 10/15 -> latest = 15
    # ood:    .40   .45   .42   .50   -> oracle (no target val): 20; last: 20
    # tval:   .30   .60   .50   .40   -> oracle (with target val): 10
    rows = [
        (5, 0.60, 0.40, 0.30),
        (10, 0.70, 0.45, 0.60),
        (15, 0.70, 0.42, 0.50),
        (20, 0.65, 0.50, 0.40),
    ]
    out = []
    for rnd, id_acc, ood_acc, tval in rows:
        rec = {"round": rnd, "id_acc": id_acc, "ood_acc": ood_acc, "per_domain": {"photo": ood_acc}}
        if with_target_val:
            rec["target_val_acc"] = tval
        out.append(rec)
    return out


def test_rules_are_named():
    assert RULES == ("source_val", "last", "oracle")


def test_source_val_picks_highest_id_acc_and_latest_on_ties():
    chosen = select(_records())
    assert chosen["selected_round"] == 15
    assert chosen["selection"] == "source_val"
    assert chosen["ood_acc"] == 0.42


def test_last_picks_final_round():
    chosen = select(_records(), "last")
    assert (chosen["selected_round"], chosen["selection"], chosen["ood_acc"]) == (20, "last", 0.50)


def test_oracle_uses_ood_acc_without_target_validation():
    assert select(_records(), "oracle")["selected_round"] == 20


def test_oracle_prefers_target_validation_split():
    chosen = select(_records(with_target_val=True), "oracle")
    assert (chosen["selected_round"], chosen["selection"]) == (10, "oracle")


def test_order_of_records_does_not_matter():
    shuffled = [_records()[i] for i in (2, 0, 3, 1)]
    assert select(shuffled, "last")["selected_round"] == 20
    assert select(shuffled)["selected_round"] == 15


def test_select_returns_a_copy():
    records = _records()
    chosen = select(records)
    assert "selection" not in records[2] and "selected_round" not in records[2]
    assert chosen["per_domain"] == {"photo": 0.42}


def test_last_needs_no_accuracy_keys():
    assert select([{"round": 1}, {"round": 3}], "last")["selected_round"] == 3


def test_unknown_rule_is_a_config_error():
    with pytest.raises(ConfigError, match=r"'best'.*source_val"):
        select(_records(), "best")


def test_empty_records_are_a_data_error():
    with pytest.raises(DataError, match="no evaluated rounds"):
        select([], "last")


def test_missing_key_names_round_and_key():
    records = _records()
    del records[1]["id_acc"]
    with pytest.raises(DataError, match="round 10 has no 'id_acc'"):
        select(records)


def test_missing_round_key():
    with pytest.raises(DataError, match="#1 has no 'round'"):
        select([{"round": 1, "id_acc": 0.5}, {"id_acc": 0.6}])


def test_repeated_round_is_ambiguous():
    records = [*_records(), {"round": 10, "id_acc": 0.9, "ood_acc": 0.1}]
    with pytest.raises(DataError, match=r"repeat round\(s\) \[10\]"):
        select(records, "last")


def test_target_val_on_some_rounds_only_is_an_error():
    records = _records(with_target_val=True)
    del records[0]["target_val_acc"]
    with pytest.raises(DataError, match=r"rounds \[10, 15, 20\] only"):
        select(records, "oracle")
