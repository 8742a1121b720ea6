"""``feddomain report``: collect finished runs, select a round per run, and tabulate and plot.

A run directory holds ``summary.json``, ``metrics.jsonl`` and ``config.yaml``. Numbers in the
tables come from ``metrics.jsonl`` under an explicit selection rule (``selection.py``), not from
the summary alone, so one set of runs can be reported under every rule. Runs are grouped by
(algorithm label, dataset, target domain(s)) and summarised as mean ± std (or standard error)
over seeds when there are several; a single seed shows its value alone. Each table row names its
budget (rounds × local epochs) and the selected rounds, and runs whose configs differ beyond the
seed are never averaged silently: the report's notes name the keys that differ. Runs of one
label whose configs differ get the differing settings added to their label (``fedprox (mu=0.1)``).

Malformed input is an error naming the file, because a silently dropped seed would change a
mean ± std without a trace. The one exception is an unfinished run (``metrics.jsonl`` or
``config.yaml`` without ``summary.json``): it is skipped and listed in ``Report.warnings``, so a
report can be made while other runs are still going.

Plots use matplotlib's object API (``Figure``), which never touches pyplot's global backend.
"""

from __future__ import annotations

import base64
import csv
import html
import json
import math
import re
import textwrap
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import yaml
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from feddomain.config import ExperimentConfig
from feddomain.errors import DIVERGED_RECORD, ConfigError, DataError
from feddomain.evaluation.claims import (
    Claim,
    against,
    claims_markdown,
    evaluate,
    read_claims,
    tuning,
    tuning_markdown,
)
from feddomain.evaluation.selection import RULES, select
from feddomain.evaluation.trailing import TRAILING_METRICS, trailing_means
from feddomain.federation.privacy import CLIENT_SERVER, KINDS

RUN_FILES = ("summary.json", "metrics.jsonl", "config.yaml")
METRICS = ("ood_acc", "id_acc", "ood_ece")
# tables a report adds on request (`--metrics`), from the same selected round of each run
OPTIONAL_METRICS = (
    "worst_domain_acc", "ood_macro_f1", "ood_nll", "ood_brier", "worst_client_acc",
    "client_acc_std", "client_ood_std", "client_loss_var", "client_loss_var_last50",
    "grad_cos_pairwise", "embedding_l2",
)  # fmt: skip
# optional metrics that metrics.jsonl holds nested: name -> (field, key)
NESTED_METRICS = {
    "worst_client_acc": ("id_spread", "min"),
    "client_acc_std": ("id_spread", "std"),
    "client_ood_std": ("ood_spread", "std"),  # personalised methods: one model per client
    "grad_cos_pairwise": ("diagnostics", "cos_pairwise_mean"),
    "embedding_l2": ("diagnostics", "embedding_l2_mean"),
}
METRIC_TITLES = {
    "ood_acc": "ood accuracy (%)",
    "id_acc": "id accuracy (%)",
    "ood_ece": "ood ECE (%)",
    "worst_domain_acc": "worst target-domain accuracy (%)",
    "ood_macro_f1": "ood macro-F1 (%)",
    "ood_nll": "ood NLL (nats)",
    "ood_brier": "ood Brier score",
    "worst_client_acc": "worst client's id accuracy (%)",
    "client_acc_std": "std of id accuracy over clients (%)",
    "client_ood_std": "std over the clients' models of their ood accuracy (%)",
    "client_loss_var": "variance of the clients' training losses",
    "client_loss_var_last50": "variance of the clients' training losses, last 50 rounds' mean",
    "grad_cos_pairwise": "mean pairwise cosine of client gradients",
    "embedding_l2": "mean pairwise distance of client embeddings",
}
ACCURACIES = frozenset({"ood_acc", "id_acc", "worst_domain_acc", "worst_client_acc"})
BELOW_CHANCE = "†"  # marks an accuracy cell whose mean is below chance (1 / number of classes)
PERCENT = frozenset(
    {
        "ood_acc",
        "id_acc",
        "ood_ece",
        "worst_domain_acc",
        "worst_client_acc",
        "client_acc_std",
        "client_ood_std",
        "ood_macro_f1",
    }
)
CSV_COLUMNS = (
    "kind", "algorithm", "dataset", "target", "selection", "seed", "n_seeds", "selected_round",
    "rounds", "local_epochs", "ood_acc", "ood_acc_std", "id_acc", "id_acc_std", "ood_ece",
    "ood_ece_std", "path",
)  # fmt: skip
SPREADS = ("std", "se")
PHASES = ("train", "aggregate", "evaluate")  # a round's phases in rounds.jsonl, in this order
CHARS_PER_INCH = 9  # of a figure title at matplotlib's default size, with a margin
# config keys that do not change what a run computes: runs differing only here are one setting
NEUTRAL_KEYS = frozenset(
    {"name", "seed", "threads", "dataset.root", "dataset.cache_dir", "split.targets",
     "checkpoint.every", "eval.batch_size", "tracking.tensorboard", "tracking.mlflow",
     "tracking.mlflow.tracking_uri", "tracking.mlflow.experiment"}
)  # fmt: skip


