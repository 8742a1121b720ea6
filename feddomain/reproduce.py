"""``feddomain reproduce``: run a seed paper's own setting, table by table, and print the paper's
numbers beside ours.

Each paper's tables live in ``feddomain/papers/<paper>.yaml``: per table, the quantities its
cells print (``metrics``), the seeds, the command-line keys a user must supply (``needs``: a
weights file), and one entry per cell -- the paper's row and column, the shipped config with
the overrides that make the paper's setting, an optional single target domain, and the paper's
numbers. Cells that share a config and overrides are one **setting**, run once -- however many
tables list it -- as a sweep over the seeds and the config's target splits in
``OUT/<setting>``; a cell with ``mean_of`` averages other cells of its row, seed by seed (a
paper's AVG column over several settings).

Every paper reports its final round, so ours are read at the last evaluated round. A cell's
value is the mean ± sample std over the seeds whose runs are all finished, and a seed counts
only when every target it averages has finished, so a half-run setting never passes for a
whole one: its cell says how many runs are still missing.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.markup import escape

from feddomain.errors import ConfigError

PAPERS_DIR = Path(__file__).resolve().parent / "papers"
SELECTION = "last"  # every seed paper reports its final-round model
CELL_METRICS = ("ood_acc", "id_acc", "ood_ece", "ood_val_acc", "worst_domain_acc")
TABLE_KEYS = frozenset({"name", "caption", "metrics", "seeds", "needs", "note", "cells"})
CELL_KEYS = frozenset(
    {"row", "column", "config", "overrides", "target", "paper", "note", "mean_of"}
)


# ------------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class Setting:
    """One sweep: a shipped config with the overrides that make the paper's setting."""

    config: str
    overrides: tuple[str, ...]

    @property
    def slug(self) -> str:
        """Its directory under the table's: the config's path and the overrides, readable."""
        from feddomain.sweep import slug

        name = self.config.removeprefix("feddomain:").replace("/", "-")
        return slug(",".join([name, *self.overrides]))

    def command(self, seeds: Sequence[int], user: Sequence[str], out: Path) -> str:
        """The ``feddomain sweep`` line that runs it by hand."""
        words = ["feddomain", "sweep", self.config, *self.overrides, *user]
        words += ["--grid", f"seed=[{','.join(str(s) for s in seeds)}]", "--out", str(out)]
        return shlex.join(words)


@dataclass(frozen=True)
class Cell:
    """One number (or one tuple of numbers, one per metric) of a paper's table."""

    row: str
    column: str
    paper: tuple[float | None, ...]
    setting: Setting | None = None  # None for a mean_of cell
    target: str | None = None  # one target domain's value; None: the mean over the run's targets
    mean_of: tuple[str, ...] = ()  # columns of the same row, averaged seed by seed
    note: str | None = None


@dataclass(frozen=True)
class PaperTable:
    """One table of a paper: what its cells print, the seeds, the keys a user must give."""

    paper: str
    name: str
    caption: str
    metrics: tuple[str, ...]
    seeds: tuple[int, ...]
    needs: tuple[str, ...]
    cells: tuple[Cell, ...]
    note: str | None = None

    def settings(self) -> list[Setting]:
        """Every distinct setting of the table, in the order its cells name them."""
        return list(dict.fromkeys(c.setting for c in self.cells if c.setting is not None))

    def cell(self, row: str, column: str) -> Cell:
        return next(c for c in self.cells if c.row == row and c.column == column)


@dataclass(frozen=True)
class Paper:
    """A seed paper's registry file: its citation and tables."""

    name: str
    title: str
    source: str
    tables: tuple[PaperTable, ...]

    def select(self, names: Sequence[str] | None) -> list[PaperTable]:
        """The tables named (all without names); an unknown name is refused with the list."""
        if not names:
            return list(self.tables)
        known = {t.name: t for t in self.tables}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ConfigError(
                f"{self.name} has no table {', '.join(map(repr, unknown))}; its tables: "
                f"{', '.join(known)}"
            )
        return [known[n] for n in dict.fromkeys(names)]


def papers() -> list[str]:
    """The papers ``feddomain reproduce`` knows, by their command-line names."""
    return sorted(p.stem for p in PAPERS_DIR.glob("*.yaml"))


