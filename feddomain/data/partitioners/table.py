"""Who holds what: client x domain (and station x domain) sample-count tables.

Used by ``feddomain data partition CONFIG`` to show a partition before any training, and saved
as CSV beside a run so the heterogeneity of each experiment is on record.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from rich.table import Table

from feddomain.errors import DataError


def count_table(
    parts: Sequence[np.ndarray], domain_ids: np.ndarray, n_domains: int
) -> np.ndarray:
    """[n_parts, n_domains] int64: samples of domain j held by part (client) i.

    ``domain_ids`` maps every global sample index to its domain (e.g. ``dataset.domain_ids``).
    """
    domain_ids = np.asarray(domain_ids)
    table = np.zeros((len(parts), n_domains), dtype=np.int64)
    for i, part in enumerate(parts):
        part = np.asarray(part, dtype=np.int64)
        if part.size and part.max() >= domain_ids.size:
            raise DataError(
                f"part {i} holds index {part.max()} but domain_ids has {domain_ids.size} entries"
            )
        table[i] = np.bincount(domain_ids[part], minlength=n_domains)[:n_domains]
    return table


def station_table(client_table: np.ndarray, stations: Sequence[np.ndarray]) -> np.ndarray:
    """[n_stations, n_domains]: the client rows summed over each station's clients."""
    return np.stack([client_table[np.asarray(members, dtype=np.int64)].sum(axis=0)
                     for members in stations])


def _header(domain_names: Sequence[str], table: np.ndarray, row_label: str) -> list[str]:
    if len(domain_names) != table.shape[1]:
        raise DataError(f"{len(domain_names)} domain names for a table of {table.shape[1]} domains")
    return [row_label, *domain_names, "total"]


def render_table(
    table: np.ndarray,
    domain_names: Sequence[str],
    *,
    row_label: str = "client",
    title: str | None = None,
) -> Table:
    """A rich Table with one row per client (or station), a total column and a total row."""
    header = _header(domain_names, table, row_label)
    rich_table = Table(title=title)
    for k, name in enumerate(header):
        rich_table.add_column(name, justify="left" if k == 0 else "right")
    for i, row in enumerate(table):
        rich_table.add_row(str(i), *(str(int(v)) for v in row), str(int(row.sum())))
    totals = table.sum(axis=0)
    rich_table.add_section()
    rich_table.add_row("total", *(str(int(v)) for v in totals), str(int(totals.sum())))
    return rich_table


def write_table_csv(
    path: str | Path, table: np.ndarray, domain_names: Sequence[str], *, row_label: str = "client"
) -> Path:
    """Write the table as CSV: one row per client (or station), columns per domain plus total."""
    header = _header(domain_names, table, row_label)
    path = Path(path)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for i, row in enumerate(table):
            writer.writerow([i, *(int(v) for v in row), int(row.sum())])
    return path