@dataclass(frozen=True)
class RunResult:
    """One finished run with the metrics record its selection rule chose."""

    path: Path
    algorithm: str
    dataset: str
    targets: tuple[str, ...]
    seed: int
    selected: dict
    records: list[dict]
    summary: dict
    config: dict = field(default_factory=dict)

    @property
    def target(self) -> str:
        return "+".join(self.targets)

    @property
    def local_epochs(self) -> int:
        return int(self.config.get("train", {}).get("local_epochs", 1))

    @property
    def budget(self) -> str:
        """Training budget: global rounds × local epochs per round."""
        return f"{self.summary['rounds']}×{self.local_epochs}"

    @property
    def chance(self) -> float | None:
        """The accuracy of guessing, 1 / classes (the summary's classes, or the dataset's
        built-in ones for runs written before summaries held them); None when unknown."""
        classes = self.summary.get("classes")
        if classes is None:
            from feddomain.data.sources import get_spec

            try:
                classes = get_spec(self.dataset).classes
            except DataError:  # a dataset this version does not know
                classes = None
        return 1 / len(classes) if classes else None


@dataclass(frozen=True)
class Stat:
    """Mean and sample std (ddof = 1) over seeds; std is 0.0 for a single seed, flagged in cells."""

    mean: float
    std: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Stat:
        arr = np.asarray(values, dtype=np.float64)
        std = float(arr.std(ddof=1)) if arr.size > 1 else 0.0
        return cls(mean=float(arr.mean()), std=std, n=int(arr.size))

    @property
    def se(self) -> float:
        """Standard error of the mean."""
        return self.std / math.sqrt(self.n)

    def cell(self, spread: str = "std", pm: str = "±", percent: bool = True) -> str:
        """Percentages with one decimal, as in the papers' tables (other values: three
        decimals; in scientific notation, spread included, when the mean is below 0.01, where
        decimals would print a small variance as 0.000); a spread only when there are several
        seeds (one seed has none to show)."""
        scientific = not percent and 0 < abs(self.mean) < 0.01
        if self.n == 1:
            return _number(self.mean, percent, scientific)
        value = self.std if spread == "std" else self.se
        mean, spread_ = _number(self.mean, percent, scientific), _number(value, percent, scientific)
        return f"{mean} {pm} {spread_}"


def _number(value: float, percent: bool, scientific: bool = False) -> str:
    if percent:
        return f"{100 * value:.1f}"
    return f"{value:.2e}" if scientific else f"{value:.3f}"


@dataclass(frozen=True)
class GroupResult:
    """All seeds of one (algorithm, dataset, target) cell."""

    algorithm: str
    dataset: str
    target: str
    runs: tuple[RunResult, ...]
    stats: dict[str, Stat]