def load_paper(name: str, folder: Path = PAPERS_DIR) -> Paper:
    """The registry file of paper ``name``, checked: a malformed entry is refused with the
    file, the table and the cell it is in."""
    path = folder / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in folder.glob("*.yaml"))
        raise ConfigError(f"no paper {name!r}; known papers: {', '.join(known)}")
    raw = yaml.safe_load(path.read_text())
    where = str(path)
    _require(isinstance(raw, dict), where, "expected a mapping")
    tables = tuple(
        _table(name, t, f"{where}, table {i}") for i, t in enumerate(raw.get("tables") or [])
    )
    _require(bool(tables), where, "lists no tables")
    names = [t.name for t in tables]
    _require(len(set(names)) == len(names), where, f"table names repeat: {names}")
    return Paper(name, str(raw.get("title", name)), str(raw.get("source", "")), tables)


def _table(paper: str, raw: Any, where: str) -> PaperTable:
    _require(isinstance(raw, dict), where, "expected a mapping")
    unknown = set(raw) - TABLE_KEYS
    _require(not unknown, where, f"unknown keys {sorted(unknown)}")
    _require("name" in raw and bool(raw.get("cells")), where, "needs a name and cells")
    where = f"{where} ({raw.get('name')!r})"
    metrics = tuple(raw.get("metrics") or ())
    bad = [m for m in metrics if m not in CELL_METRICS]
    _require(bool(metrics) and not bad, where, f"metrics must be among {CELL_METRICS}")
    cells = tuple(_cell(c, len(metrics), f"{where}, cell {i}") for i, c in enumerate(raw["cells"]))
    table = PaperTable(
        paper=paper,
        name=str(raw["name"]),
        caption=str(raw.get("caption", "")),
        metrics=metrics,
        seeds=tuple(int(s) for s in raw.get("seeds") or (0, 1, 2)),
        needs=tuple(raw.get("needs") or ()),
        cells=cells,
        note=raw.get("note"),
    )
    keys = [(c.row, c.column) for c in cells]
    _require(len(set(keys)) == len(keys), where, "two cells share a row and column")
    for c in cells:
        missing = [col for col in c.mean_of if (c.row, col) not in keys]
        _require(not missing, where, f"{c.row}/{c.column} averages missing columns {missing}")
        nested = [col for col in c.mean_of if table.cell(c.row, col).mean_of]
        _require(not nested, where, f"{c.row}/{c.column} averages mean_of cells {nested}")
    return table


def _cell(raw: Any, n_metrics: int, where: str) -> Cell:
    _require(isinstance(raw, dict), where, "expected a mapping")
    unknown = set(raw) - CELL_KEYS
    _require(not unknown, where, f"unknown keys {sorted(unknown)}")
    _require("row" in raw and "column" in raw, where, "needs a row and a column")
    paper = tuple(None if v is None else float(v) for v in raw.get("paper") or ())
    _require(len(paper) == n_metrics, where, f"paper needs {n_metrics} values, one per metric")
    mean_of = tuple(raw.get("mean_of") or ())
    has_config = "config" in raw
    _require(has_config != bool(mean_of), where, "give either config or mean_of")
    _require(not (mean_of and "target" in raw), where, "a mean_of cell takes no target")
    setting = (
        Setting(str(raw["config"]), tuple(str(o) for o in raw.get("overrides") or ()))
        if has_config
        else None
    )
    return Cell(
        row=str(raw["row"]),
        column=str(raw["column"]),
        paper=paper,
        setting=setting,
        target=raw.get("target"),
        mean_of=mean_of,
        note=raw.get("note"),
    )


