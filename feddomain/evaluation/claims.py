"""Claims "A > B" (or on gains, "A - B > C - D") as paired differences with 95% intervals
(``feddomain report --against`` / ``--claims``), and the tuning behind each method
(``feddomain tune``'s ``selected.yaml``).

A claim compares two report rows (method labels) on one metric over the (dataset, target,
seed) cells both have: ``A > B`` (ood accuracy), or ``A < B on ood_ece`` (a metric where lower
is the claim: calibration error, the spread over clients). A claim on gains compares two
differences: ``A - B > C - D`` (A gains more over B than C over D; HFedATM's "larger gains with
FedSR clients than with FedAvg") over the cells all four rows have. The difference d = A - B
(or (A - B) - (C - D)) per cell, its mean and a 95% interval come from Student's t over the
pairs (``scipy.stats.t``) or, on request, a paired percentile bootstrap
(``scipy.stats.bootstrap``, seeded). The verdict is the protocol's (``shared/protocols.md``):
the claim **holds** when the whole interval lies on the claimed side of 0, is **refuted** when
it lies on the other, and is **unresolved** otherwise (fewer than 2 pairs included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml
from scipy import stats

from feddomain.errors import DataError

if TYPE_CHECKING:
    from feddomain.evaluation.report import Report, RunResult

CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 9999


DEFAULT_METRIC = "ood_acc"
DIRECTIONS = (">", "<")


@dataclass(frozen=True)
class ClaimSpec:
    """What is claimed: row ``first`` above (``>``) or below (``<``) row ``second`` on
    ``metric``; with baselines, ``first``'s gain over ``first_baseline`` against ``second``'s
    gain over ``second_baseline``."""

    first: str
    second: str
    direction: str = ">"
    metric: str = DEFAULT_METRIC
    first_baseline: str | None = None
    second_baseline: str | None = None

    def __post_init__(self) -> None:
        if (self.first_baseline is None) != (self.second_baseline is None):
            raise ValueError("a claim on gains needs a baseline on both sides: 'A - B > C - D'")

    @property
    def rows(self) -> tuple[str, ...]:
        """Every report row the claim reads."""
        sides = (self.first, self.first_baseline, self.second, self.second_baseline)
        return tuple(row for row in sides if row is not None)

    @property
    def text(self) -> str:
        """``"A > B"`` or ``"A - B > C - D"``, with ``" on METRIC"`` when the metric is not ood
        accuracy."""
        on = "" if self.metric == DEFAULT_METRIC else f" on {self.metric}"
        first = _side_text(self.first, self.first_baseline)
        return f"{first} {self.direction} {_side_text(self.second, self.second_baseline)}{on}"

    @classmethod
    def parse(cls, text: str) -> ClaimSpec:
        """``"A > B"``, ``"A - B > C - D"``, either with ``" on METRIC"``; a ValueError says
        what is wrong."""
        usage = f"{text!r} is not 'A > B', 'A - B > C - D' or either with ' on METRIC'"
        claim, on, metric = text.rpartition(" on ")
        if not on:
            claim, metric = text, DEFAULT_METRIC
        operators = [d for d in DIRECTIONS if d in claim]
        if len(operators) != 1 or claim.count(operators[0]) != 1:
            raise ValueError(usage)
        sides = [_parse_side(part) for part in claim.split(operators[0])]
        if None in sides or not metric.strip() or " " in metric.strip():
            raise ValueError(usage)
        (first, first_baseline), (second, second_baseline) = sides
        return cls(first, second, operators[0], metric.strip(), first_baseline, second_baseline)


def _side_text(row: str, baseline: str | None) -> str:
    return row if baseline is None else f"{row} - {baseline}"


def _parse_side(text: str) -> tuple[str, str | None] | None:
    """``"A"`` or ``"A - B"`` (labels without spaces); None when it is neither."""
    names = [name.strip() for name in text.split(" - ")]
    if not 1 <= len(names) <= 2 or any(not name or " " in name for name in names):
        return None
    return names[0], (names[1] if len(names) == 2 else None)


@dataclass(frozen=True)
class Claim:
    """A claim with its evidence: the mean paired difference first - second and its
    interval."""

    spec: ClaimSpec
    pairs: int
    mean: float
    low: float
    high: float
    interval: str  # "t" or "bootstrap"

    @property
    def verdict(self) -> str:
        above, below = self.low > 0, self.high < 0
        toward, against = (above, below) if self.spec.direction == ">" else (below, above)
        if toward:
            return "holds"
        if against:
            return "refuted"
        return "unresolved"

    def difference(self, value: float, decimals: int = 1) -> str:
        """A difference in the metric's unit: points for a percentage, else as it is."""
        from feddomain.evaluation.report import PERCENT  # late: report imports this module

        if math.isnan(value):
            return "—"
        if self.spec.metric in PERCENT:
            return f"{100 * value:+.{decimals}f}"
        return f"{value:+.3g}"

    def interval_text(self, decimals: int = 1) -> str:
        if math.isnan(self.low):
            return "—"
        return f"[{self.difference(self.low, decimals)}, {self.difference(self.high, decimals)}]"