@dataclass
class Report:
    """Runs and seed groups under one selection rule, plus notes and the files written."""

    selection: str
    runs: list[RunResult]
    groups: list[GroupResult]
    warnings: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    spread: str = "std"
    metrics: tuple[str, ...] = METRICS  # the tables, in order
    claims: list[Claim] = field(default_factory=list)  # "A > B" with paired intervals
    tuning: dict[str, dict] = field(default_factory=dict)  # row -> its tune's selected.yaml

    def title(self) -> str:
        oracle = self.selection == "oracle"
        rule = "ORACLE (selects on target-domain data)" if oracle else self.selection
        return f"feddomain report — model selection: {rule}"

    def _legend(self) -> str:
        spread = "sample std (ddof = 1)" if self.spread == "std" else "standard error of the mean"
        return (
            f"Cells: mean ± {spread} over seeds in %, when a cell has several seeds; one seed "
            "shows its value alone. avg: unweighted mean over targets, only when every target "
            "has runs. budget: global rounds × local epochs. round: the selected round(s)."
        )

    def to_markdown(self) -> str:
        """One method x target table per dataset and metric, with an unweighted ``avg`` column."""
        lines = [f"# {self.title()}", "", self._legend()]
        for dataset in self.datasets():
            for metric in self.metrics:
                lines += ["", f"## {dataset} — {METRIC_TITLES[metric]}", ""]
                header, *body = self.table_rows(dataset, metric)
                lines += ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
                lines += ["| " + " | ".join(row) + " |" for row in body]
                if any(cell.endswith(BELOW_CHANCE) for row in body for cell in row):
                    lines += ["", f"{BELOW_CHANCE} below chance ({self._chance(dataset)})."]
            lines += self._communication(dataset)
            lines += self._timing(dataset)
        lines += claims_markdown(self.claims) + tuning_markdown(self.tuning)
        if self.warnings:
            lines += ["", "## Notes", ""] + [f"- {w}" for w in self.warnings]
        return "\n".join(lines) + "\n"

    def to_latex(self) -> str:
        """The same tables as booktabs ``tabular`` environments, ready to paste."""
        out = [f"% {self.title()}", f"% {self._legend()}"]
        for dataset in self.datasets():
            for metric in self.metrics:
                header, *body = self.table_rows(dataset, metric, pm="$\\pm$")
                out += [
                    "",
                    f"% {dataset} — {METRIC_TITLES[metric]}",
                    "\\begin{tabular}{l" + "r" * (len(header) - 1) + "}",
                    "\\toprule",
                    " & ".join(_tex(c) for c in header) + " \\\\",
                    "\\midrule",
                    *(" & ".join(_tex(c) for c in row) + " \\\\" for row in body),
                    "\\bottomrule",
                    "\\end{tabular}",
                ]
        return "\n".join(out) + "\n"

    def datasets(self) -> list[str]:
        return sorted({g.dataset for g in self.groups})

    def _chance(self, dataset: str) -> str:
        """``'10% = 1 / 10 classes'`` for the dataset's runs (several values if they differ)."""
        chances = sorted({r.chance for r in self.runs if r.dataset == dataset and r.chance})
        return ", ".join(f"{100 * c:.3g}% = 1 / {round(1 / c)} classes" for c in chances)

    @staticmethod
    def _below_chance(group: GroupResult, metric: str) -> bool:
        chances = {r.chance for r in group.runs}
        if metric not in ACCURACIES or None in chances or len(chances) != 1:
            return False
        return group.stats[metric].mean < chances.pop()

    def table_rows(self, dataset: str, metric: str, pm: str = "±") -> list[list[str]]:
        """Header, then one row per method: its cells per target, avg, seeds, budget, round."""
        groups = {(g.algorithm, g.target): g for g in self.groups if g.dataset == dataset}
        targets = sorted({t for _, t in groups})
        rows = [["method", *targets, "avg", "seeds", "budget", "round"]]
        for algo in sorted({a for a, _ in groups}):
            cells = [groups.get((algo, t)) for t in targets]
            present = [g for g in cells if g is not None]
            means = [g.stats[metric].mean for g in present]
            percent = metric in PERCENT
            whole = len(present) == len(targets)
            avg = _number(sum(means) / len(means), percent) if whole else "—"
            runs = [r for g in present for r in g.runs]
            row = [
                g.stats[metric].cell(self.spread, pm, percent)
                + (BELOW_CHANCE if self._below_chance(g, metric) else "")
                if g
                else "—"
                for g in cells
            ]
            rows.append([algo, *row, avg, _span(len(g.runs) for g in present),
                         ", ".join(sorted({r.budget for r in runs})),
                         _span(r.selected["selected_round"] for r in runs)])  # fmt: skip
        return rows

    def _communication(self, dataset: str) -> list[str]:
        """What crossed the wire per round, by link, direction and kind (the privacy ledger),
        mean over the method's runs; one-time tasks before round 1 are spread over the rounds.
        A run with stations has one row per link."""
        by_row: dict[str, list[dict]] = {}
        for run in self.runs:
            if run.dataset != dataset:
                continue
            rounds = max(int(run.summary["rounds"]), 1)
            for link, ledger in _links(run.summary).items():
                row = run.algorithm if link == CLIENT_SERVER else f"{run.algorithm} ({link})"
                per_round = {d: {k: ledger[d][k] / rounds for k in KINDS} for d in ("down", "up")}
                by_row.setdefault(row, []).append(per_round)
        if not by_row:
            return []
        columns = [(d, k) for d in ("down", "up") for k in KINDS]
        lines = [
            "",
            f"## {dataset} — communication per round, summed over clients (KiB, mean over runs)",
            "",
            "Each cell is one round's bytes summed over all the clients of that round (one "
            "client's share: divide by the clients per round). "
            "down: toward the clients; up: toward the server; a run with stations has a row per "
            "link (client-station, station-server). model: arrays shaped like the model's; "
            "statistics: any other array; scalars: 8 bytes per number.",
            "",
            "| method | " + " | ".join(f"{d} {k}" for d, k in columns) + " |",
            "|---" * (len(columns) + 1) + "|",
        ]
        for row, runs in sorted(by_row.items()):
            cells = [np.mean([r[d][k] for r in runs]) / 1024 for d, k in columns]
            lines.append(f"| {row} | " + " | ".join(f"{c:.4g}" for c in cells) + " |")
        return lines

    def _timing(self, dataset: str) -> list[str]:
        """Wall-clock seconds per round by phase (``rounds.jsonl``), mean over rounds and then
        over the method's runs; ``server_*`` are parts a server reports of its own step
        (HFedATM: ``server_merge`` and its parts), inside ``aggregate``. A run without its
        per-round log (the campaign commits none) counts by its summary's phase totals over
        its rounds (a one-time task's seconds, such as a statistics pass, spread over them)."""
        by_row: dict[str, list[dict[str, float]]] = {}
        for run in self.runs:
            path = run.path / "rounds.jsonl"
            totals = run.summary.get("phase_seconds")
            if run.dataset != dataset:
                continue
            if path.is_file():
                records = [r["time"] for r in read_metrics(path)
                           if isinstance(r.get("time"), dict)]  # fmt: skip
                phases = {k for t in records for k in t}
                means = {k: float(np.mean([t.get(k, 0.0) for t in records])) for k in phases}
            elif isinstance(totals, dict) and run.summary.get("rounds"):
                means = {k: v / run.summary["rounds"] for k, v in totals.items()}
            else:
                continue
            by_row.setdefault(run.algorithm, []).append(means)
        if not by_row:
            return []
        seen = {k for runs in by_row.values() for m in runs for k in m}
        columns = [k for k in PHASES if k in seen] + sorted(seen - set(PHASES))
        lines = [
            "",
            f"## {dataset} — time per round (s, mean over rounds and runs)",
            "",
            "train: local training of the round's clients; aggregate: folding their replies "
            "(stations and server); evaluate: averaged over all rounds, evaluated or not; "
            "server_*: parts of the server's own step, inside aggregate.",
            "",
            "| method | " + " | ".join(columns) + " |",
            "|---" * (len(columns) + 1) + "|",
        ]
        for row, runs in sorted(by_row.items()):
            cells = [np.mean([r.get(k, 0.0) for r in runs]) for k in columns]
            lines.append(f"| {row} | " + " | ".join(f"{c:.3g}" for c in cells) + " |")
        return lines

    def rows(self) -> list[dict]:
        """CSV rows: one per run, then one per group; values are fractions, not percentages."""
        rows = []
        for run in self.runs:
            row = _base_row("run", run.algorithm, run.dataset, run.target, self.selection)
            row.update(seed=run.seed, selected_round=run.selected["selected_round"], path=run.path)
            row.update(rounds=run.summary["rounds"], local_epochs=run.local_epochs)
            row.update({m: run.selected[m] for m in self.metrics})
            rows.append(row)
        for g in self.groups:
            row = _base_row("group", g.algorithm, g.dataset, g.target, self.selection)
            row["n_seeds"] = len(g.runs)
            for m in self.metrics:
                row[m], row[f"{m}_std"] = g.stats[m].mean, g.stats[m].std
            rows.append(row)
        return rows