def _require(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise ConfigError(f"{where}: {what}")


# -------------------------------------------------------------------------------- running
def setting_dir(out: Path, setting: Setting) -> Path:
    """Where a setting's runs go: one folder per setting, shared by every table listing it."""
    return out / setting.slug


def check_needs(table: PaperTable, user: Sequence[str]) -> None:
    """Refuse, before any run, a table whose settings need keys the command line lacks."""
    given = {item.partition("=")[0].strip() for item in user}
    missing = [key for key in table.needs if key not in given]
    if missing:
        raise ConfigError(
            f"{table.paper} table {table.name} needs {', '.join(f'{k}=...' for k in missing)} "
            "on the command line (docs/reproduce.md says which files)"
        )


def run_table(
    table: PaperTable,
    out: Path,
    user: Sequence[str],
    *,
    jobs: int = 1,
    jobs_per_gpu: int | None = None,
    live: bool = False,
) -> list[str]:
    """Run (or resume) every setting of ``table``; the names of the runs that failed."""
    from feddomain.api import sweep

    check_needs(table, user)
    failed = []
    for setting in table.settings():
        result = sweep(
            setting.config,
            *setting.overrides,
            *user,
            grid={"seed": list(table.seeds)},
            out=setting_dir(out, setting),
            jobs=jobs,
            jobs_per_gpu=jobs_per_gpu,
            live=live,
        )
        failed += [f"{setting.slug}/{s.run.name}" for s in result.failed]
    return failed


# ------------------------------------------------------------------------------ comparing
@dataclass(frozen=True)
class Ours:
    """Our value of one cell: per-seed values (one per metric) of the complete seeds, and how
    many of the runs the cell needs have finished."""

    seeds: dict[int, tuple[float, ...]]
    finished: int
    planned: int

    def stat(self, i: int) -> tuple[float, float] | None:
        """Mean and sample std (0 for one seed) of metric ``i`` over the complete seeds."""
        values = [v[i] for v in self.seeds.values()]
        if not values:
            return None
        return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def collect(table: PaperTable, out: Path, user: Sequence[str]) -> dict[tuple[str, str], Ours]:
    """Our value of every cell, from the finished runs under ``out`` (none run here). The runs
    are found where the sweep puts them, whatever device or machine made them: the settings
    are read for their targets only, so neither the weights file nor the flags of the command
    that ran them are needed."""
    ignored = {"device", *table.needs}  # how and where it ran, not which runs it made
    given = [o for o in user if o.partition("=")[0].strip() not in ignored]
    finished = {s: _finished_runs(table, s, out, given) for s in table.settings()}
    values = {}
    for cell in table.cells:
        if cell.setting is not None:
            values[(cell.row, cell.column)] = _setting_cell(table, cell, *finished[cell.setting])
    for cell in table.cells:
        if cell.mean_of:
            parts = [values[(cell.row, c)] for c in cell.mean_of]
            values[(cell.row, cell.column)] = _mean_cell(parts)
    return values


def _finished_runs(
    table: PaperTable, setting: Setting, out: Path, user: Sequence[str]
) -> tuple[list[Any], dict[int, int]]:
    """The setting's finished runs (report ``RunResult``s at the last round) and the number of
    runs each seed plans, from the directories ``feddomain sweep`` gives them."""
    from feddomain.config import load_config
    from feddomain.evaluation.report import load_run
    from feddomain.sweep import run_parts, split_targets, yaml_text

    targets = split_targets(load_config(Path(setting.config), [*setting.overrides, *user]))
    per_seed = {seed: len(targets) for seed in table.seeds}
    runs = []
    for seed in table.seeds:
        for target in targets:
            parts = run_parts([f"seed={yaml_text(seed)}"], target)
            run_dir = setting_dir(out, setting).joinpath(*parts)
            if (run_dir / "summary.json").is_file():
                runs.append(load_run(run_dir, SELECTION, table.metrics)[0])
    return runs, per_seed


def _setting_cell(table: PaperTable, cell: Cell, runs: list[Any], per_seed: dict[int, int]) -> Ours:
    """A cell of one setting: its target's runs, or per seed the mean over every target (a
    seed with a target missing is left out)."""
    if cell.target is not None:
        mine = [r for r in runs if r.targets == (cell.target,)]
        return Ours({r.seed: _values(r, table.metrics) for r in mine}, len(mine), len(per_seed))
    seeds = {}
    for seed, count in per_seed.items():
        of_seed = [_values(r, table.metrics) for r in runs if r.seed == seed]
        if len(of_seed) == count:
            seeds[seed] = tuple(statistics.fmean(col) for col in zip(*of_seed, strict=True))
    return Ours(seeds, len(runs), sum(per_seed.values()))


def _values(run: Any, metrics: Sequence[str]) -> tuple[float, ...]:
    return tuple(float(run.selected[m]) for m in metrics)


def _mean_cell(parts: list[Ours]) -> Ours:
    """A mean_of cell: per seed that all its columns have, the mean of their values."""
    common = set.intersection(*(set(p.seeds) for p in parts))
    seeds = {
        s: tuple(statistics.fmean(col) for col in zip(*(p.seeds[s] for p in parts), strict=True))
        for s in sorted(common)
    }
    return Ours(seeds, sum(p.finished for p in parts), sum(p.planned for p in parts))


# ------------------------------------------------------------------------------- printing
def comparison_markdown(
    table: PaperTable, values: dict[tuple[str, str], Ours] | None = None
) -> str:
    """The table as markdown: per cell and metric the paper's number, ours (mean ± std over
    seeds, at the last round) and ours minus the paper's; the paper's numbers alone without
    ``values``."""
    lines = [f"## {table.paper} --table {table.name}. {table.caption}", ""]
    if table.note:
        lines += [table.note, ""]
    header = ["row", "column"]
    for m in table.metrics:
        header += [f"{m} paper"] + ([f"{m} ours", f"{m} ours - paper"] if values else [])
    lines += ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for cell in table.cells:
        row = [cell.row, cell.column]
        ours = None if values is None else values[(cell.row, cell.column)]
        for i, paper in enumerate(cell.paper):
            row.append("—" if paper is None else f"{paper:g}")
            if ours is not None:
                row += _ours_cells(ours, i, paper, len(table.seeds))
        lines.append("| " + " | ".join(row) + " |")
    notes = [f"- {c.row} / {c.column}: {c.note}" for c in table.cells if c.note]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def _ours_cells(ours: Ours, i: int, paper: float | None, n_seeds: int) -> list[str]:
    stat = ours.stat(i)
    if stat is None:
        return [f"not run ({ours.finished}/{ours.planned} runs)", "—"]
    mean, std = 100 * stat[0], 100 * stat[1]  # every cell metric is a percentage
    text = f"{mean:.1f} ± {std:.1f}" if len(ours.seeds) > 1 else f"{mean:.1f}"
    if len(ours.seeds) < n_seeds:
        text += f" ({len(ours.seeds)} of {n_seeds} seeds)"
    return [text, "—" if paper is None else f"{mean - paper:+.1f}"]


def plan_text(paper: Paper, tables: Iterable[PaperTable], out: Path, user: Sequence[str]) -> str:
    """What ``--dry-run`` prints: each table's paper numbers and the sweeps that make ours."""
    lines = [f"# {paper.title}", paper.source, ""]
    for table in tables:
        lines.append(comparison_markdown(table))
        if table.needs:
            lines.append(f"Needs on the command line: {', '.join(table.needs)}.\n")
        lines.append("```")
        lines += [s.command(table.seeds, user, setting_dir(out, s)) for s in table.settings()]
        lines += ["```", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ CLI
def add_command(sub: argparse._SubParsersAction) -> None:
    """Register ``feddomain reproduce`` on the CLI's sub-command parser."""
    rp = sub.add_parser(
        "reproduce",
        help="run a seed paper's own setting, table by table, beside the paper's numbers",
        description=(
            "Run every setting of the paper's tables (the shipped configs at the paper's "
            "budget: a GPU's work) as resumable sweeps under OUT, then print each table with "
            "the paper's numbers beside ours at the last round. Rerun the same command to "
            "resume. docs/reproduce.md says which files each paper needs."
        ),
    )
    rp.add_argument("paper", choices=papers(), help="the seed paper")
    rp.add_argument(
        "overrides", nargs="*", help="dotted overrides for every run, e.g. dataset.root=/data"
    )
    rp.add_argument(
        "--table", action="append", default=None, help="a table (repeatable; default: all)"
    )
    rp.add_argument("--out", type=Path, default=Path("runs/reproduce"), help="where the runs go")
    rp.add_argument(
        "--device", choices=["auto", "cuda", "cpu"], default=None, help="device of every run"
    )
    workers = rp.add_mutually_exclusive_group()
    workers.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    workers.add_argument(
        "--jobs-per-gpu",
        type=int,
        default=None,
        metavar="K",
        help="K worker processes on every visible GPU",
    )
    mode = rp.add_mutually_exclusive_group()
    mode.add_argument(
        "--dry-run",
        action="store_true",
        help="print the paper's numbers and the sweeps; run nothing",
    )
    mode.add_argument(
        "--compare",
        action="store_true",
        help="print the tables from the runs finished so far; run nothing",
    )
    rp.add_argument("--quiet", action="store_true", help="no live table while running")
    rp.set_defaults(func=cmd_reproduce)


def cmd_reproduce(args: argparse.Namespace) -> int:
    """Exit status 1 when a run failed (the others still ran and are tabulated)."""
    paper = load_paper(args.paper)
    tables = paper.select(args.table)
    user = [*args.overrides, *([f"device={args.device}"] if args.device else [])]
    out = args.out / paper.name
    console = Console(stderr=True)
    if args.dry_run:
        print(plan_text(paper, tables, out, user))
        return 0
    failed = []
    if not args.compare:
        for table in tables:  # every table's keys before the first run, not hours into it
            check_needs(table, user)
        for table in tables:
            failed += run_table(
                table,
                out,
                user,
                jobs=args.jobs,
                jobs_per_gpu=args.jobs_per_gpu,
                live=not args.quiet,
            )
    for table in tables:
        text = comparison_markdown(table, collect(table, out, user))
        (out / f"table-{table.name}").mkdir(parents=True, exist_ok=True)
        (out / f"table-{table.name}" / "comparison.md").write_text(text)
        print(text)
    for name in failed:
        console.print(f"[red]failed[/] {escape(name)}: its error.log says why")
    return 1 if failed else 0
