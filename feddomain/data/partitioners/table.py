"""Who holds what: client x domain (and station x domain) sample-count tables.

Used by ``feddomain data partition CONFIG`` to show a partition before any training, and saved
as CSV beside a run so the heterogeneity of each experiment is on record.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
from rich.console import Console
from rich.table import Table

from feddomain.errors import DataError


def count_table(parts: Sequence[np.ndarray], domain_ids: np.ndarray, n_domains: int) -> np.ndarray:
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
    return np.stack(
        [client_table[np.asarray(members, dtype=np.int64)].sum(axis=0) for members in stations]
    )


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


class _Split(Protocol):
    @property
    def name(self) -> str: ...


class PartitionView(Protocol):
    """What :func:`render_tables` reads from a federation's data (``FederatedData``)."""

    domains: tuple[str, ...]
    split: _Split
    client_domain_counts: np.ndarray
    stations: list[np.ndarray] | None


def render_tables(
    fed: PartitionView, *, console: Console, csv_path: str | Path | None = None
) -> list[Path]:
    """Print the client x domain table (and station x domain when there are stations).

    With ``csv_path``, each table is also written as CSV; the split name (and ``stations``) is
    added to the file stem, so one path serves every split of a leave-one-domain-out config.
    Returns the CSV paths written.
    """
    tables = [("client", fed.client_domain_counts)]
    if fed.stations is not None:
        tables.append(("station", station_table(fed.client_domain_counts, fed.stations)))
    written = []
    for level, table in tables:
        title = f"{fed.split.name}: {level} x domain training samples"
        console.print(render_table(table, fed.domains, row_label=level, title=title))
        if csv_path is not None:
            path = Path(csv_path)
            tag = fed.split.name if level == "client" else f"{fed.split.name}_stations"
            target = path.with_name(f"{path.stem}_{tag}{path.suffix or '.csv'}")
            written.append(write_table_csv(target, table, fed.domains, row_label=level))
            console.print(f"wrote {target}")
    return written


def write_partition_csv(path: str | Path, feds: Sequence[PartitionView]) -> Path:
    """Every split's client x domain (and station x domain) counts in the one file ``path``:
    columns split, level, index, then one per domain."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["split", "level", "index", *feds[0].domains])
        for fed in feds:
            tables = [("client", fed.client_domain_counts)]
            if fed.stations is not None:
                tables.append(("station", station_table(fed.client_domain_counts, fed.stations)))
            for level, table in tables:
                for i, row in enumerate(np.asarray(table).tolist()):
                    writer.writerow([fed.split.name, level, i, *row])
    return path