def _span(values: object) -> str:
    """'10' for one distinct value, '10-15' for several."""
    distinct = sorted(set(values))  # type: ignore[call-overload]
    if not distinct:
        return "—"
    return str(distinct[0]) if len(distinct) == 1 else f"{distinct[0]}-{distinct[-1]}"


def _tex(text: str) -> str:
    """A cell in LaTeX: underscores, percent and ampersands escaped, dashes kept."""
    for char in ("_", "%", "&", "#"):
        text = text.replace(char, "\\" + char)
    return text.replace("—", "--").replace("×", "$\\times$")


def _flat(config: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, dict) and key != "options":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def mixing_warnings(groups: list[GroupResult]) -> list[str]:
    """Name every config key on which the seeds of one cell differ, and the budgets of the
    methods in one dataset's table when they differ: averages over unlike runs, and rows
    compared at unlike budgets, must not pass silently."""
    notes = []
    for g in groups:
        flat = [_flat(r.config) for r in g.runs]
        keys = sorted({k for f in flat for k in f} - NEUTRAL_KEYS)
        differ = [k for k in keys if len({repr(f.get(k)) for f in flat}) > 1]
        if differ:
            shown = "; ".join(
                f"{k}: " + ", ".join(f"seed {r.seed}={f.get(k)!r}" for r, f in zip(
                    g.runs, flat, strict=True)) for k in differ[:5]
            )  # fmt: skip
            notes.append(
                f"{g.algorithm} on {g.dataset}/{g.target} averages runs whose configs differ "
                f"({shown}); give them distinct algorithm.label values to keep them apart"
            )
    for dataset in sorted({g.dataset for g in groups}):
        budgets: dict[str, set[str]] = {}
        for g in groups:
            if g.dataset == dataset:
                budgets.setdefault(g.algorithm, set()).update(r.budget for r in g.runs)
        if len({b for v in budgets.values() for b in v}) > 1:
            listed = ", ".join(f"{a} {'/'.join(sorted(b))}" for a, b in sorted(budgets.items()))
            notes.append(f"{dataset}: methods were trained with different budgets ({listed})")
    return notes


def _links(summary: dict) -> dict[str, dict]:
    """Bytes by link; a run written before links were counted has one ledger, the flat link."""
    links = summary.get("links")
    if isinstance(links, dict):
        return links
    ledger = summary.get("ledger")
    return {CLIENT_SERVER: ledger} if isinstance(ledger, dict) else {}


def _base_row(kind: str, algorithm: str, dataset: str, target: str, selection: str) -> dict:
    row = dict.fromkeys(CSV_COLUMNS, "")
    row.update(kind=kind, algorithm=algorithm, dataset=dataset, target=target, selection=selection)
    return row


# ---------------------------------------------------------------------------------------------
# Reading run directories