def t_interval(diffs: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """mean ± t_{(1+c)/2, n-1} · s / √n over the paired differences (NaN for fewer than 2)."""
    n = diffs.size
    mean = float(diffs.mean()) if n else math.nan
    if n < 2:
        return math.nan, math.nan
    sem = float(diffs.std(ddof=1)) / math.sqrt(n)
    if sem == 0.0:  # every pair differs by the same amount: no spread, no width
        return mean, mean
    low, high = stats.t.interval(confidence, n - 1, loc=mean, scale=sem)
    return float(low), float(high)


def bootstrap_interval(
    diffs: np.ndarray, confidence: float = CONFIDENCE, seed: int = 0
) -> tuple[float, float]:
    """Percentile interval of the mean difference over pairs resampled with replacement
    (pairs are kept whole: a paired bootstrap); NaN for fewer than 2 pairs."""
    if diffs.size < 2:
        return math.nan, math.nan
    if np.all(diffs == diffs[0]):
        return float(diffs[0]), float(diffs[0])
    res = stats.bootstrap(
        (diffs,),
        np.mean,
        confidence_level=confidence,
        n_resamples=BOOTSTRAP_RESAMPLES,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def paired_differences(runs: list[RunResult], spec: ClaimSpec) -> np.ndarray:
    """A - B, or (A - B) - (C - D), over the (dataset, target, seed) cells every row of the
    claim has, in a fixed order."""
    cells: dict[str, dict[tuple[str, str, int], float]] = {row: {} for row in spec.rows}
    for run in runs:
        if run.algorithm in cells:
            value = float(run.selected[spec.metric])
            cells[run.algorithm][(run.dataset, run.target, run.seed)] = value
    shared = sorted(set.intersection(*(set(values) for values in cells.values())))

    def side(row: str, baseline: str | None, cell: tuple[str, str, int]) -> float:
        return cells[row][cell] - (cells[baseline][cell] if baseline is not None else 0.0)

    return np.array(
        [
            side(spec.first, spec.first_baseline, cell)
            - side(spec.second, spec.second_baseline, cell)
            for cell in shared
        ],
        dtype=np.float64,
    )


def evaluate(report: Report, specs: list[ClaimSpec], bootstrap: bool = False) -> list[Claim]:
    """Each claim over the report's runs; a label the report lacks, or a metric its runs of
    those rows do not record, is an error naming what there is."""
    labels = sorted({r.algorithm for r in report.runs})
    for name in {row for spec in specs for row in spec.rows}:
        if name not in labels:
            raise DataError(f"claim names {name!r}, which no report row has (rows: {labels})")
    claims = []
    for spec in specs:
        _check_metric(report.runs, spec)
        diffs = paired_differences(report.runs, spec)
        low, high = bootstrap_interval(diffs) if bootstrap else t_interval(diffs)
        mean = float(diffs.mean()) if diffs.size else math.nan
        kind = "bootstrap" if bootstrap else "t"
        claims.append(Claim(spec, int(diffs.size), mean, low, high, kind))
    return claims


def _check_metric(runs: list[RunResult], spec: ClaimSpec) -> None:
    for run in runs:
        if run.algorithm in spec.rows:
            value = run.selected.get(spec.metric)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise DataError(
                    f"claim {spec.text!r}: run {run.path} records no numeric {spec.metric!r} "
                    "at its selected round"
                )


def against(report: Report, baseline: str) -> list[ClaimSpec]:
    """ "M > baseline" for every other row of the report."""
    labels = sorted({r.algorithm for r in report.runs})
    if baseline not in labels:
        raise DataError(f"--against {baseline!r}: no report row has that name (rows: {labels})")
    return [ClaimSpec(label, baseline) for label in labels if label != baseline]


def read_claims(path: Path) -> list[ClaimSpec]:
    """A claims file: a YAML list of "A > B" / "A < B on METRIC" / "A - B > C - D" strings, or
    plain text with one per line (``#`` starts a comment)."""
    try:
        text = path.read_text()
    except OSError as err:
        raise DataError(f"claims file {path}: cannot read ({err})") from err
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    lines = data if isinstance(data, list) else text.splitlines()
    specs = []
    for number, line in enumerate(lines, start=1):
        entry = str(line).split("#", 1)[0].strip()
        if not entry:
            continue
        try:
            specs.append(ClaimSpec.parse(entry))
        except ValueError as err:
            raise DataError(f"claims file {path}, entry {number}: {err}") from None
    if not specs:
        raise DataError(f"claims file {path} lists no claim ('A > B', one per line)")
    return specs


def claims_markdown(claims: list[Claim]) -> list[str]:
    if not claims:
        return []
    kind = "Student t over the pairs" if claims[0].interval == "t" else "paired bootstrap"
    lines = [
        "",
        "## Claims — paired difference A − B (ood accuracy unless the claim names a metric; "
        "percentages in points), 95% interval",
        "",
        f"Pairs: the (dataset, target, seed) cells both rows have; interval: {kind}. holds: the "
        "whole interval on the claimed side of 0 (above for >, below for <); refuted: on the "
        "other side; unresolved: otherwise.",
        "",
        "| claim | pairs | mean A − B | 95% interval | verdict |",
        "|---|---|---|---|---|",
    ]
    for c in claims:
        lines.append(
            f"| {c.spec.text} | {c.pairs} | {c.difference(c.mean, 2)} | {c.interval_text(2)} | "
            f"{c.verdict} |"
        )
    return lines


# ---------------------------------------------------------------------------------- tuning
def tune_of(run_dir: Path) -> Path | None:
    """The tune a run belongs to: ``<tune>/confirm/.../<run>`` with ``<tune>/selected.yaml``."""
    for parent in run_dir.parents:
        if parent.name == "confirm" and (parent.parent / "selected.yaml").is_file():
            return parent.parent
    return None


def tuning(runs: list[RunResult]) -> dict[str, dict[str, Any]]:
    """Per report row, the selection of the tune(s) its runs confirm (``selected.yaml``)."""
    from feddomain.tune import read_selected

    found: dict[str, dict[str, Any]] = {}
    for run in runs:
        tune_dir = tune_of(run.path)
        if tune_dir is not None and run.algorithm not in found:
            found[run.algorithm] = {"dir": tune_dir, **read_selected(tune_dir / "selected.yaml")}
    return found


def tuning_markdown(found: dict[str, dict[str, Any]]) -> list[str]:
    if not found:
        return []
    lines = [
        "",
        "## Tuning — the selected hyper-parameters behind each row (feddomain tune)",
        "",
        "| method | selected | trials | objective | tune |",
        "|---|---|---|---|---|",
    ]
    for label, sel in sorted(found.items()):
        chosen = ", ".join(sel["selected"]["overrides"]) or "(defaults)"
        objective = "ORACLE (target accuracy)" if sel.get("oracle") else "source validation"
        lines.append(f"| {label} | {chosen} | {sel['trials']} | {objective} | {sel['dir']} |")
    return lines
