"""The partitioner registry, shared input checks, and the client x domain count table."""

from __future__ import annotations

import csv
import io
import re
from types import SimpleNamespace

import numpy as np
import pytest
from rich.console import Console

from feddomain.data.partitioners import (
    PARTITIONERS,
    count_table,
    partition,
    render_table,
    split_lambda,
    station_table,
    write_table_csv,
)
from feddomain.data.partitioners.table import render_tables
from feddomain.errors import ConfigError, DataError

GROUPS = [np.arange(0, 40), np.arange(40, 110), np.arange(110, 165)]


def test_registry_names() -> None:
    assert sorted(PARTITIONERS) == ["dirichlet", "domains_per_client", "lambda"]


@pytest.mark.parametrize(
    ("name", "params"),
    [("domains_per_client", {"d": 2}), ("lambda", {"lam": 0.1}), ("dirichlet", {"alpha": 1.0})],
)
def test_partition_dispatches_to_the_named_function(name: str, params: dict) -> None:
    via_registry = partition(name, GROUPS, 4, seed=9, **params)
    direct = PARTITIONERS[name](GROUPS, 4, seed=9, **params)
    assert all(np.array_equal(a, b) for a, b in zip(via_registry, direct, strict=True))
    assert np.array_equal(np.sort(np.concatenate(via_registry)), np.arange(165))


def test_partition_errors_list_the_valid_choices() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown partitioner 'iid'; choose one of \['dirichlet'"
    ):
        partition("iid", GROUPS, 4, seed=0)
    with pytest.raises(ConfigError, match=r"'lambda' has no parameter 'alpha'; it takes \['lam'\]"):
        partition("lambda", GROUPS, 4, seed=0, alpha=1.0)
    with pytest.raises(ConfigError, match=r"'dirichlet' needs parameter 'alpha'"):
        partition("dirichlet", GROUPS, 4, seed=0, min_size=2)


def test_group_and_seed_validation() -> None:
    with pytest.raises(DataError, match=r"groups overlap: index 39 appears more than once"):
        split_lambda([np.arange(40), np.arange(39, 50)], 2, 0.5, seed=0)
    with pytest.raises(DataError, match=r"groups\[1\] must be a 1-D integer index array"):
        split_lambda([np.arange(4), np.array([5.0, 6.0])], 2, 0.5, seed=0)
    with pytest.raises(DataError, match=r"groups hold no samples"):
        split_lambda([np.array([], dtype=np.int64)], 2, 0.5, seed=0)
    with pytest.raises(ConfigError, match=r"seed must be a non-negative integer, got -1"):
        split_lambda(GROUPS, 2, 0.5, seed=-1)
    with pytest.raises(ConfigError, match=r"n_clients must be an integer >= 1, got 0"):
        split_lambda(GROUPS, 0, 0.5, seed=0)


def test_count_and_station_tables() -> None:
    domain_ids = np.array([0, 0, 1, 2, 2, 2, 1])
    parts = [np.array([0, 2]), np.array([1, 3, 4]), np.array([5, 6])]
    table = count_table(parts, domain_ids, 3)
    assert table.tolist() == [[1, 1, 0], [1, 0, 2], [0, 1, 1]]
    assert station_table(table, [np.array([0, 2]), np.array([1])]).tolist() == [
        [1, 2, 1],
        [1, 0, 2],
    ]
    with pytest.raises(DataError, match=r"part 0 holds index 9 but domain_ids has 7 entries"):
        count_table([np.array([9])], domain_ids, 3)


def test_csv_and_rich_rendering(tmp_path) -> None:
    table = np.array([[3, 0], [1, 2]])
    path = write_table_csv(tmp_path / "t.csv", table, ["art", "sketch"])
    rows = list(csv.reader(path.open()))
    assert rows == [
        ["client", "art", "sketch", "total"],
        ["0", "3", "0", "3"],
        ["1", "1", "2", "3"],
    ]
    console = Console(file=io.StringIO(), width=80)
    console.print(render_table(table, ["art", "sketch"], title="demo"))
    text = console.file.getvalue()
    assert "sketch" in text and "total" in text
    total_row = [line for line in text.splitlines() if " total " in line][-1]  # not the header
    assert re.findall(r"\d+", total_row) == ["4", "2", "6"]  # column sums, grand total
    with pytest.raises(DataError, match=r"1 domain names for a table of 2 domains"):
        write_table_csv(tmp_path / "bad.csv", table, ["art"])


def test_render_tables_writes_one_csv_per_split_and_level(tmp_path) -> None:
    fed = SimpleNamespace(
        domains=("art", "sketch"),
        split=SimpleNamespace(name="lodo-photo"),
        client_domain_counts=np.array([[3, 0], [1, 2], [0, 5]]),
        stations=[np.array([0, 1]), np.array([2])],
    )
    console = Console(file=io.StringIO(), width=80)
    written = render_tables(fed, console=console, csv_path=tmp_path / "counts.csv")
    assert [p.name for p in written] == ["counts_lodo-photo.csv", "counts_lodo-photo_stations.csv"]
    station_rows = list(csv.reader(written[1].open()))
    assert station_rows[1:] == [["0", "4", "2", "6"], ["1", "0", "5", "5"]]