def find_runs(dirs: list[Path]) -> tuple[list[Path], list[Path]]:
    """(finished run dirs, unfinished ones) found anywhere under ``dirs``."""
    found: set[Path] = set()
    for root in dirs:
        root = Path(root)
        if not root.is_dir():
            raise DataError(f"report input {root} is not a directory")
        # config.yaml alone marks an experiment folder holding one run per target, not a run
        for name in ("summary.json", "metrics.jsonl", DIVERGED_RECORD):
            found.update(p.parent for p in root.rglob(name))
    finished = sorted(d for d in found if (d / "summary.json").is_file())
    unfinished = sorted(found.difference(finished))
    return finished, unfinished


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: cannot read JSON ({err})") from err
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_metrics(path: Path) -> list[dict]:
    """Per-round records of ``metrics.jsonl``; blank lines are ignored."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot read ({err})") from err
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: not valid JSON ({err})") from err
        if not isinstance(rec, dict):
            raise DataError(f"{path}:{number}: expected a JSON object per line")
        records.append(rec)
    return records


def _summary_fields(path: Path, summary: dict) -> tuple[str, str, tuple[str, ...], int]:
    for key in ("algorithm", "dataset", "target_domains", "seed"):
        if key not in summary:
            raise DataError(f"{path}: missing key {key!r}")
    algorithm, dataset = summary["algorithm"], summary["dataset"]
    targets, seed = summary["target_domains"], summary["seed"]
    if not isinstance(algorithm, str) or not isinstance(dataset, str):
        raise DataError(f"{path}: 'algorithm' and 'dataset' must be strings")
    if not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
        raise DataError(
            f"{path}: 'target_domains' must be a non-empty list of names, got {targets!r}"
        )
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise DataError(f"{path}: 'seed' must be an integer, got {seed!r}")
    return algorithm, dataset, tuple(targets), seed


def load_run(
    run_dir: Path,
    selection: str,
    metrics: tuple[str, ...] = METRICS,
    claimed: tuple[str, ...] = (),
) -> tuple[RunResult, list[str]]:
    """One run and any warnings about it (summary disagreeing with its own metrics).
    ``claimed`` names metrics a claim reads but the report does not show: a trailing metric
    among them or ``metrics`` is computed, the others are never read."""
    for name in RUN_FILES:
        if not (run_dir / name).is_file():
            raise DataError(f"run directory {run_dir} has summary.json but no {name}")
    summary = _read_json(run_dir / "summary.json")
    algorithm, dataset, targets, seed = _summary_fields(run_dir / "summary.json", summary)
    metrics_path = run_dir / "metrics.jsonl"
    records = [with_nested_metrics(r) for r in read_metrics(metrics_path)]
    try:
        chosen = select(records, selection)
    except DataError as err:
        raise DataError(f"{metrics_path}: {err}") from err
    trailing = [m for m in dict.fromkeys(metrics + claimed) if m in TRAILING_METRICS]
    if trailing:
        chosen = {**chosen, **trailing_metrics(run_dir, summary, trailing)}
    records.sort(key=lambda r: r["round"])  # select() checked every record has a unique round
    for metric in metrics:
        value = chosen.get(metric)
        if metric in TRAILING_METRICS and value is None:
            key, window = TRAILING_METRICS[metric]
            raise DataError(
                f"{run_dir}: {metric!r} is the mean of {key!r} over the last {window} rounds; "
                "neither its summary.json ('trailing') nor its rounds.jsonl (absent, or fewer "
                "rounds with it) has it"
            )
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise DataError(
                f"{metrics_path}: round {chosen['round']} has no numeric {metric!r} (got {value!r})"
            )
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except yaml.YAMLError as err:
        raise DataError(f"{run_dir / 'config.yaml'}: not valid YAML ({err})") from err
    if not isinstance(config, dict):
        raise DataError(f"{run_dir / 'config.yaml'}: expected a mapping")
    config = resolved_config(config)
    run = RunResult(run_dir, algorithm, dataset, targets, seed, chosen, records, summary, config)
    notes = _consistency_warnings(run, selection)
    if "diverged" in summary:  # finished on the evaluations before its model diverged
        notes.append(f"{run_dir}: {summary['diverged']['message']} (scored up to then)")
    return run, notes


def resolved_config(raw: dict) -> dict:
    """A run's saved config with its ``algorithm`` section resolved: every hyper-parameter of
    the method typed and its default filled in, so that ``mu: "1e-2"`` (an older saved config)
    and ``mu: 0.01``, or ``algorithm: fedprox`` and ``{name: fedprox, mu: 0.01}``, are one
    setting. A section this version cannot resolve (a method it does not know) stays as
    written."""
    from feddomain.algorithms import typed_section  # late: the methods import torch

    section = raw.get("algorithm", {"name": "fedavg"})
    try:
        return {**raw, "algorithm": typed_section(section, defaults=True)}
    except (ConfigError, TypeError, ValueError):
        return raw


def trailing_metrics(run_dir: Path, summary: dict, names: list[str]) -> dict[str, float]:
    """Those of ``names`` (keys of ``TRAILING_METRICS``) the run has: from its summary
    (``trailing``), else from its ``rounds.jsonl`` (a run from before summaries kept them)."""
    saved = summary.get("trailing")
    found = {n: saved[n] for n in names if n in saved} if isinstance(saved, dict) else {}
    missing = [n for n in names if n not in found]
    path = run_dir / "rounds.jsonl"
    if missing and path.is_file():
        found |= trailing_means(read_metrics(path), missing)
    return found


def with_nested_metrics(record: dict) -> dict:
    """``record`` with the nested metrics of ``NESTED_METRICS`` at top level, where it has them
    (fairness over clients, and the hypernetwork methods' diagnostics, fedvr.md §5)."""
    found = {
        name: record[field][key]
        for name, (field, key) in NESTED_METRICS.items()
        if isinstance(record.get(field), dict) and key in record[field]
    }
    return {**record, **found}


def _consistency_warnings(run: RunResult, selection: str) -> list[str]:
    """Flag a summary whose own selection disagrees with what metrics.jsonl gives for it."""
    if run.summary.get("selection") != selection:
        return []
    out = []
    for metric in ("ood_acc", "id_acc"):
        value = run.summary.get(metric)
        if isinstance(value, int | float) and not math.isclose(
            value, run.selected[metric], abs_tol=1e-6
        ):
            out.append(
                f"{run.path}: summary {metric}={value} but metrics.jsonl gives "
                f"{run.selected[metric]} at round {run.selected['selected_round']} "
                f"under {selection!r}; the table uses metrics.jsonl"
            )
    return out


# Settings that do not make two runs different experiments: the seed and targets (a group's own
# axes), and where or how fast it ran.
NOT_SETTINGS = frozenset(
    {"name", "seed", "split.targets", "threads", "checkpoint.every", "dataset.root",
     "dataset.cache_dir", "eval.batch_size", "algorithm.label", "device", "deterministic"}
)  # fmt: skip


def label_by_settings(runs: list[RunResult]) -> list[RunResult]:
    """Runs that share a label but not their settings (config.yaml, less ``NOT_SETTINGS``) get
    the settings that differ among them added to it, e.g. ``fedprox (mu=0.01)``: otherwise two
    FedProx runs with different ``mu`` are one seed group (different seeds: averaged together)
    or refused as duplicates (the same seed)."""
    defaults = _flatten(ExperimentConfig().to_dict())  # for keys a run's config lacks (older)
    settings = {run.path: {**defaults, **_flatten(run.config)} for run in runs}
    by_label: dict[tuple[str, str], list[RunResult]] = {}
    for run in runs:  # per dataset: other datasets may need other settings (resolution, model)
        by_label.setdefault((run.algorithm, run.dataset), []).append(run)
    out = []
    for (label, _), members in by_label.items():
        keys = sorted({k for m in members for k in settings[m.path]})
        varied = [k for k in keys if len({settings[m.path].get(k) for m in members}) > 1]
        for run in members:
            if varied:
                shown = ", ".join(
                    f"{_short(k)}={settings[run.path].get(k, 'default')}" for k in varied
                )
                run = replace(run, algorithm=f"{label} ({shown})")
            out.append(run)
    return out


def _flatten(raw: dict) -> dict[str, str]:
    """Dotted keys (less ``NOT_SETTINGS``) to text: strings as they are, else compact JSON."""
    flat: dict[str, str] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, dotted + ".")
            elif dotted not in NOT_SETTINGS:
                text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
                flat[dotted] = text

    walk(raw, "")
    return flat


def _short(key: str) -> str:
    """A method's own hyper-parameters are shown without the ``algorithm.`` prefix."""
    return key.removeprefix("algorithm.")


def _group(runs: list[RunResult], metrics: tuple[str, ...] = METRICS) -> list[GroupResult]:
    by_key: dict[tuple[str, str, str], list[RunResult]] = {}
    for run in runs:
        by_key.setdefault((run.algorithm, run.dataset, run.target), []).append(run)
    groups = []
    for (algorithm, dataset, target), members in sorted(by_key.items()):
        seen: dict[int, Path] = {}
        for run in members:
            if run.seed in seen:
                raise DataError(
                    f"runs {seen[run.seed]} and {run.path} are both {algorithm} on {dataset}/"
                    f"{target} with seed {run.seed}; keep one so seeds are not double-counted"
                )
            seen[run.seed] = run.path
        members.sort(key=lambda r: r.seed)
        stats = {m: Stat.of([r.selected[m] for r in members]) for m in metrics}
        groups.append(GroupResult(algorithm, dataset, target, tuple(members), stats))
    return groups


def build_report(
    dirs: list[Path],
    *,
    selection: str = "source_val",
    out: Path | None = None,
    spread: str = "std",
    extra_metrics: tuple[str, ...] = (),
    against_method: str | None = None,
    claims_file: Path | None = None,
    bootstrap: bool = False,
) -> Report:
    """Read every run under ``dirs``; when ``out`` is given write report.md, report.csv, plots.
    ``extra_metrics`` (of ``OPTIONAL_METRICS``) add their tables after the standard ones.
    ``against_method`` (every other row > it) and ``claims_file`` ("A > B" lines) add claims
    with paired 95% intervals (t, or a paired bootstrap with ``bootstrap``)."""
    if selection not in RULES:
        raise ConfigError(f"unknown selection rule {selection!r}; choose one of {list(RULES)}")
    if spread not in SPREADS:
        raise ConfigError(f"unknown spread {spread!r}; choose one of {list(SPREADS)}")
    unknown = [m for m in extra_metrics if m not in OPTIONAL_METRICS]
    if unknown:
        raise ConfigError(f"unknown metric(s) {unknown}; choose from {list(OPTIONAL_METRICS)}")
    metrics = METRICS + tuple(dict.fromkeys(extra_metrics))
    finished, unfinished = find_runs([Path(d) for d in dirs])
    if not finished:
        names = ", ".join(str(d) for d in dirs)
        raise DataError(f"no finished runs (directories with summary.json) under {names}")
    warnings = [
        f"skipped run {d}: it diverged before any evaluation"
        if (d / DIVERGED_RECORD).is_file()
        else f"skipped unfinished run {d} (no summary.json)"
        for d in unfinished
    ]
    claim_specs = read_claims(Path(claims_file)) if claims_file else []
    claimed = tuple(spec.metric for spec in claim_specs)
    runs = []
    for run_dir in finished:
        run, notes = load_run(run_dir, selection, metrics, claimed)
        runs.append(run)
        warnings += notes
    runs = label_by_settings(runs)
    groups = _group(runs, metrics)
    notes = warnings + mixing_warnings(groups)
    report = Report(selection, runs, groups, notes, spread=spread, metrics=metrics)
    specs = against(report, against_method) if against_method else []
    specs += claim_specs
    report.claims = evaluate(report, specs, bootstrap=bootstrap)
    report.tuning = tuning(runs)
    if out is not None:
        write_outputs(report, Path(out))
    return report


# ---------------------------------------------------------------------------------------------
# Writing


def write_outputs(report: Report, out: Path, plots: bool = True) -> None:
    """report.md, report.csv, report.tex and (``plots``) the PNG/PDF plots into ``out``; paths
    appended to ``report.files``. The plots are most of the time (matplotlib's layout and
    rendering, docs/performance.md): leave them out where only the tables are wanted."""
    out.mkdir(parents=True, exist_ok=True)
    md = out / "report.md"
    md.write_text(report.to_markdown())
    table = out / "report.csv"
    with table.open("w", newline="") as fh:
        extra = [c for m in report.metrics if m not in METRICS for c in (m, f"{m}_std")]
        writer = csv.DictWriter(fh, fieldnames=[*CSV_COLUMNS[:-1], *extra, CSV_COLUMNS[-1]])
        writer.writeheader()
        writer.writerows(report.rows())
    tex = out / "report.tex"
    tex.write_text(report.to_latex())
    report.files += [md, table, tex]
    if plots:
        _write_plots(report, out)


def _write_plots(report: Report, out: Path) -> None:
    by_target = _by_target(report.groups)
    for dataset in report.datasets():
        mine = {t: g for (d, t), g in by_target.items() if d == dataset}
        report.files += _save(_overview(dataset, mine), out / f"overview_{_slug(dataset)}")
    for (dataset, target), groups in by_target.items():
        stem = _slug(f"{dataset}_{target}")
        report.files += _save(_plot_curves(groups), out / f"curves_{stem}")
        for name, plot in (("reliability", _plot_reliability), ("confidence", _plot_confidence)):
            fig = plot(groups)
            if fig is not None:
                report.files += _save(fig, out / f"{name}_{stem}")


def _save(fig: Figure, stem: Path) -> list[Path]:
    """The figure as PNG (to look at) and PDF (to put in a paper)."""
    paths = [stem.with_suffix(".png"), stem.with_suffix(".pdf")]
    for path in paths:
        fig.savefig(path, dpi=150)
    return paths


def _by_target(groups: list[GroupResult]) -> dict[tuple[str, str], list[GroupResult]]:
    out: dict[tuple[str, str], list[GroupResult]] = {}
    for g in groups:
        out.setdefault((g.dataset, g.target), []).append(g)
    return out


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", text)


def _seed_curves(group: GroupResult, metric: str) -> tuple[list[int], np.ndarray]:
    """(rounds every seed evaluated, [seeds, rounds] values in %)."""
    per_seed = [{r["round"]: r[metric] for r in run.records if metric in r} for run in group.runs]
    rounds = sorted(set.intersection(*(set(s) for s in per_seed)))
    return rounds, 100 * np.array([[s[r] for r in rounds] for s in per_seed], dtype=np.float64)


def _draw_curve(ax, group: GroupResult, metric: str, colour: str) -> None:
    """Mean over seeds, a band from the lowest to the highest seed, and a star at the selected
    round (the median over seeds)."""
    rounds, values = _seed_curves(group, metric)
    seeds = len(group.runs)
    label = f"{group.algorithm} ({seeds} seed{'s' if seeds > 1 else ''})"
    ax.plot(rounds, values.mean(axis=0), color=colour, marker=".", label=label)
    if seeds > 1:
        ax.fill_between(rounds, values.min(axis=0), values.max(axis=0), color=colour, alpha=0.2)
    chosen = int(np.median([r.selected["selected_round"] for r in group.runs]))
    if chosen in rounds:
        y = values.mean(axis=0)[rounds.index(chosen)]
        ax.plot([chosen], [y], marker="*", markersize=12, color=colour, markeredgecolor="black")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="round", ylabel=METRIC_TITLES[metric])
    ax.grid(alpha=0.3)


def _colours(groups: list[GroupResult]) -> dict[str, str]:
    names = sorted({g.algorithm for g in groups})
    return {name: f"C{i % 10}" for i, name in enumerate(names)}


def _plot_curves(groups: list[GroupResult]) -> Figure:
    fig = Figure(figsize=(10, 4), layout="constrained")
    axes = fig.subplots(1, 2)
    colours = _colours(groups)
    for ax, metric in zip(axes, ("id_acc", "ood_acc"), strict=True):
        for g in groups:
            _draw_curve(ax, g, metric, colours[g.algorithm])
        ax.set_title(METRIC_TITLES[metric])
    _legend_below(fig, axes[1])
    _suptitle(
        fig,
        f"{groups[0].dataset}, unseen target {groups[0].target}: mean over seeds, band from "
        "lowest to highest seed, ★ selected round",
    )
    return fig


def _overview(dataset: str, by_target: dict[str, list[GroupResult]]) -> Figure:
    """One figure per experiment: the ood accuracy curves of every target side by side."""
    targets = sorted(by_target)
    fig = Figure(figsize=(4 * len(targets), 3.6), layout="constrained")
    axes = fig.subplots(1, len(targets), squeeze=False)[0]
    colours = _colours([g for gs in by_target.values() for g in gs])
    for ax, target in zip(axes, targets, strict=True):
        for g in by_target[target]:
            _draw_curve(ax, g, "ood_acc", colours[g.algorithm])
        ax.set_title(f"target {target}")
    _legend_below(fig, axes[-1])
    _suptitle(fig, f"{dataset}: ood accuracy per unseen target (★ selected round)")
    return fig


def _suptitle(fig: Figure, text: str) -> None:
    """The figure's title, wrapped to its width (a one-panel figure clipped a one-line title)."""
    fig.suptitle(textwrap.fill(text, width=int(fig.get_figwidth() * CHARS_PER_INCH)))


def _legend_below(fig: Figure, ax) -> None:
    """The methods' legend under the panels, where it covers no curve."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 6),
               fontsize="small", frameon=False)  # fmt: skip


def _vector(path: Path, key: str, value: object, size: int | None) -> np.ndarray:
    """A list of numbers from summary.json, of ``size`` entries when given, as float64."""
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        arr = np.empty((0, 0))
    if arr.ndim != 1 or (size is not None and arr.size != size):
        want = f"a list of {size} numbers" if size is not None else "a list of numbers"
        raise DataError(f"{path / 'summary.json'}: {key} must be {want}, got {value!r}")
    return arr


def pool_reliability(group: GroupResult) -> dict[str, np.ndarray] | None:
    """``reliability.ood`` pooled over the seeds that logged it, or None if none did.

    Bin counts add up; mean confidence and accuracy are count-weighted.
    """
    sums = None
    for run in group.runs:
        rel = run.summary.get("reliability")
        if not isinstance(rel, dict) or "ood" not in rel:
            continue
        table = rel["ood"] if isinstance(rel["ood"], dict) else {}
        size = None if sums is None else sums.shape[1]
        count = _vector(run.path, "reliability.ood.count", table.get("count"), size)
        conf = _vector(run.path, "reliability.ood.conf", table.get("conf"), count.size)
        acc = _vector(run.path, "reliability.ood.acc", table.get("acc"), count.size)
        part = np.stack([count, count * conf, count * acc])
        sums = part if sums is None else sums + part
    if sums is None:
        return None
    count, conf_sum, acc_sum = sums
    safe = np.maximum(count, 1)
    return {"count": count, "conf": conf_sum / safe, "acc": acc_sum / safe}


def expected_calibration_error(pooled: dict[str, np.ndarray]) -> float:
    """ECE of pooled reliability bins: the count-weighted mean |accuracy - confidence|."""
    count = pooled["count"]
    return float(np.sum(count * np.abs(pooled["acc"] - pooled["conf"])) / max(count.sum(), 1))


def _plot_reliability(groups: list[GroupResult]) -> Figure | None:
    pooled = [(g, pool_reliability(g)) for g in groups]
    pooled = [(g, p) for g, p in pooled if p is not None]
    if not pooled:
        return None
    fig = Figure(figsize=(max(3.2 * len(pooled), 4.8), 3.6), layout="constrained")
    axes = fig.subplots(1, len(pooled), squeeze=False)[0]
    for ax, (g, p) in zip(axes, pooled, strict=True):
        n_bins = len(p["count"])
        centres = (np.arange(n_bins) + 0.5) / n_bins
        used = p["count"] > 0
        ax.bar(centres[used], p["acc"][used], width=1 / n_bins, edgecolor="black", label="accuracy")
        ax.plot(p["conf"][used], p["conf"][used], "r.", label="mean confidence")
        ax.plot([0, 1], [0, 1], "k--", linewidth=0.8)
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence", title=g.algorithm)
        ece = 100 * expected_calibration_error(p)
        ax.text(  # on a white box: over-confident bars fill this corner
            0.97,
            0.05,
            f"ECE {ece:.1f}%",
            ha="right",
            transform=ax.transAxes,
            bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "none"},
        )
    axes[0].set_ylabel("accuracy")
    axes[0].legend(fontsize="small", loc="upper left")
    _suptitle(
        fig,
        f"Reliability on unseen target {groups[0].target} ({groups[0].dataset}), "
        "each run's reported model, seeds pooled",
    )
    return fig


def pool_confidence_hist(group: GroupResult) -> dict[str, dict[str, np.ndarray]]:
    """{split: {"correct": counts, "incorrect": counts}} summed over the seeds that logged it."""
    pooled: dict[str, dict[str, np.ndarray]] = {}
    for run in group.runs:
        hist = run.summary.get("confidence_hist")
        if not isinstance(hist, dict):
            continue
        for split, parts in hist.items():
            for kind in ("correct", "incorrect"):
                value = parts.get(kind) if isinstance(parts, dict) else None
                slot = pooled.setdefault(split, {}).get(kind)
                key = f"confidence_hist.{split}.{kind}"
                counts = _vector(run.path, key, value, None if slot is None else slot.size)
                pooled[split][kind] = counts if slot is None else slot + counts
    return pooled


def _plot_confidence(groups: list[GroupResult]) -> Figure | None:
    pooled = [(g, h) for g in groups if (h := pool_confidence_hist(g))]
    if not pooled:
        return None
    splits = sorted({s for _, h in pooled for s in h})
    fig = Figure(figsize=(3.6 * len(splits), 2.8 * len(pooled)), layout="constrained")
    axes = fig.subplots(len(pooled), len(splits), squeeze=False)
    for row, (g, hist) in zip(axes, pooled, strict=True):
        for ax, split in zip(row, splits, strict=True):
            for kind, colour in (("correct", "tab:green"), ("incorrect", "tab:red")):
                counts = hist.get(split, {}).get(kind)
                if counts is None or counts.sum() == 0:
                    continue
                edges = np.linspace(0, 1, counts.size + 1)
                density = counts / (counts.sum() / counts.size)  # integrates to 1 over [0, 1]
                ax.stairs(density, edges, color=colour, label=kind)
            ax.set(title=f"{g.algorithm} — {split}", xlim=(0, 1), xlabel="max probability")
    axes[0][0].set_ylabel("density")
    axes[0][0].legend(fontsize="small", loc="upper left")
    _suptitle(fig, f"{groups[0].dataset} target {groups[0].target}: confidence, correct vs wrong")
    return fig


# ---------------------------------------------------------------------------------------------
# One self-contained page

STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;"
    "color:#222}table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;"
    "padding:.3em .6em;text-align:right}th:first-child,td:first-child{text-align:left}"
    "th{background:#f3f3f3}img{max-width:100%}figure{margin:1.5em 0}"
)


def write_html(report: Report, path: Path) -> Path:
    """``path``: the report's tables and notes, and every PNG figure already written (embedded
    as data URIs), in one HTML file that needs nothing beside it."""
    body = _markdown_to_html(report.to_markdown())
    for png in (f for f in report.files if f.suffix == ".png"):
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        body.append(
            f'<figure><img alt="{html.escape(png.stem)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(png.name)}</figcaption></figure>"
        )
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(report.title())}</title><style>{STYLE}</style></head>"
        "<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    report.files.append(path)
    return path


def _markdown_to_html(markdown: str) -> list[str]:
    """The report's own markdown (headings, pipe tables, bullet notes, paragraphs) as HTML."""
    out: list[str] = []
    table: list[list[str]] = []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("|"):
            if not set(line) <= set("|-"):  # the rule under the header
                table.append([c.strip() for c in line.strip("|").split("|")])
            continue
        if table:
            head, *rows = table
            out.append(
                "<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in head) + "</tr>"
                + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
                          for r in rows) + "</table>"
            )  # fmt: skip
            table = []
        if line.startswith("## "):
            out.append(f"<h2>{html.escape(line[3:])}</h2>")
        elif line.startswith("# "):
            out.append(f"<h1>{html.escape(line[2:])}</h1>")
        elif line.startswith("- "):
            out.append(f"<p>• {html.escape(line[2:])}</p>")
        elif line.strip():
            out.append(f"<p>{html.escape(line)}</p>")
    return out
